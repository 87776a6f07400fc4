"""Asynchronous rollouts (`rollout.mode=async`): generation streams while training runs.

Two loops share the master's event loop and the per-rank locks of `realrl.workers.master`:

- the *producer* (`AsyncRollout.produce`) draws the data batches in order, splits each into
  requests of `rollout.groups_per_request` groups, and starts one request (every rollout MFC:
  generation, rewards, reference and critic inference) as soon as the staleness bound admits
  it (`realrl.workers.staleness.StalenessBound`) and fewer than `MAX_RUNNING_REQUESTS` run;
  a finished request's groups wait in the buffer;
- the *trainer* (`async_steps`) takes its batch from the buffer once there
  (`realrl.workers.rollout_buffer`: batch `k` of the data once all its groups are finished, so
  the batches are the synchronous run's, or with `rollout.assembly=finished_first` the first
  groups to finish within the staleness bound), trains on it, and hands the new weights
  to the generation layouts (`Master.refresh`, the parameter reallocation of a pipelined
  run). Generation runs in chunks of `rollout.decode_steps_per_chunk` decode steps
  (`realrl.workers.chunked_generation`), and the weights reach a generation in flight between
  two chunks (interruptible generation); every token records the version that chose it
  (`packed_weight_versions`), every group its oldest token's (`weight_version` metadata).
  With `decode_steps_per_chunk=0` they reach generation between two requests only.

A rollout filter (best-of-n, DAPO's dynamic sampling) runs on each request as it finishes:
the groups it drops free their place under the bound, and the producer draws more prompts
(`rollout.assembly=finished_first`); `async/discarded_groups` and `async/discarded_tokens`
count what it threw away.

Checkpoints. Before a save the producer stops starting requests and the running ones finish
(`pause`); the checkpoint records the data position of the first batch not trained yet, so a
resumed run generates the buffered and running groups again from the checkpoint's weights:
no prompt is lost or trained twice, and the resumed run's samples differ from an uninterrupted
run's (they come from newer weights and another random state). With `finished_first` the
trained groups are no prefix of the data: the checkpoint records the position past every batch
drawn and, by query id, the prompts drawn and not trained (`pending_query_ids`: the finished
groups in the buffer, in start order, then those of the drawn batch not started yet), which a
resumed run generates first (`realrl.workers.data_source`), so again no prompt is lost or
trained twice. The groups the rollout filter dropped are not among them: they were thrown away
as in an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from realrl.api.config import BatchAssembly
from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCKind
from realrl.workers.chunked_generation import ChunkSettings
from realrl.workers.data_source import DataSource
from realrl.workers.master import Master, RolloutError, StepResult
from realrl.workers.preemption import PreemptionRequest
from realrl.workers.rollout_buffer import BufferedRequest, RolloutBuffer
from realrl.workers.staleness import (
    TRAINER_VERSION_KEY,
    WEIGHT_VERSION_KEY,
    FinishedRequest,
    StalenessBound,
    group_versions,
    merge_requests,
    split_into_requests,
    staleness_stats,
    token_staleness_stats,
)

logger = logging.getLogger(__name__)

# Requests started and not finished at once: one generating, the next queued behind it on the
# generation workers, so that they never wait for the master between two requests. More would
# only queue on the same workers, and would take the weights of their admission time. The
# older one's calls (its reward after its generation) go first (`realrl.workers.rank_lock`).
MAX_RUNNING_REQUESTS = 2


class AsyncRollout:
    def __init__(self, master: Master, data: DataSource, steps: range):
        settings = master.plan.base.rollout
        self.master, self.data, self.steps = master, data, steps
        self.batch_size = master.plan.dataset.batch_size
        self.rollout_mfcs = master.plan.rollout_mfcs()
        data_parallel = max(master.plan.allocations[name].strategy.data
                            for name in self.rollout_mfcs)
        self.groups_per_request = settings.request_groups(self.batch_size)
        self.smallest_request = data_parallel  # every request is split over these ranks
        self.bound = StalenessBound(settings.max_head_offpolicyness, self.batch_size)
        # Versions count train steps from the run's start (the master's count from this
        # process's, which a resumed run starts at its checkpoint's step).
        master.generation_chunks = ChunkSettings(settings.decode_steps_per_chunk,
                                                 settings.interrupt_kv_cache.value, steps.start)
        self.version = 0  # train steps done in this process
        generation_ranks = {rank for mfc in master.plan.mfcs if mfc.kind == MFCKind.generate
                            for rank in master.plan.allocations[mfc.name].mesh.ranks}
        # The rollout MFCs that occupy the generation workers: their time is the busy time.
        self.generator_mfcs = {name for name in self.rollout_mfcs
                               if generation_ranks & set(master.plan.allocations[name].mesh.ranks)}
        self.assembly = settings.assembly
        self.buffer = RolloutBuffer(settings.assembly, self.batch_size,
                                    self.batch_size // self.groups_per_request,
                                    settings.max_head_offpolicyness)
        self.changed = asyncio.Condition()
        self.positions: dict[int, dict] = {}  # data position before each drawn batch
        self.not_started: SequenceSample | None = None  # the drawn batch's groups still waiting
        self.running: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self.paused = False
        self.next_to_train = 0
        self.busy_s = self.bound_wait_s = 0.0  # since the last `interval_stats`
        self.bound_waiting_since: float | None = None  # a bound wait going on, from then
        self.discarded_groups = self.discarded_tokens = 0.0  # by the rollout filter, since then
        self.dropped_since_batch = 0  # groups the filter dropped since the last batch was taken
        self.last_mark = time.perf_counter()

    # ------------------------------------------------------------------ producer

    async def produce(self) -> None:
        """Start every request of the run's batches, each when admitted. With finished-first
        assembly: batches for as long as the run goes, and requests as large as the bound
        allows, at least `smallest_request` groups (the groups the filter drops leave room
        for fewer than `groups_per_request`)."""
        finished_first = self.assembly == BatchAssembly.finished_first
        batches = itertools.count() if finished_first else range(len(self.steps))
        smallest = self.smallest_request if finished_first else self.groups_per_request
        try:
            for index in batches:
                prompts: SequenceSample | None = None
                while prompts is None or prompts.bs:
                    await self._wait_for_admission(smallest)
                    if prompts is None:  # no await since the admission: the pause holds
                        if not finished_first:  # its checkpoints record another position
                            self.positions[index] = self.data.state_dict()
                        prompts = self.data.next_batch()
                    size = min(self.groups_per_request, prompts.bs,
                               self.bound.capacity(self.version))
                    chunk, prompts = split_into_requests(prompts, size)[0], _after(prompts, size)
                    self.not_started = prompts
                    self.bound.started += chunk.bs
                    buffered = self.buffer.start(index, self.version)
                    task = asyncio.create_task(self._run_request(buffered, chunk))
                    self.running.add(task)
                    task.add_done_callback(self.running.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a data error: the trainer raises it
            await self._fail(error)

    async def _wait_for_admission(self, groups: int) -> None:
        """Wait until not paused, a request slot is free and the bound admits `groups`; the
        time the bound alone held it back counts as `bound_wait_s`."""
        async with self.changed:
            while True:
                held = self.paused or len(self.running) >= MAX_RUNNING_REQUESTS
                if not held and self.bound.admits(groups, self.version):
                    return
                if not held:
                    self.bound_waiting_since = time.perf_counter()
                await self.changed.wait()
                if self.bound_waiting_since is not None:  # set above only when not held
                    self.bound_wait_s += time.perf_counter() - self.bound_waiting_since
                self.bound_waiting_since = None

    async def _run_request(self, buffered: BufferedRequest, chunk) -> None:
        try:
            result = await self.master.run_rollout(
                chunk, step=self.steps.start + buffered.batch_index + 1, keep_partial=True)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            await self._fail(error, finished=asyncio.current_task())
            return
        started_on = self.steps.start + min(result.generated_by.values(), default=self.version)
        if result.data is not None:
            result.data.metadata[WEIGHT_VERSION_KEY] = group_versions(result.data, started_on)
        busy_s = sum(seconds for name, seconds in result.timing.items()
                     if name in self.generator_mfcs or name.split("/")[-1] in self.generator_mfcs)
        async with self.changed:
            buffered.finished = FinishedRequest(result, busy_s)
            self.busy_s += busy_s
            # Groups the rollout filter dropped leave room under the bound for new prompts.
            self.bound.started -= chunk.bs - buffered.size
            self.dropped_since_batch += chunk.bs - buffered.size
            self._check_dropped()
            self.discarded_groups += result.stats.pop("rollout/discarded_groups", 0.0)
            self.discarded_tokens += result.stats.pop("rollout/discarded_tokens", 0.0)
            # Before the notification: a producer woken by it must see the free slot (the done
            # callback would only run after the producer checked, and nothing might wake it).
            self.running.discard(asyncio.current_task())
            self.changed.notify_all()

    def _check_dropped(self) -> None:
        """Dynamic sampling that keeps dropping every group would generate for ever: stop, as a
        synchronous step does after `ppo.max_generation_rounds` rounds of a batch each."""
        rollout_filter = self.master.plan.rollout_filter
        if rollout_filter is None or not rollout_filter.drop_equal_reward_groups:
            return
        limit = rollout_filter.max_rounds * self.batch_size
        if self.dropped_since_batch >= limit and self.failure is None:
            step = self.steps.start + self.next_to_train + 1
            self.failure = RolloutError(
                f"dynamic sampling dropped {self.dropped_since_batch} prompts whose responses "
                f"all got the same reward while waiting for step {step}'s batch "
                f"({rollout_filter.max_rounds} generation "
                f"round(s) of {self.batch_size} prompts): the data is too easy or too hard for "
                "this model. Raise ppo.max_generation_rounds or group_size, or change the data."
            )
            self.changed.notify_all()

    async def _fail(self, error: BaseException, finished: asyncio.Task | None = None) -> None:
        async with self.changed:
            self.failure = self.failure or error
            self.running.discard(finished)
            self.changed.notify_all()

    # ------------------------------------------------------------------ trainer side

    async def next_batch(self) -> StepResult:
        """The next batch to train, once its groups are finished (`rollout.assembly`), with its
        staleness and the buffer's depth in `stats`."""
        index = self.next_to_train

        def ready() -> bool:
            return self.failure is not None or self.buffer.ready(index, self.version)

        async with self.changed:
            await self.changed.wait_for(ready)
            if self.failure is not None:
                raise self.failure
            requests = self.buffer.take(index, self.version)
            self.dropped_since_batch = 0
            self.positions.pop(index, None)
            self.next_to_train += 1
            buffered = self.buffer.buffered_groups()
            self.changed.notify_all()
        result = merge_requests(requests, self.steps.start + index + 1)
        trainer_version = self.steps.start + self.version
        result.data.metadata[TRAINER_VERSION_KEY] = [trainer_version] * result.data.bs
        result.stats |= staleness_stats(requests, trainer_version,
                                        self.bound.max_head_offpolicyness)
        result.stats |= token_staleness_stats(result.data, trainer_version)
        result.stats["async/buffer_groups"] = float(buffered)
        result.stats["async/running_requests"] = float(len(self.running))
        return result

    async def publish_weights(self, result: StepResult) -> None:
        """After a train step: start sending the new weights to the rollout layouts (they take
        them between two chunks), then admit the requests the new version allows.

        `refresh` returns once the transfer is queued on the rollout ranks' locks, so a request
        admitted now runs after it, on the new weights, and its tokens' versions (from
        `Master.layout_version`, set when the rollout ranks take them) say so. The trainer
        waits neither for the transfer nor, between disjoint CPU layouts, for the chunk in
        flight on the rollout ranks: the sender's part ends once its weights are in its
        shared-memory buffer (a split refresh), a failed transfer is raised by the next
        request on the failed rank, and checkpoints drain first (`broadcast`)."""
        started = time.perf_counter()
        await self.master.refresh(self.rollout_mfcs, result)
        result.stats["async/weight_update_wait_s"] = time.perf_counter() - started
        async with self.changed:
            self.version += 1
            self.changed.notify_all()

    def interval_stats(self, result: StepResult, train_mfcs: list[str]) -> dict[str, float]:
        """Busy fractions over the time since the last call (one step): the generation workers'
        (seconds of their rollout MFC calls, counted when a request finishes: 0 in a step
        during which none did), the trainer's (its train calls), and the time the staleness
        bound held the next request back (a wait still going on counts up to now)."""
        now = time.perf_counter()
        interval = max(now - self.last_mark, 1e-9)
        if self.bound_waiting_since is not None:  # a wait going on: its part in this interval
            self.bound_wait_s += now - self.bound_waiting_since
            self.bound_waiting_since = now
        train_s = sum(result.timing.get(name, 0.0) for name in train_mfcs)
        stats = {
            "async/generator_busy_fraction": min(1.0, self.busy_s / interval),
            "async/trainer_busy_fraction": min(1.0, train_s / interval),
            "async/bound_wait_fraction": min(1.0, self.bound_wait_s / interval),
            "async/discarded_groups": self.discarded_groups,
            "async/discarded_tokens": self.discarded_tokens,
        }
        self.busy_s = self.bound_wait_s = 0.0
        self.discarded_groups = self.discarded_tokens = 0.0
        self.last_mark = now
        return stats

    async def pause(self) -> None:
        """Stop starting requests and wait for the running ones (before a checkpoint)."""
        async with self.changed:
            self.paused = True
        if self.running:
            await asyncio.wait(set(self.running))
        if self.failure is not None:
            raise self.failure

    async def resume(self) -> None:
        async with self.changed:
            self.paused = False
            self.changed.notify_all()

    @contextlib.contextmanager
    def untrained_position(self):
        """Within it, the data source reports the position of the first batch not trained yet
        (what a checkpoint records); the batches drawn ahead are served as before after it.
        With finished-first assembly: the position past every batch drawn, and the prompts
        drawn and not trained owed before it. Only while paused: no request runs."""
        ahead = self.data.state_dict()
        if self.assembly == BatchAssembly.finished_first:
            waiting = [] if self.not_started is None else list(self.not_started.ids)
            self.data.owe(self.buffer.untrained_ids() + waiting)
        else:
            self.data.load_state_dict(self.positions.get(self.next_to_train, ahead))
        try:
            yield
        finally:
            self.data.load_state_dict(ahead)

    async def stop(self) -> int:
        """Cancel the producer's requests still running; returns the groups dropped (started
        and not trained: in flight or in the buffer)."""
        dropped = self.bound.started - self.next_to_train * self.batch_size
        for task in list(self.running):
            task.cancel()
        for task in list(self.running):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return dropped


def _after(prompts: SequenceSample, count: int) -> SequenceSample:
    """The groups of `prompts` after its first `count`."""
    return prompts.reorder(list(range(count, prompts.bs)))


async def async_steps(master: Master, data: DataSource, steps: range,
                      end_of_step: Callable[..., Awaitable[None]],
                      preemption: PreemptionRequest,
                      saves_after: Callable[[int], bool]) -> int:
    """`rollout.mode=async`: train on each batch as soon as its groups are finished while the
    producer keeps generating; returns the steps done, as `master_main._synchronous_steps`.
    `saves_after(steps_done)` says whether `end_of_step` writes a checkpoint."""
    rollout = AsyncRollout(master, data, steps)
    producer = asyncio.create_task(rollout.produce())
    train_mfcs = master.plan.train_mfcs()
    try:
        for step in steps:
            if preemption.requested and step == steps.start:
                return step  # asked during start-up: nothing new to checkpoint
            started = time.perf_counter()
            result = await rollout.next_batch()
            batch_wait_s = time.perf_counter() - started
            await master.run_training(result)
            await rollout.publish_weights(result)
            result.stats |= rollout.interval_stats(result, train_mfcs)
            stop = preemption.requested
            if stop or saves_after(step + 1):
                await rollout.pause()
                with rollout.untrained_position():
                    await end_of_step(step, result, time.perf_counter() - started, batch_wait_s,
                                      stop=stop)
                await rollout.resume()
            else:
                await end_of_step(step, result, time.perf_counter() - started, batch_wait_s)
            if stop:
                return step + 1
        return steps.stop
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
        dropped = await rollout.stop()
        if dropped:
            logger.info("rollout.mode=async: %d generated or running groups were not trained "
                        "(the run stopped before their steps)", dropped)
