"""A collective whose peer never comes raises after `watchdog.collective_timeout_s`.

Two real gloo processes join the world as a model worker does (`join_world`) and create the
plan's process groups (`ProcessGroups.create`); rank 0 enters an all-reduce on the layout's
data-parallel group, then on the world group, while rank 1, alive, enters neither. Without
the timeout each would wait torch's default 30 minutes.
"""

import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from rank_processes import environment_for_ranks, rank_context, run_rank

from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.config import BaseExperimentConfig, WatchdogConfig
from realrl.api.dfg import MFCDef
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    DType,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
)
from realrl.workers.model_worker import join_world
from realrl.workers.realloc import ProcessGroups
from realrl.workers.run_plan import RunPlan

TIMEOUT_S = 2.0


def two_rank_plan(collective_timeout_s: float) -> RunPlan:
    """One trained model, data parallel over ranks 0 and 1."""
    model = ModelRoleConfig(path="unused: no model is built", dtype=DType.float32)
    base = BaseExperimentConfig(n_devices_per_node=2,
                                watchdog=WatchdogConfig(collective_timeout_s=collective_timeout_s))
    return RunPlan(
        base=base, dataset=DatasetConfig(), dataset_kind=DatasetKind.prompt,
        models={"actor": ModelSpec("actor", ModelKind.lm, model, True)},
        mfcs=[MFCDef("actor_train", "actor", "train_step", "sft", None, ("x",))],
        allocations={"actor_train": MFCAllocation("actor_train", DeviceMesh(1, 2, (0, 1)),
                                                  ParallelStrategy(data=2))},
    )


def rank_main(rank: int, store_path: str, results, rank0_done) -> None:
    try:
        run_collectives(rank, store_path, results, rank0_done)
    except BaseException:  # a forked rank's stderr is the fork server's: send the cause here
        results.put((f"rank {rank} failed", traceback.format_exc()))
        flush_and_exit(results, 1)


def flush_and_exit(results, code: int) -> None:
    """`os._exit` after the queue's feeder thread has written what was put: exiting at once
    can lose the last result (a put returns before the item reaches the pipe)."""
    results.close()
    results.join_thread()
    os._exit(code)


def run_collectives(rank: int, store_path: str, results, rank0_done) -> None:
    torch.set_num_threads(1)
    plan = two_rank_plan(TIMEOUT_S)
    store = dist.FileStore(store_path, 2)
    join_world(store, rank, 2, plan)
    groups = ProcessGroups.create(plan)
    if rank == 1:  # alive, connected, but never enters a collective
        rank0_done.wait(120)
        os._exit(0)
    data_group = groups.data_group(plan.layout_of("actor_train"), rank)
    for name, group in (("data group", data_group), ("world", None)):
        try:
            dist.all_reduce(torch.ones(4), group=group)
            results.put((name, "returned"))
        except Exception as error:  # gloo's timeout: a RuntimeError
            results.put((name, f"{type(error).__name__}: {error}"))
    rank0_done.set()
    flush_and_exit(results, 0)  # no teardown collective with a peer that will not answer


def test_a_collective_without_its_peer_raises_after_the_configured_timeout(tmp_path):
    context = rank_context()
    results, rank0_done = context.Queue(), context.Event()
    processes = [context.Process(target=run_rank, args=(rank, rank_main, environment_for_ranks(),
                                                        str(tmp_path / "store"), results,
                                                        rank0_done))
                 for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        outcomes = wait_for_outcomes(results, processes, 2, timeout_s=120)
    finally:
        for process in processes:
            process.kill()
            process.join()
    assert [name for name, _ in outcomes] == ["data group", "world"]
    for name, outcome in outcomes:  # gloo names the timeout it was given
        assert f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in outcome, (name, outcome)


def wait_for_outcomes(results, processes, count: int, timeout_s: float) -> list:
    """`count` results, failing at once (with the exit codes) when every rank has exited
    without sending them, instead of waiting out the timeout."""
    outcomes, deadline = [], time.monotonic() + timeout_s
    while len(outcomes) < count:
        try:
            outcomes.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        if all(not process.is_alive() for process in processes) or time.monotonic() > deadline:
            try:
                while len(outcomes) < count:  # what was sent just before the ranks exited
                    outcomes.append(results.get(timeout=1.0))
            except queue.Empty:
                pytest.fail(f"the ranks sent {outcomes} and exited with "
                            f"{[process.exitcode for process in processes]} (None: still running)")
    return outcomes
