"""The megatron optimizer backend inside the runtime: a real `ModelWorker` on 4 gloo ranks.

The tiny default actor is trained as d2t2 with the SFT interface (as in
`test_tensor_parallel_runtime`), its optimizer being megatron-core's DDP and
DistributedOptimizer over the layout's own groups: masters and AdamW moments sharded over the
data-parallel group within each tensor-parallel shard, the gradient norm summed over the
layout. The worker's device rule (`resolve_optimizer_backend`) refuses megatron on CPU workers,
so each rank installs the backend it picks on CUDA workers, under the test-only device shim.
Checked: the full parameters after each step equal one device's (torch backend, whole batch)
within 1e-5, with clipping active; a checkpoint holds the full HF weights and one optimizer
file per dp and tp rank; loading it and training again repeats the step bit for bit; a
checkpoint the torch backend wrote (one optimizer file per tp rank) is refused with the fix.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from megatron_cpu_shim import cuda_to_cpu
from rank_processes import start_ranks
from test_tensor_parallel_runtime import (
    MAX_GRAD_NORM,
    WORLD,
    full_parameters,
    make_batch,
    make_plan,
    shard_state,
    train_message,
    train_single_device,
)

from realrl.launcher.defaults import fresh_default_model
from realrl.models.checkpoint import load_pretrained
from realrl.workers.model_worker import ModelWorker
from realrl.workers.realloc import ProcessGroups
from realrl.workers.wire import Message


def install_megatron_backend(worker: ModelWorker, engine) -> None:
    from realrl.backends.megatron_optimizer import MegatronOptimizerBackend

    spec = worker.plan.models["actor"]
    engine.backend = MegatronOptimizerBackend(
        engine.module, engine.parallel, spec.config.optimizer, worker.plan.base.total_train_steps
    )


def load_torch_backend_checkpoint(worker: ModelWorker, result_dir: str) -> str:
    """The error of loading the checkpoint as the torch backend would have written it (one
    optimizer file per tp rank, replica 0's)."""
    source = os.path.join(result_dir, "checkpoint")
    written = os.path.join(result_dir, "checkpoint_torch")
    if dist.get_rank() == 0:
        shutil.copytree(source, written)
        for tp in (0, 1):
            actor = os.path.join(written, "actor")
            os.rename(os.path.join(actor, f"optimizer.dp0of2.tp{tp}of2.pt"),
                      os.path.join(actor, f"optimizer.tp{tp}of2.pt"))
            os.remove(os.path.join(actor, f"optimizer.dp1of2.tp{tp}of2.pt"))
    dist.barrier()
    try:
        worker.handle(Message("load", {"directory": written}))
    except FileNotFoundError as error:
        return str(error)
    return ""


def run_worker(rank: int, port: int, model_path: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    with cuda_to_cpu():
        from realrl.backends import megatron_optimizer

        megatron_optimizer.BUCKET_PARAMETERS = 50_000  # several buckets
        plan = make_plan(model_path)
        worker = ModelWorker(rank, plan, ProcessGroups.create(plan))
        engine = worker.models[plan.layout_of("sft_train")].engine
        install_megatron_backend(worker, engine)
        coordinates = plan.allocations["sft_train"].coordinates_of(rank)
        batch = make_batch(engine.module.config.vocab_size)
        part = batch.split_data_parallel(2)[0][coordinates.dp]
        checkpoint = os.path.join(result_dir, "checkpoint")
        result = {"dp": coordinates.dp, "tp": coordinates.tp, "stats": []}
        result["stats"].append(worker.handle(train_message(part)).raise_if_error().header["stats"])
        result["step1"] = shard_state(engine)
        worker.handle(Message("save", {"directory": checkpoint})).raise_if_error()
        dist.barrier()
        result["stats"].append(worker.handle(train_message(part)).raise_if_error().header["stats"])
        result["step2"] = shard_state(engine)
        worker.handle(Message("load", {"directory": checkpoint})).raise_if_error()
        result["loaded"] = shard_state(engine)
        result["stats_again"] = worker.handle(train_message(part)).raise_if_error().header["stats"]
        result["step2_again"] = shard_state(engine)
        shards = engine.backend.optimizer.param_groups[0]["params"]
        result["shard_numel"] = sum(p.numel() for p in shards)
        result["module_numel"] = sum(p.numel() for p in engine.module.parameters())
        result["torch_checkpoint_error"] = load_torch_backend_checkpoint(worker, result_dir)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    if rank == 0:
        train_single_device(plan, batch, result_dir)
    dist.barrier()
    dist.destroy_process_group()


def spawn_world(tmp_path_factory, name: str, worker) -> tuple:
    """Run `worker(rank, port, model_path, result_dir)` on `WORLD` spawned ranks over the tiny
    default model; (result_dir, the model's config, {rank: the rank's saved results})."""
    from realrl.api.ports import free_port

    directory = tmp_path_factory.mktemp(name)
    model_path = str(fresh_default_model(directory / "model"))
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(worker, (free_port(), model_path, str(directory)), WORLD)
    results = {rank: torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD)}
    return directory, load_pretrained(model_path).config, results


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return spawn_world(tmp_path_factory, "megatron_runtime", run_worker)


def test_d2t2_distributed_optimizer_trains_like_one_device(run):
    directory, config, results = run
    reference = torch.load(directory / "reference.pt")
    for step in ("step1", "step2"):  # every replica's full parameters equal one device's
        for dp in (0, 1):
            full = full_parameters(results, step, dp, config)
            for name, expected in reference[step].items():
                torch.testing.assert_close(
                    full[name], expected, rtol=0, atol=1e-5, msg=f"{step} replica {dp}: {name}"
                )
    for index, expected in enumerate(reference["stats"]):
        assert expected["grad_norm"] > MAX_GRAD_NORM  # clipping was active
        for rank_result in results.values():
            got = rank_result["stats"][index]
            assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
            assert got["lr"] == expected["lr"]
    for rank_result in results.values():  # each rank steps half of its tp shard
        share = rank_result["shard_numel"] / rank_result["module_numel"]
        assert 0.4 < share < 0.6


def test_d2t2_checkpoint_writes_one_optimizer_file_per_rank_and_resumes_bit_exact(run):
    directory, config, results = run
    saved = load_pretrained(directory / "checkpoint" / "actor").state_dict()
    step1 = full_parameters(results, "step1", 0, config)
    assert all(torch.equal(saved[name], step1[name]) for name in step1)
    optimizer_files = sorted(p.name for p in (directory / "checkpoint" / "actor").glob("opt*"))
    assert optimizer_files == [
        f"optimizer.dp{dp}of2.tp{tp}of2.pt" for dp in (0, 1) for tp in (0, 1)
    ]
    for rank_result in results.values():
        assert rank_result["stats_again"] == rank_result["stats"][1]
        for name, value in rank_result["loaded"].items():
            assert torch.equal(value, rank_result["step1"][name]), name
            assert torch.equal(rank_result["step2_again"][name], rank_result["step2"][name]), name


def test_a_torch_backend_checkpoint_is_refused_naming_the_layout_and_backend(run):
    _, _, results = run
    for rank_result in results.values():
        error = rank_result["torch_checkpoint_error"]
        assert "optimizer.tp0of2.pt" in error and "actor.optimizer.backend" in error
