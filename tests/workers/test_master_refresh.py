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
    """Replies to every request; a "transfer" waits for `release` and then fails if asked.
    With `sends_alone` set, a transfer's reply says so (as the sender's does)."""

    def __init__(self, rank: int, fail_transfer: bool, sends_alone: bool | None = None) -> None:
        self.rank, self.fail_transfer, self.sends_alone = rank, fail_transfer, sends_alone
        self.release = asyncio.Event()
        self.kinds: list[str] = []
        self.split: list[bool] = []  # each transfer's: sent to one side at a time

    async def request(self, message: Message, timeout_s: float) -> Message:
        self.kinds.append(message.kind)
        if message.kind == "transfer":
            self.split.append(message.header["split"])
        if message.kind == "transfer":
            await self.release.wait()
            if self.fail_transfer:
                raise RuntimeError(f"worker {self.rank} died during the transfer")
            if self.sends_alone is not None:
                return message.reply({"sends_alone": self.sends_alone})
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
            async with master.locked([0], step=2):
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


async def _split_master(tmp_path, ema: bool = False) -> tuple[Master, dict[int, FakeClient]]:
    """Train on rank 1 (the sender, whose part needs no receiver), generate on rank 0; with
    `ema`, the train call's EMA hook into the reference is a second transfer from the actor.
    Returned after a first train step and its refresh, done together: it tells the master
    `sends_alone`, so later refreshes may be split."""
    plan = make_plan(tmp_path, LAYOUTS, eta=0.5, world=2)
    if not ema:
        train = next(mfc for mfc in plan.mfcs if mfc.name == "actor_train")
        train.post_hooks = []
    clients = {0: FakeClient(0, False), 1: FakeClient(1, False, sends_alone=True)}
    for client in clients.values():
        client.release.set()
    master = Master(plan, clients)
    await _train_and_refresh(master)
    await master.drain()
    return master, clients


async def _train_and_refresh(master: Master) -> None:
    master.role_version["actor"] += 1
    master.layout_version[master.plan.owner_layout("actor")] += 1
    await master.refresh(["actor_gen", "ref_inf"], StepResult(data=None))


def test_a_split_refresh_frees_the_sender_while_a_chunk_holds_the_receiver(tmp_path):
    async def scenario():
        master, clients = await _split_master(tmp_path)
        gen = master.plan.layout_of("actor_gen")
        assert master.layout_version[gen] == 1 and clients[0].kinds == ["transfer"]
        await master.rank_locks[0].acquire()  # a generation chunk runs on rank 0
        await _train_and_refresh(master)  # returns with rank 0 still busy
        await asyncio.sleep(0.01)
        assert not master.rank_locks[1].locked()  # the sender has done its part: free to train
        assert clients[1].kinds == ["transfer"] * 2 and clients[0].kinds == ["transfer"]
        # Until rank 0 takes the weights its calls get the old ones, and no other transfer.
        assert master.layout_version[gen] == 1
        assert not master.is_stale(next(m for m in master.plan.mfcs if m.name == "actor_gen"))
        master.rank_locks[0].release()  # the chunk is done: the receiver's part runs next
        await master.drain()
        assert clients[0].kinds == ["transfer"] * 2 and master.layout_version[gen] == 2
        assert clients[0].split == clients[1].split == [False, True]
        assert not any(lock.locked() for lock in master.rank_locks.values())

    asyncio.run(scenario())


def test_a_split_refresh_waits_for_the_earlier_receivers_before_the_sender_goes_again(tmp_path):
    async def scenario():
        master, clients = await _split_master(tmp_path)
        await master.rank_locks[0].acquire()  # rank 0 busy through two train steps
        await _train_and_refresh(master)
        second = asyncio.create_task(_train_and_refresh(master))
        await asyncio.sleep(0.01)
        # The sender would wait for rank 0's release of its buffer: it is not asked yet.
        assert not second.done() and clients[1].kinds == ["transfer"] * 2
        master.rank_locks[0].release()
        await second
        await master.drain()
        assert clients[1].kinds == clients[0].kinds == ["transfer"] * 3
        assert master.layout_version[master.plan.layout_of("actor_gen")] == 3

    asyncio.run(scenario())


def test_a_rank_serves_a_refresh_first_then_the_oldest_steps_calls(tmp_path):
    """Two async requests: the newer one's generation, queued first, waits for the older one's
    reward, and both for the weights the trainer just published (`realrl.workers.rank_lock`)."""
    async def scenario():
        master, clients = await _split_master(tmp_path)
        await master.rank_locks[0].acquire()  # step 5's generation runs on rank 0

        async def call(step: int, kind: str) -> None:
            async with master.locked([0], step):
                await master.request(0, Message(kind, {}))

        newer = asyncio.create_task(call(6, "generate step 6"))
        await asyncio.sleep(0)
        older = asyncio.create_task(call(5, "reward step 5"))
        await asyncio.sleep(0)
        await _train_and_refresh(master)  # its receiver queues last
        master.rank_locks[0].release()
        await asyncio.gather(newer, older)
        await master.drain()
        assert clients[0].kinds == ["transfer", "transfer", "reward step 5", "generate step 6"]
        assert not master.rank_locks[0].locked()

    asyncio.run(scenario())


def test_a_refresh_is_not_split_when_another_transfer_leaves_the_sender(tmp_path):
    async def scenario():
        master, clients = await _split_master(tmp_path, ema=True)  # the EMA hook: actor -> reference
        await master.rank_locks[0].acquire()
        refresh = asyncio.create_task(_train_and_refresh(master))
        await asyncio.sleep(0.01)
        assert not refresh.done() and clients[1].kinds == ["transfer"]  # waits for both sides
        master.rank_locks[0].release()
        await refresh
        await master.drain()
        assert clients[1].kinds == clients[0].kinds == ["transfer"] * 2
        assert clients[0].split == clients[1].split == [False, False]

    asyncio.run(scenario())


def test_the_receivers_of_a_split_refresh_read_only_after_the_sender_replied(tmp_path):
    async def scenario():
        master, clients = await _split_master(tmp_path)
        clients[1].release.clear()  # the sender is still writing its buffer
        await _train_and_refresh(master)
        await asyncio.sleep(0.01)
        assert clients[0].kinds == ["transfer"] and master.rank_locks[0].locked()
        clients[1].release.set()
        await master.drain()
        assert clients[0].kinds == ["transfer"] * 2

    asyncio.run(scenario())


def test_a_failed_sender_leaves_the_receivers_weights_and_stops_the_next_request(tmp_path):
    async def scenario():
        master, clients = await _split_master(tmp_path)
        gen = master.plan.layout_of("actor_gen")
        clients[1].fail_transfer = True
        await _train_and_refresh(master)
        with pytest.raises(RuntimeError, match="worker 1 died during the transfer"):
            await master.drain()
        assert clients[0].kinds == ["transfer"] and master.layout_version[gen] == 1
        assert not any(lock.locked() for lock in master.rank_locks.values())

    asyncio.run(scenario())
