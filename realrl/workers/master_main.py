"""The master process: publish the plan, wait for the workers, then run the step loop.

One step = one batch from the dataset through the whole graph. Around it: metrics, periodic
checkpoints (every trained model in Hugging Face format plus optimizer, RNG and data
position), and recovery from the last complete checkpoint with `recover_mode=auto`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from realrl.api.config import RecoverMode
from realrl.api.experiment import ModelKind
from realrl.models.tokenizer import load_tokenizer
from realrl.workers import recovery
from realrl.workers.data_source import DataSource
from realrl.workers.master import Master, StepResult
from realrl.workers.metrics_log import MetricsLogger
from realrl.workers.rendezvous import Rendezvous
from realrl.workers.run_plan import RunPlan
from realrl.workers.run_secret import load_run_secret
from realrl.workers.transport import AsyncClient

logger = logging.getLogger(__name__)


def step_metrics(result: StepResult, step_seconds: float) -> dict[str, float]:
    metrics = dict(result.stats)
    if "rew_inf/task_mean" in metrics:
        metrics["reward/task_mean"] = metrics["rew_inf/task_mean"]
    for name, seconds in result.timing.items():
        metrics[f"timing/{name}"] = seconds
    compute = sum(result.compute.values())
    metrics["timing/step_s"] = step_seconds
    metrics["perf/compute_s"] = compute
    metrics["perf/overhead_fraction"] = max(0.0, 1.0 - compute / max(step_seconds, 1e-9))
    return metrics


def _tokenizer_path(plan: RunPlan) -> str:
    for spec in plan.models.values():
        if spec.kind == ModelKind.lm and spec.config is not None:
            return spec.config.path
    return next(s.config.path for s in plan.models.values() if s.config is not None)


async def _main_loop(run_dir: Path, plan: RunPlan, addresses: dict[int, str]) -> None:
    secret = load_run_secret(run_dir)
    clients = {rank: AsyncClient(address, secret) for rank, address in addresses.items()}
    master = Master(plan, clients)
    data = DataSource(plan, load_tokenizer(_tokenizer_path(plan)))
    first_step = 0
    if plan.base.recover_mode != RecoverMode.disabled:
        checkpoint = recovery.latest_complete_checkpoint(run_dir)
        if checkpoint is None and plan.base.recover_mode == RecoverMode.resume:
            raise RuntimeError(f"recover_mode=resume but {run_dir} has no complete checkpoint")
        if checkpoint is not None:
            first_step = await recovery.restore(master, data, checkpoint, plan)
            logger.info("resumed from %s at step %d", checkpoint, first_step)
    metrics_logger = MetricsLogger(run_dir, plan.base, first_step)
    save_every = plan.base.save_freq_steps
    try:
        for step in range(first_step, plan.base.total_train_steps):
            started = time.perf_counter()
            result = await master.run_step(data.next_batch(), more_prompts=data.next_batch)
            metrics_logger.log(step + 1, step_metrics(result, time.perf_counter() - started))
            last = step + 1 == plan.base.total_train_steps
            if last or (save_every and (step + 1) % save_every == 0):
                await recovery.save(master, data, run_dir, step + 1)
    finally:
        metrics_logger.finish()
    await master.broadcast("exit", {})
    for client in clients.values():
        client.close()


def run_master(run_dir: Path, rendezvous: Rendezvous, world_size: int) -> int:
    plan_json = (run_dir / "plan.json").read_text()
    plan = RunPlan.from_json(plan_json)
    rendezvous.publish("plan", plan_json)
    addresses = {rank: rendezvous.wait_for(f"worker/{rank}/address") for rank in range(world_size)}
    for rank in range(world_size):
        rendezvous.wait_for(f"worker/{rank}/ready")
    logger.info("all %d workers ready", world_size)
    asyncio.run(_main_loop(run_dir, plan, addresses))
    logger.info("run finished: %s", run_dir)
    return 0
