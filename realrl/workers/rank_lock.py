"""The master's per-rank locks, granted to the oldest work first.

Every request to a worker runs under the locks of the ranks it occupies
(`realrl.workers.master.Master.locked`). With `asyncio.Lock` the waiters got a rank in the order
they asked for it. In an asynchronous run that order is wrong: two rollout requests run at once
(`realrl.workers.async_rollout.MAX_RUNNING_REQUESTS`), and the second one's generation, queued
while the first one generated, took the generation rank before the first one's reward call. The
trainer waits for the first one, so it waited for a whole generation it did not need: with
`max_head_offpolicyness=1` on the 0.8M reward-time model a fifth of the steps took 0.13-0.25 s
instead of 0.08 (a 40-120 ms wait for the batch; `benchmarks/reward_time.md`).

So a waiter here carries a priority, and the lock goes to the lowest `(priority, arrival)`:
the master passes a request's step, so the work of an older batch goes first, and a weight
refresh passes `REFRESH`, ahead of all of them, so that the requests admitted after it run on
its weights and a generation in flight takes them at its next chunk. Waiters of one priority
keep their arrival order (a synchronous step's calls side by side). A free lock with nobody
waiting is taken at once; a lock with waiters is handed from its holder to the next waiter
directly, so no later arrival can take it in between.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

# The priority of a weight refresh: before the calls of every step.
REFRESH = -1


class PriorityLock:
    """An asyncio lock that grants the waiter of lowest `(priority, arrival)` first."""

    def __init__(self) -> None:
        self._held = False
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    def locked(self) -> bool:
        return self._held

    async def acquire(self, priority: int = 0) -> bool:
        if not self._held:  # then nobody waits: `release` frees it only with the heap empty
            self._held = True
            return True
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), granted))
        try:
            await granted
        except asyncio.CancelledError:
            # Handed over just before the cancellation arrived: pass it on to the next waiter.
            # Otherwise the cancelled future stays in the heap and `release` skips it.
            if granted.done() and not granted.cancelled():
                self.release()
            raise
        return True

    def release(self) -> None:
        """Hand the lock to the next waiter, or free it."""
        if not self._held:
            raise RuntimeError("release of a PriorityLock that is not held")
        while self._waiters:
            _, _, granted = heapq.heappop(self._waiters)
            if not granted.done():
                granted.set_result(None)  # the lock stays held: it is the waiter's now
                return
        self._held = False
