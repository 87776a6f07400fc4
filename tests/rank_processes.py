"""Start a test's ranks from a fork server that has already imported the heavy modules.

Spawned ranks each import torch, transformers, megatron-core and realrl's worker modules
before running a line of the test: about 4-6 s of CPU per rank on this project's 2-core
machines, paid again by every rank of every multi-rank test (about a minute of the suite's
wall time). A fork server imports them once per pytest session and forks each rank from
itself, so a rank starts with them loaded. The server runs no torch operation before it forks,
so its children start with no OpenMP pool (the hazard of forking a process that computed).

A forked rank inherits the server's environment, not the test's current one, so `start_ranks`
hands each rank the caller's `os.environ` and thread count before calling the rank function.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core.tensor_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "realrl.workers.model_worker",
    "realrl.workers.realloc",
    "realrl.backends.torch_engine",
]


def rank_context():
    """The fork-server context, its preload list set (no effect once the server runs)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return mp.get_context("forkserver")


def environment_for_ranks() -> dict[str, str]:
    """The caller's environment, one thread per rank unless it says otherwise."""
    environment = dict(os.environ)
    if not environment.get("OMP_NUM_THREADS", "").isdigit():  # unset, empty or malformed
        environment["OMP_NUM_THREADS"] = "1"
    return environment


def run_rank(rank: int, function: Callable, environment: dict[str, str], *args) -> None:
    """In a forked rank: take the caller's environment and thread count, then run."""
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    function(rank, *args)


def start_ranks(function: Callable, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(function, args, nprocs)`, with ranks forked from the
    preloaded server; raises as spawn does when a rank fails."""
    rank_context()
    mp.start_processes(run_rank, args=(function, environment_for_ranks(), *args),
                       nprocs=nprocs, join=True, start_method="forkserver")
