"""Idle model workers lend their CPU threads to busy ones on the same machine.

Why: the launcher splits a machine's cores evenly between its model workers, but a dataflow
graph rarely keeps them all busy. In a pipelined step (`pipeline_rollout=true`) the generating
worker finishes its rollout well before the training worker finishes its step, and in a
synchronous one an MFC on one worker's mesh leaves the others waiting. With an even split
those cores sit idle; here a worker that is running a request takes the threads of every
worker on the machine that has been idle for a while (`LEND_AFTER_S`, below), and gives them
back as soon as one of them starts.

How: the workers of one machine share a small memory-mapped file with one 8-byte slot per
worker: `BUSY` while it serves a request, else the time (`time.monotonic_ns`, one clock for
every process of the machine) it went idle, 0 before its first request. A busy worker re-reads
the file between transformer layers (forward and backward; `Transformer.between_layers`) and
calls `torch.set_num_threads` when its share changed, so a lent core is taken back within one
layer. Reading the slots costs about a microsecond; the thread count only changes when a peer
starts or stops.

A peer lends its threads only once it has been idle for `LEND_AFTER_S`. A worker that stops
and starts again within a few milliseconds (a streaming generator between two chunks, a
rollout worker between its generation and its reward call) is not idle in any useful sense:
a borrower that took its core would run two threads against the peer's one on two cores until
its next layer, and every OpenMP region in that layer waits for whichever thread the kernel
preempted. On the 0.8M reward-time model that made async and pipelined steps 12-17% slower
than with no lending at all (`benchmarks/reward_time.md`); a peer idle for longer (the
generator waiting for the staleness bound, a pipelined rollout done well before training) is
still lent to.

Compiled code (`gen.compile`, `<role>.compile`) is guarded on the thread count: dynamo
compiles a function once more for every thread count it is called with, and past
`torch._dynamo.config.recompile_limit` variants (8) it would run that function eagerly from
then on. A worker here can run at `slots` different counts, so it raises that limit to
`8 * slots` (16 with two workers). Each further count compiles once (~0.3-0.7 s with
inductor's cache warm, forward and backward). Compiled transformer blocks do that for every
count at their first call in each mode (`attach`, `CompiledBlocks.thread_counts`); otherwise
it would happen at whichever step a core is first lent, which in compiled PPO runs (the
actor's and the critic's calls side by side) made a few steps 0.3-0.4 s slower well after
warm-up.

A worker never takes the threads of the other workers of its own call (a data-parallel mesh):
they are starting the same request, so a core borrowed from one of them would come back within
a layer or two. Worse, that rare moment would make every compiled function compile for one
more thread count at an arbitrary step, long after warm-up: 0.5 s on a 0.4 s compiled GRPO
step, measured at steps 6-21 of runs where nothing else recompiled.

Decode steps keep their own rule (small ones run on one thread; `realrl.models.generation`),
and CUDA workers do not use this at all. The local launcher creates the file in shared memory
(`/dev/shm` where there is one) for each launch (`realrl.launcher.local`); the master removes it
as soon as every worker has mapped it, and the launcher at the latest when the run ends.
Under SLURM each task has its own CPUs, so nothing is lent there.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from realrl.api import environment

if TYPE_CHECKING:
    from realrl.models.transformer import Transformer


@dataclass(frozen=True)
class CoreShareSpec:
    """Where the shared file is, which slot is this worker's, and its threads."""

    path: Path
    slot: int  # the worker's rank: a local launch has one slot per worker
    slots: int
    threads: int  # this worker's own share; a peer's share is the same

    def to_env(self) -> str:
        return f"{self.path}:{self.slot}:{self.slots}:{self.threads}"

    @classmethod
    def from_env(cls, value: str) -> CoreShareSpec:
        path, slot, slots, threads = value.rsplit(":", 3)
        return cls(Path(path), int(slot), int(slots), int(threads))


# A slot's value while its worker serves a request; any other value is the time it went idle.
BUSY = -1
SLOT_BYTES = 8
# How long a peer must have been idle before its threads are taken (module docstring).
LEND_AFTER_S = 0.02


def create_share_file(slots: int) -> Path:
    """A new file of `slots` zeroed slots (all idle since the launch) in node-local shared
    memory."""
    shm = Path("/dev/shm")
    directory = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="realrl-cores-", dir=directory)
    try:
        os.ftruncate(fd, slots * SLOT_BYTES)
    finally:
        os.close(fd)
    return Path(path)


def unlink_mapped_share_file() -> None:
    """The master's part: remove the launcher's file once every worker is ready (and so has
    mapped it). The mappings stay valid, and a launcher killed later leaves nothing behind."""
    path = os.environ.get(environment.CORE_SHARE_FILE)
    if path:
        Path(path).unlink(missing_ok=True)


# Dynamo's default recompile limit, kept for each thread count a worker can run at.
RECOMPILE_LIMIT_PER_COUNT = 8


class CoreShare:
    """This worker's view of the machine's shared busy flags."""

    def __init__(self, spec: CoreShareSpec, lend_after_s: float = LEND_AFTER_S):
        import torch  # here, not at the top: the launcher imports `CoreShareSpec`

        self._torch = torch
        self.spec = spec
        self._lend_after_ns = int(lend_after_s * 1e9)
        self._layout = struct.Struct(f"<{spec.slots}q")
        fd = os.open(spec.path, os.O_RDWR)
        try:
            self._flags = mmap.mmap(fd, self._layout.size)
        finally:
            os.close(fd)
        self._busy = False
        self._partners: frozenset[int] = frozenset()
        self._room_for_recompiles = False
        self._make_room_for_recompiles()

    def _make_room_for_recompiles(self) -> None:
        """Raise dynamo's recompile limit (see the module docstring) once torch._dynamo is
        imported, before the thread count changes: nothing was compiled before that import,
        and importing it only for this would cost 1.5 s of CPU in every worker."""
        dynamo = sys.modules.get("torch._dynamo")
        if self._room_for_recompiles or dynamo is None:
            return
        limit = dynamo.config.recompile_limit
        dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT_PER_COUNT * self.spec.slots)
        self._room_for_recompiles = True

    def _set_threads(self, threads: int) -> None:
        self._make_room_for_recompiles()
        self._torch.set_num_threads(threads)

    @classmethod
    def from_environment(cls) -> CoreShare | None:
        import torch

        value = os.environ.get(environment.CORE_SHARE)
        if not value or torch.cuda.is_available():
            return None
        return cls(CoreShareSpec.from_env(value))

    def thread_counts(self) -> tuple[int, ...]:
        """Every thread count this worker may run at: its own share plus 0 to all peers'."""
        return tuple(self.spec.threads * k for k in range(1, self.spec.slots + 1))

    def attach(self, module: Transformer) -> None:
        """Re-balance threads between `module`'s layers, and have its compiled blocks (if any)
        compile for every thread count at their first call rather than mid-run."""
        module.between_layers = self.rebalance
        self._make_room_for_recompiles()
        if module.compiled_blocks is not None:
            module.compiled_blocks.thread_counts = self.thread_counts()

    def threads_now(self) -> int:
        """Own share plus the shares of the peers that have been idle for `lend_after_s` (while
        this one is busy) and do not serve the same call."""
        lent_before = time.monotonic_ns() - self._lend_after_ns
        lenders = sum(
            1
            for slot, state in enumerate(self._layout.unpack_from(self._flags))
            if state != BUSY and state <= lent_before and slot not in self._partners
            and slot != self.spec.slot
        )
        return self.spec.threads * (1 + lenders)

    def _mark(self, state: int) -> None:
        struct.pack_into("<q", self._flags, self.spec.slot * SLOT_BYTES, state)

    def rebalance(self) -> None:
        """Take the threads lent now (or give back what a peer took back)."""
        if not self._busy:
            return
        threads = self.threads_now()
        if threads != self._torch.get_num_threads():
            self._set_threads(threads)

    @contextlib.contextmanager
    def busy(self, partners: Collection[int] = ()) -> Iterator[None]:
        """Mark this worker busy while serving one request; back to its own share after.

        `partners`: the slots (worker ranks) serving the same call, whose threads are not taken.
        """
        self._mark(BUSY)
        self._busy = True
        self._partners = frozenset(partners) - {self.spec.slot}
        try:
            self.rebalance()
            yield
        finally:
            self._busy = False
            self._partners = frozenset()
            self._mark(time.monotonic_ns())
            self._set_threads(self.spec.threads)

    def close(self) -> None:
        self._mark(0)
        self._flags.close()
