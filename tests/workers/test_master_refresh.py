"""The pipelined refresh (`Master.refresh`): locks, posted transfers and their failures.

Fake clients stand in for the model workers: the master only awaits their replies, so the
scheduling rules can be checked without processes.
"""

from __future__ import annotations

import asyncio

import pytest
from test_realloc import make_plan

from realrl.workers.master import Master, StepResult
from realrl.workers.wire import Message

LAYOUTS = {"train": [1], "gen": [0], "ref": [1]}


class FakeClient:
    """Replies to every request; a "transfer" waits for `release` and then fails if asked."""

    def __init__(self, rank: int, fail_transfer: bool) -> None:
        self.rank, self.fail_transfer = rank, fail_transfer
        self.release = asyncio.Event()
        self.kinds: list[str] = []

    async def request(self, message: Message, timeout_s: float) -> Message:
        self.kinds.append(message.kind)
        if message.kind == "transfer":
            await self.release.wait()
            if self.fail_transfer:
                raise RuntimeError(f"worker {self.rank} died during the transfer")
        return message.reply({})


def _master(tmp_path, fail_on: set[int]) -> tuple[Master, dict[int, FakeClient]]:
    plan = make_plan(tmp_path, LAYOUTS, eta=1.0, world=2)
    clients = {rank: FakeClient(rank, rank in fail_on) for rank in (0, 1)}
    master = Master(plan, clients)
    master.role_version["actor"] = 1  # as after a train step: actor_gen's layout is stale
    return master, clients


def test_a_refresh_holds_each_rank_until_it_replied_then_frees_it(tmp_path):
    async def scenario():
        master, clients = _master(tmp_path, fail_on=set())
        await master.refresh(["actor_gen"], StepResult(data=None))
        assert all(master.rank_locks[rank].locked() for rank in (0, 1))
        clients[1].release.set()  # the sender replies first: its lock is free at once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not master.rank_locks[1].locked() and master.rank_locks[0].locked()
        clients[0].release.set()
        await master.drain()
        assert not any(lock.locked() for lock in master.rank_locks.values())
        assert clients[0].kinds == clients[1].kinds == ["transfer"]
        await master.refresh(["actor_gen"], StepResult(data=None))  # up to date: nothing sent
        assert clients[0].kinds == ["transfer"]

    asyncio.run(scenario())


async def _refreshed_with_failure(tmp_path, failing_rank: int) -> Master:
    """A master whose posted refresh has been answered, by `failing_rank` with an error."""
    master, clients = _master(tmp_path, fail_on={failing_rank})
    await master.refresh(["actor_gen"], StepResult(data=None))
    for client in clients.values():
        client.release.set()
    return master


def test_a_failed_background_transfer_stops_the_next_request_and_frees_every_lock(tmp_path):
    async def scenario():
        master = await _refreshed_with_failure(tmp_path, failing_rank=0)
        # The next request for rank 0 waits for its lock, then sees the transfer's error.
        with pytest.raises(RuntimeError, match="worker 0 died during the transfer"):
            async with master.locked([0]):
                pytest.fail("ran a request after a failed transfer")
        assert not any(lock.locked() for lock in master.rank_locks.values())
        await master.drain()  # the failure was reported once, not again at the end

    asyncio.run(scenario())


def test_drain_reports_a_failed_transfer(tmp_path):
    async def scenario():
        master = await _refreshed_with_failure(tmp_path, failing_rank=1)
        with pytest.raises(RuntimeError, match="worker 1 died during the transfer"):
            await master.drain()

    asyncio.run(scenario())
