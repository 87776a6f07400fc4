"""The master worker: runs the dataflow graph once per step over the model workers.

Every MFC starts as soon as the MFCs producing its inputs have finished, so independent calls
on disjoint meshes overlap. Calls that share a worker are serialised by per-rank locks taken in
rank order, which also makes every rank enter collectives in the same order. For each call the
master: brings the call's layout up to the role's newest weights (parameter reallocation),
splits the batch over the call's data-parallel ranks by tokens, sends one request to every rank
of the mesh, merges the output keys of the replies back into the step's batch, and runs the
post-hooks (the EMA reference update).

Every request is recorded, per rank, while it is in flight (`InFlightCalls`: which call, which
step, since when), for the hang watchdog (`realrl.workers.watchdog`).

With `pipeline_rollout=true` a step is split in two halves, the rollout (every MFC but the train
ones) and the training, and the master loop runs step i+1's rollout while step i trains
(`realrl.workers.master_main`), so rollouts are generated with weights one train step old.
With `rollout.mode=async` the rollout half runs on small requests, continuously, as far ahead
as the staleness bound allows (`realrl.workers.async_rollout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef, MFCKind, ParamReallocHook
from realrl.api.errors import UserFacingError
from realrl.workers.chunked_generation import ChunkSettings, run_in_chunks, runs_in_chunks
from realrl.workers.rank_lock import REFRESH, PriorityLock
from realrl.workers.realloc import split_transfer_ranks, transfer_ranks
from realrl.workers.rollout_filter import apply_rollout_filter, discarded_by_filter
from realrl.workers.run_plan import LayoutKey, RunPlan
from realrl.workers.transport import AsyncClient
from realrl.workers.watchdog import DeadlinePolicy, InFlightCalls, WatchdogClock
from realrl.workers.wire import Message

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 24 * 3600.0  # a last resort: the watchdog's deadlines come far sooner


class RolloutError(UserFacingError):
    """Dynamic sampling could not fill the batch with useful prompts."""


@dataclass
class StepResult:
    data: SequenceSample | None  # None: the rollout filter dropped every group of a request
    stats: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)  # seconds per MFC and transfer
    compute: dict[str, float] = field(default_factory=dict)  # worker-side seconds per MFC
    generated_by: dict[str, int] = field(default_factory=dict)  # role -> weights version
    step: int = 0  # 1-based step number, sent with each MFC request (workers' error messages)


class Master:
    def __init__(self, plan: RunPlan, clients: dict[int, AsyncClient],
                 calls: InFlightCalls | None = None):
        """`calls` is where requests are recorded: the watchdog's, when one guards the run."""
        self.plan = plan
        self.clients = clients
        if calls is None:
            calls = InFlightCalls(WatchdogClock(), DeadlinePolicy(plan.base.watchdog))
        self.calls = calls
        # Granted to the oldest step's work first, a weight refresh before any (`rank_lock`).
        self.rank_locks = {rank: PriorityLock() for rank in clients}
        self.role_version = {role: 0 for role in plan.models}
        self.layout_version = {layout: 0 for layout in plan.layouts()}
        self.producer_of = {key: mfc.name for mfc in plan.mfcs for key in mfc.output_keys}
        self._background: list[asyncio.Task] = []  # transfers started by `refresh`
        # Their failures, recorded before the failed rank's lock is given back, so that the
        # next request on that rank stops instead of running on weights that never arrived.
        self._background_errors: list[Exception] = []
        # Split refreshes (`refresh`): layouts whose target side is queued for its locks, with
        # the version they are getting (not stale meanwhile, though their calls still get the
        # old weights); the target sides' tasks, by source layout; and per (source, target),
        # whether the sender's part needs no receiver (its reply to the last transfer).
        self._delivering: dict[LayoutKey, int] = {}
        self._receiving: dict[LayoutKey, list[asyncio.Task]] = {}
        self._sends_alone: dict[tuple[LayoutKey, LayoutKey], bool] = {}
        # Set by an asynchronous run: generate MFCs that record per-token weight versions run
        # in chunks, new weights arriving between two (`realrl.workers.chunked_generation`).
        self.generation_chunks: ChunkSettings | None = None

    # ------------------------------------------------------------------ one step

    async def run_step(self, batch: SequenceSample,
                       more_prompts: Callable[[], SequenceSample] | None = None,
                       step: int = 0) -> StepResult:
        """Run the whole graph on `batch` (see `_run_part` for the rollout filter)."""
        return await self._run_part([mfc.name for mfc in self.plan.mfcs], batch, more_prompts,
                                    step)

    async def run_rollout(self, batch: SequenceSample,
                          more_prompts: Callable[[], SequenceSample] | None = None,
                          step: int = 0, keep_partial: bool = False) -> StepResult:
        """The first half of a pipelined step: every MFC except the train ones. With
        `keep_partial` (an asynchronous request) the groups the rollout filter keeps are the
        result, however few: `result.data` is None when it dropped them all."""
        return await self._run_part(self.plan.rollout_mfcs(), batch, more_prompts, step,
                                    keep_partial)

    async def run_training(self, result: StepResult) -> None:
        """The second half of a pipelined step: the train MFCs, on a finished rollout."""
        await self._run_mfcs(self.plan.train_mfcs(), result)

    async def refresh(self, names: list[str], result: StepResult) -> None:
        """Start bringing the layouts of `names` to their roles' newest weights.

        A pipelined run calls this while the train ranks are idle, so that the next rollout
        does not queue its refresh behind the next train call on the per-rank locks; an
        asynchronous run after every train step. A sender only starts its last broadcast
        (`post_send`), and each rank's lock is given back as soon as that rank has done its
        part. This returns once every rank's lock is taken, except for a *split* refresh
        (`_splits`): then it returns once the source side's locks are taken and the target
        side is queued for its locks, which it takes once the call running there (a generation
        chunk) is done; the layout holds the new version from then on, so that a chunk running
        before records the old version for its tokens.
        """
        for mfc in self.plan.mfcs:
            if mfc.name not in names or not self.plan.has_weights(mfc):
                continue
            owner, layout = self.plan.owner_layout(mfc.model_role), self.plan.layout_of(mfc.name)
            version = self.role_version[mfc.model_role]
            if max(self.layout_version[layout], self._delivering.get(layout, -1)) < version:
                sides = self._splits(owner, layout, names)
                if sides is None:
                    ranks = sorted(set(transfer_ranks(owner, layout)))
                    await self._acquire(ranks)
                    self._deliver(layout, version)
                    self._background.append(asyncio.create_task(
                        self._transfer(owner, layout, 1.0, result, f"realloc/{mfc.name}",
                                       release_locks=True)))
                    continue
                # The sender writes its buffer again only once the receivers of the last split
                # transfer from it have read it (nothing else orders the two sides).
                earlier = self._receiving.pop(owner, [])
                if earlier:
                    await asyncio.wait(earlier)
                await self._acquire(sides[0])
                self._delivering[layout] = version
                sending = asyncio.create_task(
                    self._transfer(owner, layout, 1.0, result, f"realloc/{mfc.name}",
                                   release_locks=True, ranks=sides[0]))
                self._background.append(sending)
                receiving = asyncio.create_task(self._receive(
                    owner, layout, sides[1], version, sending, result, f"realloc/{mfc.name}"))
                self._background.append(receiving)
                self._receiving.setdefault(owner, []).append(receiving)
                await asyncio.sleep(0)  # the target side queues for its locks now

    def _splits(self, source: LayoutKey, target: LayoutKey,
                names: list[str]) -> tuple[list[int], list[int]] | None:
        """The two sides of a refresh source -> target whose sides are sent their requests
        separately (`split_transfer_ranks`), or None. Only where no rank waits for the other
        side: the layouts are disjoint, the sender has said that its part needs no receiver
        (`sends_alone`, from the first refresh's reply: CPU, one bucket), and every transfer
        from `source` is a refresh of a layout among `names`, none an EMA hook (no other
        request to the sender can come while receivers are owed its buffer)."""
        if not self._sends_alone.get((source, target), False):
            return None
        refreshed = {self.plan.layout_of(name) for name in names}
        if any(src == source and (dst.role != source.role or dst not in refreshed)
               for src, dst in self.plan.transfers()):
            return None
        return split_transfer_ranks(source, target)

    async def _acquire(self, ranks: list[int], check: bool = True,
                       priority: int = REFRESH) -> None:
        """Take the locks of `ranks` in order (all or, on a failure, none), ahead of the waiters
        of a lower `priority` (a refresh's by default); with `check`, then raise a background
        transfer's failure."""
        held: list[int] = []
        try:
            for rank in ranks:
                await self.rank_locks[rank].acquire(priority)
                held.append(rank)
            if check:
                self._raise_background_failure()
        except BaseException:
            for rank in held:
                self.rank_locks[rank].release()
            raise

    async def _receive(self, source: LayoutKey, target: LayoutKey, ranks: list[int],
                       version: int, sending: asyncio.Task, result: StepResult,
                       label: str) -> None:
        """The target side of a split refresh: once its ranks are free and the sender has
        written its buffer (`sending` done: nothing else tells the receivers), they read it.
        A failed sender leaves the layout as it was (its error stops the next request)."""
        await self._acquire(ranks, check=False)  # a failure is for the caller's next request
        sent = False
        try:
            sent = await sending
        finally:
            if not sent:
                self._delivering.pop(target, None)
                for rank in ranks:
                    self.rank_locks[rank].release()
        if not sent:
            return
        self._deliver(target, version)
        await self._transfer(source, target, 1.0, result, label, release_locks=True, ranks=ranks)

    def _deliver(self, layout: LayoutKey, version: int) -> None:
        """`layout` holds the weights of `version` for every call that takes its locks next."""
        self.layout_version[layout] = version
        self._delivering.pop(layout, None)

    async def _run_part(self, names: list[str], batch: SequenceSample,
                        more_prompts: Callable[[], SequenceSample] | None,
                        step: int, keep_partial: bool = False) -> StepResult:
        """Run `names` on `batch`. With a rollout filter, the filter's MFC and its ancestors run
        first (again on `more_prompts()` when dynamic sampling dropped too many prompts), then
        the rest of `names`."""
        rollout_filter = self.plan.rollout_filter
        if rollout_filter is None:
            result = StepResult(data=batch, step=step)
            await self._run_mfcs(names, result)
            return result
        rollout = self._ancestors_and_self(rollout_filter.after_mfc)
        result = await self._rollout(batch, rollout, rollout_filter, more_prompts, step,
                                     keep_partial)
        if result.data is not None:
            await self._run_mfcs([name for name in names if name not in rollout], result)
        return result

    async def _rollout(self, batch, names, rollout_filter, more_prompts, step,
                       keep_partial) -> StepResult:
        target, kept, rounds, discarded = batch.bs, None, 0, [0, 0]
        while True:
            rounds += 1
            result = StepResult(data=batch, step=step)
            await self._run_mfcs(names, result)
            filtered, stats = apply_rollout_filter(result.data, rollout_filter)
            for index, count in enumerate(discarded_by_filter(result.data, filtered)):
                discarded[index] += count
            if filtered is not None and kept is not None:
                fresh = [i for i, id_ in enumerate(filtered.ids) if id_ not in set(kept.ids)]
                filtered = filtered.reorder(fresh) if fresh else None
            if filtered is not None:
                kept = filtered if kept is None else SequenceSample.gather([kept, filtered])
            enough = kept is not None and kept.bs >= target
            if enough or not rollout_filter.drop_equal_reward_groups:
                break
            if keep_partial:
                break
            if rounds >= rollout_filter.max_rounds or more_prompts is None:
                have = 0 if kept is None else kept.bs
                raise RolloutError(
                    f"dynamic sampling found {have} of {target} prompts whose responses got "
                    f"different rewards after {rounds} generation round(s) (last round: "
                    f"{stats.get('rollout/all_correct_fraction', 0):.0%} all correct, "
                    f"{stats.get('rollout/all_equal_fraction', 0):.0%} all equal): the data is too "
                    f"easy or too hard for this model. Raise ppo.max_generation_rounds or "
                    f"group_size, or change the data."
                )
            batch = more_prompts()
        result.data = kept
        if kept is not None and kept.bs > target:  # the surplus of the last round
            result.data = kept.reorder(list(range(target)))
            for index, count in enumerate(discarded_by_filter(kept, result.data)):
                discarded[index] += count
        result.stats.update(stats)
        result.stats["rollout/rounds"] = float(rounds)
        result.stats["rollout/discarded_groups"] = float(discarded[0])
        result.stats["rollout/discarded_tokens"] = float(discarded[1])
        return result

    def _ancestors_and_self(self, name: str) -> set[str]:
        parents, found, frontier = self._parents(), {name}, [name]
        while frontier:
            for parent in parents[frontier.pop()]:
                if parent not in found:
                    found.add(parent)
                    frontier.append(parent)
        return found

    async def _run_mfcs(self, names: list[str] | set[str], result: StepResult) -> None:
        """Run `names` (MFCs outside it count as finished), each once its inputs exist, and
        each train MFC's forward ahead once the inputs of its forward do (`_forward_ahead`)."""
        finished = {name: asyncio.Event() for name in names}
        graph_parents = self._parents()
        ahead = {mfc.name: asyncio.Event() for mfc in self.plan.mfcs
                 if mfc.name in finished and mfc.forward_keys
                 and set(self._producers(mfc.forward_keys)) & set(finished)}

        async def wait_for(parents: list[str]) -> None:
            for parent in parents:
                if parent in finished:
                    await finished[parent].wait()

        async def run_when_ready(mfc: MFCDef) -> None:
            await wait_for(graph_parents[mfc.name])
            if mfc.name in ahead:
                await ahead[mfc.name].wait()
            await self._run_mfc(mfc, result)
            finished[mfc.name].set()

        async def forward_when_ready(mfc: MFCDef) -> None:
            await wait_for(self._producers(mfc.forward_keys))
            await self._forward_ahead(mfc, result)
            ahead[mfc.name].set()

        # Forwards ahead first: woken first when their inputs arrive, they take their ranks
        # before the inference calls beside them, whose train calls wait for them all.
        tasks = [asyncio.create_task(forward_when_ready(mfc)) for mfc in self.plan.mfcs
                 if mfc.name in ahead]
        tasks += [asyncio.create_task(run_when_ready(mfc)) for mfc in self.plan.mfcs
                  if mfc.name in finished]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    def _parents(self) -> dict[str, list[str]]:
        return {mfc.name: self._producers(mfc.input_keys) for mfc in self.plan.mfcs}

    def _producers(self, keys: tuple[str, ...]) -> list[str]:
        return sorted({self.producer_of[key] for key in keys if key in self.producer_of})

    def is_stale(self, mfc: MFCDef) -> bool:
        """Whether `mfc`'s layout holds older weights than its role's newest and is not
        getting newer ones already: while a split refresh waits for the layout's locks, a call
        on it runs on the weights it has (and records their version), so that no other transfer
        reaches the sender while its receivers still owe it their part (`refresh`)."""
        if not self.plan.has_weights(mfc):
            return False
        layout = self.plan.layout_of(mfc.name)
        if layout in self._delivering:
            return False
        return self.layout_version[layout] < self.role_version[mfc.model_role]

    async def refresh_layout(self, mfc: MFCDef, result: StepResult) -> None:
        """Parameter reallocation owner -> `mfc`'s layout; the caller holds both sides' locks."""
        layout = self.plan.layout_of(mfc.name)
        await self._transfer(self.plan.owner_layout(mfc.model_role), layout, 1.0, result,
                             f"realloc/{mfc.name}")
        self.layout_version[layout] = self.role_version[mfc.model_role]

    async def _run_mfc(self, mfc: MFCDef, result: StepResult) -> None:
        if self.generation_chunks is not None and runs_in_chunks(mfc):
            await run_in_chunks(self, mfc, result, self.generation_chunks)
            return
        allocation = self.plan.allocations[mfc.name]
        layout = self.plan.layout_of(mfc.name)
        refresh = self.is_stale(mfc)
        owner = self.plan.owner_layout(mfc.model_role)
        hooks = [hook for hook in mfc.post_hooks if isinstance(hook, ParamReallocHook)]
        ranks = set(allocation.mesh.ranks)
        if refresh:
            ranks |= set(transfer_ranks(owner, layout))
        for hook in hooks:
            ranks |= set(transfer_ranks(self.plan.owner_layout(hook.source_role),
                                        self.plan.owner_layout(hook.target_role)))
        async with self.locked(sorted(ranks), result.step):
            if refresh:
                await self.refresh_layout(mfc, result)
            self.record_policy_lag(mfc, result)
            started = time.perf_counter()
            await self._dispatch(mfc, result)
            result.timing[mfc.name] = time.perf_counter() - started
            if mfc.is_train:
                self.role_version[mfc.model_role] += 1
                self.layout_version[owner] = self.role_version[mfc.model_role]
            for hook in hooks:
                await self._run_ema_hook(hook, result, mfc.name)

    def record_policy_lag(self, mfc: MFCDef, result: StepResult) -> None:
        """Remember which weights generated the batch; a train call of the same role reports how
        many train steps older they are than its own (0 in a synchronous run, 1 pipelined)."""
        if mfc.kind == MFCKind.generate:
            result.generated_by[mfc.model_role] = self.layout_version[self.plan.layout_of(mfc.name)]
        elif mfc.is_train and mfc.model_role in result.generated_by:
            lag = self.role_version[mfc.model_role] - result.generated_by[mfc.model_role]
            result.stats[f"{mfc.name}/policy_lag"] = float(lag)

    async def _run_ema_hook(self, hook: ParamReallocHook, result: StepResult, mfc_name: str):
        source = self.plan.owner_layout(hook.source_role)
        target = self.plan.owner_layout(hook.target_role)
        await self._transfer(source, target, hook.eta, result, f"ema/{mfc_name}")
        self.role_version[hook.target_role] += 1
        self.layout_version[target] = self.role_version[hook.target_role]

    @contextlib.asynccontextmanager
    async def locked(self, ranks: list[int], step: int):
        """Hold the locks of `ranks` (sorted), taken before the waiters of later steps."""
        await self._acquire(ranks, priority=step)
        try:
            yield
        finally:
            for rank in ranks:
                self.rank_locks[rank].release()

    def _raise_background_failure(self) -> None:
        """Raise the first failure of a background transfer; forget the finished ones."""
        done = [task for task in self._background if task.done()]
        self._background = [task for task in self._background if not task.done()]
        for task in done:
            task.result()  # a failure outside the ranks' requests (theirs are recorded)
        if self._background_errors:
            error, self._background_errors = self._background_errors[0], []
            raise error

    async def drain(self) -> None:
        """Wait for the background transfers (before checkpoints and at the end of the run)."""
        if self._background:
            await asyncio.wait(self._background)
        self._raise_background_failure()

    async def _transfer(self, source: LayoutKey, target: LayoutKey, eta: float,
                        result: StepResult, label: str, release_locks: bool = False,
                        ranks: list[int] | None = None) -> bool:
        """Run a transfer on every rank that takes part, or on `ranks`, one side of a split
        transfer (`refresh`). With `release_locks` the caller holds those ranks' locks, and
        each is released when its rank replies, and senders only start their last broadcast;
        a rank's failure is then recorded for the next request, and this returns False."""
        failed = False
        started = time.perf_counter()
        header = {"source": vars(source) | {"ranks": list(source.ranks)},
                  "target": vars(target) | {"ranks": list(target.ranks)}, "eta": eta,
                  "post_send": release_locks, "split": ranks is not None}

        async def on_rank(rank: int) -> None:
            nonlocal failed
            try:
                reply = await self.request(rank, Message("transfer", header), label, result.step)
                if "sends_alone" in reply.header:
                    self._sends_alone[(source, target)] = reply.header["sends_alone"]
            except Exception as error:
                if not release_locks:
                    raise
                self._background_errors.append(error)  # seen by the lock's next holder
                failed = True
            finally:
                if release_locks:
                    self.rank_locks[rank].release()

        ranks = transfer_ranks(source, target) if ranks is None else ranks
        await asyncio.gather(*(on_rank(rank) for rank in ranks))
        result.timing[label] = result.timing.get(label, 0.0) + time.perf_counter() - started
        return not failed

    async def request(self, rank: int, message: Message, name: str | None = None,
                       step: int | None = None) -> Message:
        """Send `message` to `rank` and return its reply; `name` (the MFC or transfer, default
        the message kind) and `step` say what the call is while it is in flight."""
        with self.calls.track(rank, message.kind, name or message.kind, step):
            reply = await self.clients[rank].request(message, timeout_s=REQUEST_TIMEOUT_S)
        return reply.raise_if_error()

    async def _forward_ahead(self, mfc: MFCDef, result: StepResult) -> None:
        """Run train MFC `mfc`'s forward on its `forward_keys` before its other inputs exist;
        its workers keep the graph for the train call. Skipped when the call's layout is not
        up to date: the train call then refreshes it and runs its own forward."""
        ranks = sorted(self.plan.allocations[mfc.name].mesh.ranks)
        async with self.locked(ranks, result.step):
            if self.is_stale(mfc):
                return
            started = time.perf_counter()
            await self._dispatch(mfc, result, ahead=True)
            result.timing[f"{mfc.name}/forward"] = time.perf_counter() - started

    async def _dispatch(self, mfc: MFCDef, result: StepResult, ahead: bool = False) -> None:
        allocation = self.plan.allocations[mfc.name]
        inputs = result.data.select(mfc.forward_keys if ahead else mfc.input_keys)
        parts, _, backward_indices = inputs.split_data_parallel(allocation.strategy.data)
        requests, heads = [], []
        for dp_rank, part in enumerate(parts):
            meta, tensors = part.to_wire()
            for rank in allocation.ranks_of_dp_rank(dp_rank):
                header = ({"mfc": mfc.name, "data": meta, "step": result.step}
                          | ({"ahead": True} if ahead else {}))
                name = f"{mfc.name}/forward" if ahead else mfc.name
                requests.append(self.request(rank, Message("mfc", header, tensors), name,
                                              result.step))
                heads.append(rank in allocation.dp_head_ranks())
        replies = await asyncio.gather(*requests)
        compute_s = max(reply.header.get("compute_s", 0.0) for reply in replies)
        # The largest peak over the call's ranks (and rounds; `realrl.workers.memory_watch`).
        peak_key = f"{mfc.name}{'/forward' if ahead else ''}/peak_memory_gb"
        result.stats[peak_key] = max(
            [result.stats.get(peak_key, 0.0)]
            + [reply.header.get("peak_memory_gb", 0.0) for reply in replies]
        )
        if ahead:
            result.compute[f"{mfc.name}/forward"] = compute_s
            return
        result.compute[mfc.name] = compute_s
        head_replies = [reply for reply, is_head in zip(replies, heads) if is_head]
        self._merge_stats(mfc, head_replies, result)
        if mfc.output_keys:
            outputs = [SequenceSample.from_wire(r.header["data"], r.tensors) for r in head_replies]
            merged = SequenceSample.gather(outputs).reorder(backward_indices)
            result.data.update_(merged.select(mfc.output_keys))

    @staticmethod
    def _merge_stats(mfc: MFCDef, replies: list[Message], result: StepResult) -> None:
        """Train stats are already reduced over dp ranks; inference stats are averaged."""
        replies = replies[:1] if mfc.is_train else replies
        keys = {key for reply in replies for key in reply.header.get("stats", {})}
        for key in keys:
            values = [reply.header["stats"][key] for reply in replies if key in reply.header["stats"]]
            result.stats[f"{mfc.name}/{key}"] = sum(values) / len(values)

    async def broadcast(self, kind: str, header: dict) -> None:
        """Send one request to every worker and wait for all (checkpoints, shutdown), then raise
        the first failure: a failed save removes its directory only once no worker writes."""
        await self.drain()
        outcomes = await asyncio.gather(
            *(self.request(rank, Message(kind, header)) for rank in self.clients),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
