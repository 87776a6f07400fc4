"""Checkpoint files on disk: making them durable, and saying why writing them failed.

Durable: the rename that marks a checkpoint complete (`realrl.workers.recovery`) is only worth
something if the files it publishes reach the disk first. Without `fsync` a power cut or a
kernel crash can leave a checkpoint directory renamed complete whose files are empty or cut
short (the rename's metadata may be written back before the data). So every writer fsyncs
what it wrote (`fsync_tree`: each worker after `save_worker_state`, the master for
`master.json`) and the directory entries holding them, and the master fsyncs the checkpoints
folder after the rename. A process killed with SIGKILL loses nothing that was written, fsync or
not (the kernel keeps its page cache); fsync is for the machine going down.

Failures: torch.save reports a full disk as `[enforce fail at inline_container.cc:...]
unexpected pos 576 vs 534`, safetensors as `I/O error: No space left on device (os error 28)`.
`write_failure_reason` turns either into one line that names the filesystem's free space, so the
user reads "no space left" instead of a traceback from inside torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

# Below this much free space after a failed write, the write failed for want of space.
NEARLY_FULL_BYTES = 1 << 20
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_SPACE_WORDS = ("no space left", "os error 28", "disk quota exceeded", "os error 122")


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first, `root` last.

    Other ranks write into the same tree at the same time, some through temporary files they
    rename (a tokenizer's `.tmpXXXX`): a file listed and gone before it is opened is skipped;
    its writer fsyncs what it renamed it to."""
    directories = []
    for folder, _, files in os.walk(root):
        directories.append(Path(folder))
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                fsync_path(Path(folder) / name)
    for directory in reversed(directories):
        fsync_path(directory)


def fsync_path(path: Path) -> None:
    """fsync one file or directory (a directory: the names it holds, e.g. after a rename)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def free_bytes(path: Path) -> int | None:
    """Free space for this user on the filesystem of `path` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def out_of_space(error: BaseException, path: Path) -> bool:
    """Whether writing under `path` failed because its filesystem (or quota) is full."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _SPACE_ERRNOS:
            return True
        if any(words in str(seen).lower() for words in _SPACE_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL_BYTES


def write_failure_reason(error: BaseException, path: Path) -> str:
    """One line: why writing under `path` failed, in the user's terms."""
    if out_of_space(error, path):
        free = free_bytes(path)
        left = "" if free is None else f", {free / 1e6:.1f} MB free"
        return f"no space left on the device of {path}{left}"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
