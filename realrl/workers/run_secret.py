"""The per-run secret that signs every message between realrl's processes.

The launcher calls `create_run_secret(run_dir)` once; processes on the same file system call
`load_run_secret(run_dir)`. Workers on other nodes may instead receive the secret as hex in
`$REALRL_RUN_SECRET` (`run_secret_env(secret)` builds it); when set it takes precedence over
the file. Standard library only, so the launcher starts without importing torch.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from realrl.api import environment

SECRET_FILE_NAME = ".secret"
SECRET_NUM_BYTES = 32


def create_run_secret(run_dir: str | Path) -> bytes:
    """Write 32 random bytes to `run_dir/.secret`, owner-only, and return them.

    The file appears atomically with its full content and mode 0600 (written under a
    temporary name created with O_EXCL, then hard-linked into place, which never
    overwrites): a concurrent reader sees either no file or the whole secret.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(SECRET_NUM_BYTES)
    final_path = run_dir / SECRET_FILE_NAME
    temporary_path = run_dir / f"{SECRET_FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
    descriptor = os.open(temporary_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as secret_file:
            secret_file.write(secret)
            secret_file.flush()
            os.fsync(secret_file.fileno())
        os.link(temporary_path, final_path)
    except FileExistsError:
        raise FileExistsError(
            f"{final_path} already exists: this run directory already has a secret. "
            "Use load_run_secret() to join the run, or use a fresh run directory."
        ) from None
    finally:
        temporary_path.unlink(missing_ok=True)
    return secret


def load_run_secret(run_dir: str | Path | None = None) -> bytes:
    """The run secret from `$REALRL_RUN_SECRET` (hex) if set, else from `run_dir/.secret`.

    The file must be owned by this user and readable by nobody else, since anyone who can
    read it can make the workers run arbitrary model calls.
    """
    from_env = os.environ.get(environment.RUN_SECRET)
    if from_env:
        try:
            secret = bytes.fromhex(from_env.strip())
        except ValueError:
            raise ValueError(f"${environment.RUN_SECRET} is not a hex string") from None
        if len(secret) != SECRET_NUM_BYTES:
            raise ValueError(
                f"${environment.RUN_SECRET} holds {len(secret)} bytes; expected "
                f"{SECRET_NUM_BYTES} (64 hex digits) as written by run_secret_env()"
            )
        return secret
    if run_dir is None:
        raise ValueError(f"no run secret: ${environment.RUN_SECRET} is unset and no run_dir given")
    path = Path(run_dir) / SECRET_FILE_NAME
    status = path.stat()
    if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or status.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} has mode {stat.filemode(status.st_mode)} and owner uid {status.st_uid}; "
            f"it must be owned by uid {os.geteuid()} and private. Fix with: chmod 600 {path}"
        )
    secret = path.read_bytes()
    if len(secret) != SECRET_NUM_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; expected {SECRET_NUM_BYTES}")
    return secret


def run_secret_env(secret: bytes) -> dict[str, str]:
    """Environment entries that hand `secret` to a worker on another node."""
    return {environment.RUN_SECRET: secret.hex()}
