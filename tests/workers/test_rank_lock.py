"""The master's per-rank locks go to the oldest step's work first (`realrl.workers.rank_lock`)."""

from __future__ import annotations

import asyncio

import pytest

from realrl.workers.rank_lock import REFRESH, PriorityLock


async def _holder(lock: PriorityLock, priority: int, name: str, order: list[str]) -> None:
    await lock.acquire(priority)
    order.append(name)
    await asyncio.sleep(0)
    lock.release()


def test_waiters_get_the_lock_by_priority_then_by_arrival():
    async def scenario():
        lock, order = PriorityLock(), []
        await lock.acquire(5)  # the first request's generation runs
        # Queued while it runs, in this order: the second request's generation (step 6), the
        # first one's reward (step 5), a refresh, and a call side by side with the reward.
        tasks = []
        for priority, name in ((6, "gen 6"), (5, "reward 5"), (REFRESH, "refresh"),
                               (5, "critic 5")):
            tasks.append(asyncio.create_task(_holder(lock, priority, name, order)))
            await asyncio.sleep(0)
        assert order == [] and lock.locked()
        lock.release()
        await asyncio.gather(*tasks)
        assert order == ["refresh", "reward 5", "critic 5", "gen 6"]
        assert not lock.locked()

    asyncio.run(scenario())


def test_a_free_lock_is_taken_at_once_and_no_late_arrival_jumps_a_handover():
    async def scenario():
        lock, order = PriorityLock(), []
        await lock.acquire(3)
        waiter = asyncio.create_task(_holder(lock, 7, "waiter", order))
        await asyncio.sleep(0)
        lock.release()  # handed to the waiter, not freed
        assert lock.locked()
        late = asyncio.create_task(_holder(lock, 0, "late", order))  # better, but too late
        await asyncio.gather(waiter, late)
        assert order == ["waiter", "late"]

    asyncio.run(scenario())


def test_a_cancelled_waiter_is_skipped_and_one_cancelled_after_the_handover_passes_it_on():
    async def scenario():
        lock, order = PriorityLock(), []
        await lock.acquire(0)
        cancelled = asyncio.create_task(_holder(lock, 1, "cancelled", order))
        handed = asyncio.create_task(_holder(lock, 2, "handed", order))
        last = asyncio.create_task(_holder(lock, 3, "last", order))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        lock.release()  # skips the cancelled waiter: "handed" holds it now ...
        handed.cancel()  # ... and is cancelled before it runs: it passes the lock on
        for task in (cancelled, handed):
            with pytest.raises(asyncio.CancelledError):
                await task
        await last
        assert order == ["last"] and not lock.locked()
        with pytest.raises(RuntimeError, match="not held"):
            lock.release()

    asyncio.run(scenario())
