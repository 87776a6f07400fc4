"""The master process: publish the plan, wait for the workers, then run the step loop.

One step = one batch from the dataset through the whole graph (with `pipeline_rollout=true`
the rollout of the next step runs beside it; with `rollout.mode=async` rollouts stream ahead
under a staleness bound, `realrl.workers.async_rollout`). Around it: metrics (the MFCs'
statistics, and what `realrl.workers.samples_log` reads from the step's batch), periodic
checkpoints (every trained model in Hugging Face format plus optimizer, RNG and data
position), recovery from the last complete checkpoint with `recover_mode=auto`, and graceful
preemption: asked by SIGUSR1 (`realrl.workers.preemption`), the master finishes the step in
flight, writes a checkpoint, lets the workers exit and exits with `PREEMPTED_EXIT_CODE`. The
hang watchdog (`realrl.workers.watchdog`) guards all of it: a call past its deadline or a
worker that stops answering heartbeats ends the run with a diagnosis and `HANG_EXIT_CODE`. An
error written for the user (`realrl.api.errors.UserFacingError`: a worker's NaN under
nan_policy=stop or failed reward service, a checkpoint the disk cannot take) ends it with that
one message, reported by `realrl.launcher.entry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from realrl.api.config import RecoverMode
from realrl.models.tokenizer import load_tokenizer
from realrl.workers import recovery
from realrl.workers.async_rollout import async_steps
from realrl.workers.core_share import unlink_mapped_share_file
from realrl.workers.data_source import DataSource, tokenizer_path
from realrl.workers.hang_report import WorkerProcess
from realrl.workers.heap_freeze import HeapFreezer
from realrl.workers.heartbeat import heartbeat_key
from realrl.workers.master import Master, StepResult
from realrl.workers.metrics_log import MetricsLogger
from realrl.workers.preemption import PREEMPTED_EXIT_CODE, PreemptionRequest
from realrl.workers.rendezvous import Rendezvous
from realrl.workers.run_plan import RunPlan
from realrl.workers.run_secret import load_run_secret
from realrl.workers.samples_log import (
    GeneratedFile,
    batch_metrics,
    generates_rollouts,
    logs_samples_at,
    sample_rows,
    train_reward_key,
)
from realrl.workers.transport import AsyncClient
from realrl.workers.watchdog import HANG_EXIT_CODE, HangError, InFlightCalls, Watchdog

logger = logging.getLogger(__name__)


def step_metrics(result: StepResult, step_seconds: float, rollout_wait_s: float | None = None,
                 train_mfcs: Collection[str] = ()) -> dict[str, float]:
    """A step's metrics. Pipelined runs pass `rollout_wait_s`, how long the step waited for its
    rollout, which ran while the previous step trained, and the names of the train MFCs: the
    step's compute is then that wait plus its train calls, and the rollout's own compute
    (overlapped) is not counted."""
    metrics = dict(result.stats)
    for name, seconds in result.timing.items():
        metrics[f"timing/{name}"] = seconds
    compute = sum(result.compute.values())
    if rollout_wait_s is not None:
        train = sum(seconds for name, seconds in result.compute.items() if name in train_mfcs)
        compute = rollout_wait_s + train
        metrics["timing/rollout_wait_s"] = rollout_wait_s
    metrics["timing/step_s"] = step_seconds
    metrics["perf/compute_s"] = compute
    metrics["perf/overhead_fraction"] = max(0.0, 1.0 - compute / max(step_seconds, 1e-9))
    return metrics


async def _resume_point(master: Master, data: DataSource, run_dir: Path, plan: RunPlan) -> int:
    """The step to start from: 0, or the last complete checkpoint's (loaded into every worker
    and the data iterator) with `recover_mode=auto|resume`."""
    if plan.base.recover_mode == RecoverMode.disabled:
        return 0
    recovery.discard_incomplete(run_dir)
    checkpoint = recovery.latest_complete_checkpoint(run_dir)
    if checkpoint is None and plan.base.recover_mode == RecoverMode.resume:
        raise RuntimeError(f"recover_mode=resume but {run_dir} has no complete checkpoint")
    if checkpoint is None:
        return 0
    first_step = await recovery.restore(master, data, checkpoint, plan)
    logger.info("resumed from %s at step %d", checkpoint, first_step)
    return first_step


async def _main_loop(run_dir: Path, plan: RunPlan, addresses: dict[int, str],
                     calls: InFlightCalls, preemption: PreemptionRequest) -> int:
    """Run the steps; returns the exit code (0, or `PREEMPTED_EXIT_CODE` when asked to stop)."""
    secret = load_run_secret(run_dir)
    clients = {rank: AsyncClient(address, secret) for rank, address in addresses.items()}
    master = Master(plan, clients, calls)
    tokenizer = load_tokenizer(tokenizer_path(plan.models))
    data = DataSource(plan, tokenizer)
    if plan.base.total_train_steps == 0:  # `gen`: one pass over the data
        plan.base.total_train_steps = data.iterator.batches_per_epoch
        logger.info("total_train_steps=0: one pass over the data, %d steps",
                    plan.base.total_train_steps)
    first_step = await _resume_point(master, data, run_dir, plan)
    metrics_logger = MetricsLogger(run_dir, plan.base, first_step)
    generated_files = GeneratedFile.for_mfcs(plan.mfcs, run_dir, data.dataset, first_step,
                                             tokenizer)
    train_mfcs, reward_key, log = plan.train_mfcs(), train_reward_key(plan.mfcs), plan.base.log
    sample_rollouts = generates_rollouts(plan.mfcs)
    heap = HeapFreezer.for_master()

    async def end_of_step(step: int, result: StepResult, seconds: float,
                          rollout_wait_s: float | None = None, stop: bool = False) -> None:
        """Log step `step` (0-based); checkpoint on schedule, or because the run stops."""
        metrics = step_metrics(result, seconds, rollout_wait_s, train_mfcs)
        metrics |= batch_metrics(result.data, reward_key, log.per_sample_keys)
        metrics_logger.log(step + 1, metrics)
        if sample_rollouts and logs_samples_at(step + 1, log.samples_every_steps):
            metrics_logger.log_samples(step + 1, sample_rows(
                result.data, tokenizer, log.samples_per_step, reward_key))
        for generated in generated_files:
            generated.append(step + 1, result.data)
        if stop or saves_after(plan.base, step + 1):
            await recovery.save(master, data, run_dir, step + 1)
        heap.between_requests(warmed_up=step == first_step)

    steps = range(first_step, plan.base.total_train_steps)
    run_steps = _step_loop(plan.base)
    try:
        steps_done = await run_steps(master, data, steps, end_of_step, preemption)
    finally:
        heap.close()
        metrics_logger.finish()
        for generated in generated_files:
            generated.finish()
    await master.broadcast("exit", {})
    for client in clients.values():
        client.close()
    if steps_done < steps.stop:
        _log_preemption(preemption, steps_done, run_dir)
        return PREEMPTED_EXIT_CODE
    return 0


def _log_preemption(preemption: PreemptionRequest, steps_done: int, run_dir: Path) -> None:
    checkpoint = recovery.latest_complete_checkpoint(run_dir)
    logger.warning(
        "stopped at %s after step %d; newest checkpoint: %s. Resume with the same command and "
        "recover_mode=auto", preemption.signal_name, steps_done, checkpoint or "none",
    )


def saves_after(base, steps_done: int) -> bool:
    """Whether a checkpoint is written after `steps_done` steps (always after the last)."""
    every = base.save_freq_steps
    return steps_done == base.total_train_steps or bool(every and steps_done % every == 0)


def _step_loop(base) -> Callable[..., Awaitable[int]]:
    """The loop that runs the steps: synchronous, pipelined (`pipeline_rollout`) or
    asynchronous (`rollout.mode=async`, `realrl.workers.async_rollout`)."""
    if base.rollout.is_async:
        return functools.partial(async_steps, saves_after=lambda done: saves_after(base, done))
    return _pipelined_steps if base.pipeline_rollout else _synchronous_steps


async def _synchronous_steps(master: Master, data: DataSource, steps: range,
                             end_of_step: Callable[..., Awaitable[None]],
                             preemption: PreemptionRequest) -> int:
    """Run `steps` one after the other; returns the steps done when it stops (`steps.stop`
    unless `preemption` asked it to stop after the step in flight)."""
    for step in steps:
        if preemption.requested and step == steps.start:
            return step  # asked during start-up: nothing new to checkpoint
        started = time.perf_counter()
        result = await master.run_step(data.next_batch(), more_prompts=data.next_batch,
                                       step=step + 1)
        stop = preemption.requested
        await end_of_step(step, result, time.perf_counter() - started, stop=stop)
        if stop:
            return step + 1
    return steps.stop


async def _pipelined_steps(master: Master, data: DataSource, steps: range,
                           end_of_step: Callable[..., Awaitable[None]],
                           preemption: PreemptionRequest) -> int:
    """`pipeline_rollout=true`: step i+1's rollout runs while step i trains.

    Each step waits for its rollout, starts bringing the rollout layouts up to the newest
    weights (the train ranks only start sending them), then trains while the next rollout runs
    on the weights it just received: one train step old. No rollout runs ahead of a
    checkpoint, so the data position a checkpoint records is exact and a resumed run goes on
    from there. A stop asked for by `preemption` while a rollout runs ahead finishes that
    rollout's step too, for the same reason. Returns the steps done, as `_synchronous_steps`.
    """
    def start_rollout(step: int) -> asyncio.Task:  # `step`: 0-based, as in `steps`
        return asyncio.create_task(master.run_rollout(data.next_batch(), data.next_batch,
                                                      step=step + 1))

    pending: asyncio.Task | None = None
    try:
        for step in steps:
            if preemption.requested and step == steps.start:
                return step  # asked during start-up: nothing new to checkpoint
            started = time.perf_counter()
            if pending is None:  # the first step, and the first after a checkpoint
                pending = start_rollout(step)
            result = await pending
            rollout_wait_s = time.perf_counter() - started
            await master.refresh(master.plan.rollout_mfcs(), result)
            stop = preemption.requested
            ahead = (step + 1 < steps.stop and not stop
                     and not saves_after(master.plan.base, step + 1))
            pending = start_rollout(step + 1) if ahead else None
            await master.run_training(result)
            await master.drain()  # the refresh ended long ago; its timing belongs to this step
            await end_of_step(step, result, time.perf_counter() - started, rollout_wait_s,
                              stop=stop)
            if stop:
                return step + 1
        return steps.stop
    finally:  # a failed step: stop the rollout in flight and collect its outcome
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending


def run_master(run_dir: Path, rendezvous: Rendezvous, world_size: int,
               preemption: PreemptionRequest) -> int:
    """Run the master; returns its exit code. `preemption` is installed by the caller, before
    the workers start, so that a stop asked for during start-up is not lost."""
    plan_json = (run_dir / "plan.json").read_text()
    plan = RunPlan.from_json(plan_json)
    rendezvous.publish("plan", plan_json)
    addresses = {rank: rendezvous.wait_for(f"worker/{rank}/address") for rank in range(world_size)}
    workers = {rank: WorkerProcess.from_publication(rendezvous.wait_for(heartbeat_key(rank)))
               for rank in range(world_size)}
    for rank in range(world_size):
        rendezvous.wait_for(f"worker/{rank}/ready")
    unlink_mapped_share_file()
    logger.info("all %d workers ready", world_size)
    watchdog = Watchdog(plan.base.watchdog, run_dir, workers, load_run_secret(run_dir))
    try:
        exit_code = asyncio.run(
            watchdog.run(_main_loop(run_dir, plan, addresses, watchdog.calls, preemption)))
    except HangError as hang:
        logger.error("%s", hang)
        return HANG_EXIT_CODE
    if exit_code == 0:
        logger.info("run finished: %s", run_dir)
    return exit_code
