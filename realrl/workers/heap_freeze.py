"""Keep Python's full garbage collections short in long-lived workers.

A full collection walks every container object the process tracks. A model worker that has
compiled its model holds ~460k of them (torch, transformers, and dynamo's and inductor's
graphs and guards). In a compiled GRPO run a full pass over them took 340-470 ms, about every
20 s of training, at an arbitrary point of a step (0.85 s instead of 0.38 s); data-parallel
ranks collect at different moments and wait for each other in their collectives.

`HeapFreezer` moves the objects alive after warm-up into the collector's permanent generation
(`gc.freeze`), between requests, where no call is waiting on the process. Later full passes
then only walk what is newer. It freezes:

- after a warm-up call (a call's first run, which compiles), collecting first so that the
  compiler's garbage is freed, not kept;
- in a model worker (`refreeze=True`), after any full pass that took more than
  ``slow_pass_s`` of the collecting thread's CPU time (a later recompile, or a heap that kept
  growing), without collecting again: that pass has just sorted live objects from garbage.

The cost: a frozen object that later becomes part of an unreachable reference cycle is never
freed. Each freeze pins whatever is alive at that moment, so a freeze must come rarely, and not
while a rolling cache of cyclic objects is alive. The master has no compiler, so it freezes only
once, after its first step (`HeapFreezer.for_master`): its later heap is small (3-5k objects
between steps), and what lives in it are rolling caches. wandb keeps the last 100 tables it
logged (one per `log.samples_every_steps`, each with its artifact, manifest and a temporary
directory, in reference cycles) and lets older ones die. When the master also froze after slow
passes, under load (a pass stretched by other processes past 20 ms of wall time) each
re-freeze pinned the 100 tables then alive, which died frozen a few hundred steps later: in the
default `ppo-math` run its resident memory grew 1.5 MiB per 1000 steps, steadily, and 15 MiB per
1000 steps with a table every step (`benchmarks/soak.py`, benchmarks/README.md "Soak"). The
slow-pass test of the workers counts CPU time, not wall time, for the same reason: a busy
machine does not make a heap larger.

A freeze also stops CPython from starting full collections itself. It runs one only when the
objects moved to the oldest generation since the last full pass reach a quarter of the objects
that pass left alive, and that count is not told about the freeze: after the warm-up freeze of
the master (~270k objects) a full pass was due only after ~68k more had grown old, which no
run reached, and cyclic garbage that had lived long enough to grow old (wandb's evicted tables)
was never freed. So once frozen, `between_requests` runs the full pass itself whenever
CPython's own count says one is due (more younger-generation passes since the last full one
than `gc.get_threshold()[2]`). It walks only the unfrozen objects, and it runs between
requests, where nothing waits.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class HeapFreezer:
    def __init__(self, slow_pass_s: float = 0.02, refreeze: bool = True):
        """`refreeze`: freeze again after a full pass slower than `slow_pass_s` CPU seconds."""
        self.slow_pass_s = slow_pass_s
        self.refreeze = refreeze
        self.freezes = 0
        self.full_passes = 0  # run here because one was due (see the module docstring)
        self._pass_started: float | None = None
        self._freeze_due = False
        gc.callbacks.append(self._on_collection)

    @classmethod
    def for_master(cls) -> HeapFreezer:
        """The master's: one freeze after the first step, none after slow passes (module doc)."""
        return cls(refreeze=False)

    def _on_collection(self, phase: str, info: dict) -> None:
        if info["generation"] != 2 or not self.refreeze:
            return
        # The collecting thread's CPU time: a pass waiting for a busy CPU is not a large heap.
        if phase == "start":
            self._pass_started = time.thread_time()
        elif self._pass_started is not None:
            if time.thread_time() - self._pass_started > self.slow_pass_s:
                self._freeze_due = True
            self._pass_started = None

    def between_requests(self, warmed_up: bool = False) -> None:
        """Call where nothing waits on this process; `warmed_up`: a call just ran first."""
        if self.freezes and gc.get_count()[2] > gc.get_threshold()[2]:
            gc.collect()  # the full pass the freeze keeps CPython from starting (module doc)
            self.full_passes += 1
        if not (warmed_up or self._freeze_due):
            return
        started = time.perf_counter()
        if warmed_up:
            gc.collect()
        gc.freeze()
        self._freeze_due = False
        self.freezes += 1
        logger.debug("froze the heap (%d objects frozen) in %.3f s",
                     gc.get_freeze_count(), time.perf_counter() - started)

    def close(self) -> None:
        """Stop watching collections (frozen objects stay frozen)."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
