"""LoRA adapters under tensor and data parallelism, with both optimizer backends.

Two gloo ranks train the tiny model's adapters (non-zero at the start, so A and B both get
gradients) for three clipped AdamW steps as t2 (megatron-core's layers; the adapters split
like their layers) and d2, on the torch backend and on megatron-core's DDP and distributed
optimizer (under the test-only CPU shim, `megatron_cpu_shim`); each must equal one rank
training the whole model within 1e-5, the base weights must not move, the split factors must
be exactly those marked `tensor_model_parallel`, and the optimizers must hold the adapters'
state only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from megatron_cpu_shim import cuda_to_cpu
from rank_processes import start_ranks
from test_megatron_backend import HALVES, MAX_GRAD_NORM, assert_same_statistics, make_engine
from test_megatron_backend import train as train_steps
from test_mixed_precision import tiny_model

from realrl.api.experiment import OptimizerBackendName
from realrl.api.lora import LoRAConfig
from realrl.backends.torch_engine import ParallelContext, sharded_parameter_ids
from realrl.models.lora import add_adapters
from realrl.models.tensor_parallel import shard_state_dict, unshard_state_dicts
from realrl.workers.model_loading import shard_module

LORA = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj",
                                                   "up_proj", "down_proj"])
TOLERANCE = 1e-5


def starting_adapters() -> dict[str, torch.Tensor]:
    """Full adapter factors, B off zero (as after some training)."""
    model = add_adapters(tiny_model(), LORA, seed=1)
    generator = torch.Generator().manual_seed(5)
    return {name: (0.3 * torch.randn(p.shape, generator=generator) if ".lora_B." in name
                   else p.detach().clone())
            for name, p in model.named_parameters() if "_lora." in name}


def adapted_model(parallel: ParallelContext):
    """The tiny model's shard for `parallel` with the starting adapters' shard."""
    module = add_adapters(shard_module(tiny_model(), parallel), LORA, seed=1)
    adapters = starting_adapters()
    if parallel.tp_size > 1:
        adapters = shard_state_dict(adapters, parallel.tp_rank, parallel.tp_size, module.config)
    parameters = dict(module.named_parameters())
    with torch.no_grad():
        for name, tensor in adapters.items():
            parameters[name].copy_(tensor)
    return module


def adapters_of(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if "_lora." in name}


def run(parallel: ParallelContext, backend: OptimizerBackendName, sequences) -> dict:
    module = adapted_model(parallel)
    base = {name: p.detach().clone() for name, p in module.named_parameters()
            if "_lora." not in name}
    engine = make_engine(module, parallel, backend)
    stats = train_steps(engine, sequences)
    shard = adapters_of(module)
    if parallel.tp_size > 1:
        shards = [None, None]
        dist.all_gather_object(shards, shard, group=parallel.tp_group)
        shard = unshard_state_dicts(shards, module.config)
    optimizer_params = engine.optimizer.param_groups[0]["params"]
    full_shapes = {name: tensor.shape for name, tensor in starting_adapters().items()}
    split = {name for name, p in module.named_parameters()
             if "_lora." in name and p.shape != full_shapes[name]}
    marked = {name for name, p in module.named_parameters()
              if "_lora." in name and id(p) in sharded_parameter_ids(module)}
    return {
        "adapters": shard, "stats": stats,
        "base_unchanged": all(torch.equal(p, base[name]) for name, p in module.named_parameters()
                              if name in base),
        "optimizer_numel": sum(p.numel() for p in optimizer_params),
        "adapter_numel": sum(p.numel() for n, p in module.named_parameters() if "_lora." in n),
        "split_is_marked": split == marked and (parallel.tp_size == 1 or len(split) > 0),
    }


def worker(rank: int, rendezvous: str, output: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        with cuda_to_cpu():
            group = dist.new_group([0, 1])
            tensor = ParallelContext(tp_rank=rank, tp_size=2, tp_group=group)
            data = ParallelContext(dp_rank=rank, dp_size=2, dp_group=group)
            whole = HALVES[0] + HALVES[1]
            results = {}
            for backend in (OptimizerBackendName.torch, OptimizerBackendName.megatron):
                results[f"t2_{backend.value}"] = run(tensor, backend, whole)
                results[f"d2_{backend.value}"] = run(data, backend, HALVES[rank])
        torch.save(results, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("lora_parallel")
    output = str(directory / "result")
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(worker, (str(directory / "rendezvous"), output), 2)
    return [torch.load(f"{output}.rank{rank}", weights_only=False) for rank in range(2)]


@pytest.fixture(scope="module")
def reference() -> dict:
    return run(ParallelContext(), OptimizerBackendName.torch, HALVES[0] + HALVES[1])


@pytest.mark.parametrize("layout", ["t2_torch", "t2_megatron", "d2_torch", "d2_megatron"])
def test_parallel_lora_training_equals_one_rank(ranks, reference, layout):
    assert reference["base_unchanged"]
    assert reference["optimizer_numel"] == reference["adapter_numel"]
    start = starting_adapters()
    moved = [n for n, t in reference["adapters"].items() if not torch.equal(t, start[n])]
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    for result in ranks:
        got = result[layout]
        assert got["base_unchanged"] and got["split_is_marked"], layout
        for name, expected in reference["adapters"].items():
            torch.testing.assert_close(got["adapters"][name], expected, rtol=0, atol=TOLERANCE,
                                       msg=f"{layout}: {name}")
        if layout.startswith("d2"):  # losses are each rank's half; the norm is the whole's
            for step in got["stats"]:
                step.pop("loss")
        assert_same_statistics(got["stats"], reference["stats"], TOLERANCE)
        assert all(step["grad_norm"] > MAX_GRAD_NORM for step in reference["stats"])
        # The optimizer steps the adapters only: on every rank (torch), sharded over the
        # data-parallel ranks (megatron's distributed optimizer).
        if layout == "d2_megatron":
            assert got["optimizer_numel"] < got["adapter_numel"]
        else:
            assert got["optimizer_numel"] == got["adapter_numel"]
    if layout == "d2_megatron":
        assert sum(r[layout]["optimizer_numel"] for r in ranks) == ranks[0][layout]["adapter_numel"]
