"""Checkpoints the master orchestrates, and resuming from them.

A checkpoint is written into `checkpoints/stepNNNNNN.tmp/` (workers write weights, optimizer and
RNG state and fsync them; the master then writes and fsyncs `master.json` with the step and the
data position) and only then renamed to `checkpoints/stepNNNNNN/`, and the rename is fsynced. A
directory named `stepNNNNNN` is therefore complete, on disk and not only in the page cache
(`realrl.workers.checkpoint_disk`): a process killed while writing leaves a `.tmp` directory
that recovery never uses and the next run removes (`discard_incomplete`).

`checkpoint.keep_last=N` keeps the N newest complete checkpoints: older ones are deleted right
after a new one is renamed complete, so at every moment at least one complete checkpoint
exists. A checkpoint is renamed `stepNNNNNN.deleting` before its files go, so one that a crash
leaves half-deleted is never mistaken for a complete one. `checkpoint.weights_only=true` leaves
the optimizer state out (see `realrl.workers.checkpointing`).

`checkpoints/latest` is a relative symbolic link to the newest complete checkpoint, replaced
atomically after each one is renamed complete: once a run is over, `checkpoints/latest/<role>`
is its final model, a path the next stage of a chain (sft -> rw -> ppo-rlhf -> gen,
docs/recipe.md) names without knowing the step count. Recovery never reads it; a resumed
run points it at the newest complete checkpoint again (`discard_incomplete`).

A save that fails (a full disk) removes its `.tmp` directory and raises `CheckpointWriteError`,
one line naming the path, the reason and the fix; the previous checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import time
from pathlib import Path

from realrl.api.errors import UserFacingError
from realrl.workers.checkpoint_disk import fsync_path, out_of_space, write_failure_reason

logger = logging.getLogger(__name__)

_COMPLETE_NAME = re.compile(r"step\d+")
_INCOMPLETE_SUFFIXES = (".tmp", ".deleting")
LATEST_LINK = "latest"


class CheckpointWriteError(UserFacingError):
    """A checkpoint could not be written; the message is one line with the path and the fix."""


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _COMPLETE_NAME.fullmatch(p.name) and p.is_dir()
                  and (p / "master.json").is_file())


def latest_complete_checkpoint(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def discard_incomplete(run_dir: Path) -> None:
    """Remove what interrupted saves and deletions left (`.tmp`, `.deleting` directories), and
    point `checkpoints/latest` at the newest complete checkpoint again (a save killed between
    its rename and the link's swap left it one checkpoint behind, possibly at a pruned one)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.name.startswith("step") and path.name.endswith(_INCOMPLETE_SUFFIXES):
            logger.info("removing %s, left by an interrupted checkpoint save or deletion", path)
            shutil.rmtree(path, ignore_errors=True)
    newest = latest_complete_checkpoint(run_dir)
    if newest is not None:
        point_latest_at(newest)


async def save(master, data, run_dir: Path, step: int) -> Path:
    """Write the checkpoint after `step` steps; returns its directory. Raises
    `CheckpointWriteError` (the `.tmp` directory removed) when it cannot be written."""
    from realrl.workers.wire import RemoteError  # here: the launcher lists checkpoints torch-free

    root = checkpoint_root(run_dir)
    final = root / f"step{step:06d}"
    staging = root / f"step{step:06d}.tmp"
    settings = master.plan.base.checkpoint
    started = time.perf_counter()
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        await master.broadcast("save", {"directory": str(staging.resolve())})
        state = {"step": step, "data": data.state_dict(), "weights_only": settings.weights_only}
        _write_durably(staging / "master.json", json.dumps(state, indent=1))
        staging.rename(final)
        fsync_path(root)
    except (RemoteError, OSError) as error:
        problem = _describe_failed_save(error, final, staging, run_dir)
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(problem) from error
    logger.info("saved checkpoint %s (%.1f MB in %.2f s)", final, _size_bytes(final) / 1e6,
                time.perf_counter() - started)
    point_latest_at(final)
    prune(run_dir, settings.keep_last)
    return final


def point_latest_at(checkpoint: Path) -> None:
    """Make `checkpoints/latest` a link to `checkpoint` (relative, so a moved or copied run
    directory keeps it), swapped in with one rename: a reader sees the old or the new target,
    never no link. Where links cannot be made (some network filesystems) the stale link is
    removed and a warning names the checkpoint to use instead; training goes on."""
    link = checkpoint.parent / LATEST_LINK
    staging = checkpoint.parent / f"{LATEST_LINK}.tmp"
    try:
        staging.unlink(missing_ok=True)
        staging.symlink_to(checkpoint.name, target_is_directory=True)
        staging.replace(link)
        fsync_path(checkpoint.parent)
    except OSError as error:
        with contextlib.suppress(OSError):
            link.unlink(missing_ok=True)
        logger.warning("could not point %s at %s (%s); use %s itself", link, checkpoint.name,
                       write_failure_reason(error, link), checkpoint)


def prune(run_dir: Path, keep_last: int | None) -> None:
    """Delete all but the `keep_last` newest complete checkpoints (none when 0 or None)."""
    if not keep_last:
        return
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        doomed = old.with_name(old.name + ".deleting")
        old.rename(doomed)  # no longer complete, whatever happens to the rmtree
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info("deleted checkpoint %s (checkpoint.keep_last=%d)", old, keep_last)


def _write_durably(path: Path, text: str) -> None:
    """Write `path` and fsync it and its directory: it goes last, after the workers' files."""
    with open(path, "w") as stream:
        stream.write(text)
        stream.flush()
        fsync_path(path)
    fsync_path(path.parent)


def _describe_failed_save(error: BaseException, final: Path, staging: Path, run_dir: Path) -> str:
    """One line: what could not be written, why, what is left, and what to do."""
    reason = str(error) if not isinstance(error, OSError) else write_failure_reason(error, staging)
    previous = latest_complete_checkpoint(run_dir)
    kept = (f"the previous checkpoint {previous} is intact" if previous is not None
            else "there is no earlier checkpoint")
    if out_of_space(error, staging):
        fix = ("free space there, keep fewer or smaller checkpoints (checkpoint.keep_last, "
               "checkpoint.weights_only=true) or move output_root to a larger disk")
    else:
        fix = "fix the cause (see the worker logs)"
    return (f"cannot write checkpoint {final}: {reason}; {kept} and the partial {staging.name} "
            f"was removed. To go on: {fix}, then resume with recover_mode=auto")


def _size_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


async def restore(master, data, checkpoint: Path, plan) -> int:
    """Load `checkpoint` into every worker and the data iterator; returns the step to run next."""
    state = json.loads((checkpoint / "master.json").read_text())
    if state.get("weights_only"):
        logger.warning(
            "%s is weights-only (checkpoint.weights_only=true): resuming at its step, data "
            "position and learning rate with AdamW's moments starting again from zero, so the "
            "next updates differ from an uninterrupted run's",
            checkpoint,
        )
    await master.broadcast("load", {"directory": str(checkpoint.resolve())})
    data.load_state_dict(state["data"])
    return int(state["step"])
