"""The environment variables realrl sets for its processes or reads from the user, in one place."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from realrl.api.config import ConfigError

# Set by the launchers (local and SLURM) for every process: the run directory.
RUN_DIR = "REALRL_RUN_DIR"
# The run's HMAC secret in hex, for processes that cannot read it from the run directory.
RUN_SECRET = "REALRL_RUN_SECRET"
# Torch threads of a launched process (the launcher splits the CPU cores between processes).
NUM_THREADS = "REALRL_NUM_THREADS"
# Set by the local launcher for model workers: the file through which idle workers lend their
# CPU threads to busy ones (`realrl.workers.core_share`).
CORE_SHARE = "REALRL_CORE_SHARE"
# Set by the local launcher for the master: that file, which the master removes once every
# worker has mapped it.
CORE_SHARE_FILE = "REALRL_CORE_SHARE_FILE"
# Where the built-in default model is built and cached, and the plan search's profiles,
# calibrations and results; default ~/.cache/realrl (`cache_dir`).
CACHE = "REALRL_CACHE"
# "0" makes CPU ranks on one machine sum gradients and send weights through gloo's sockets
# instead of shared memory (`realrl.backends.shared_memory`).
SHARED_MEMORY = "REALRL_SHARED_MEMORY"
# "0" makes the local launcher start the master and each worker as its own interpreter instead
# of forking them from one process that imported torch and realrl once
# (`realrl.launcher.forkserver`). Forking is Linux only, and for CPU workers only.
FORK_SERVER = "REALRL_FORK_SERVER"


def cache_dir() -> Path:
    """realrl's cache directory: `$REALRL_CACHE`, else ~/.cache/realrl."""
    return Path(os.environ.get(CACHE, Path.home() / ".cache" / "realrl")).expanduser()


def shared_memory_enabled() -> bool:
    """`REALRL_SHARED_MEMORY`: "1" (the default) or "0"; any other value is a `ConfigError`
    naming the fix. Read without torch, so the launcher checks it before starting anything."""
    value = os.environ.get(SHARED_MEMORY, "1")
    if value not in ("0", "1"):
        raise ConfigError([
            f"{SHARED_MEMORY}={value!r} is neither 0 nor 1: set it to 0 to sum gradients and "
            "send weights through gloo, or to 1 (or unset it) for shared memory"
        ])
    return value == "1"


def fork_server_enabled() -> bool:
    """`REALRL_FORK_SERVER`: "1" (the default, on Linux) or "0"; any other value is a
    `ConfigError` naming the fix. Elsewhere than on Linux every process starts its own
    interpreter (the fork server needs `prctl` to die with the launcher)."""
    value = os.environ.get(FORK_SERVER, "1")
    if value not in ("0", "1"):
        raise ConfigError([
            f"{FORK_SERVER}={value!r} is neither 0 nor 1: set it to 0 to start every process "
            "as its own interpreter, or to 1 (or unset it) to fork them from one that has "
            "imported torch and realrl once"
        ])
    return value == "1" and sys.platform.startswith("linux")
