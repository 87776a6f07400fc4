"""Parameter reallocation and the EMA hook across layouts, with real gloo processes."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.config import BaseExperimentConfig
from realrl.api.dfg import MFCDef, ParamReallocHook
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
)
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.launcher.defaults import fresh_default_model
from realrl.models.checkpoint import load_pretrained
from realrl.workers.realloc import ProcessGroups, transfer_parameters, transfer_ranks
from realrl.workers.run_plan import RunPlan


def make_plan(model_path, layouts, eta):
    """actor_train on layouts['train'], actor_gen on layouts['gen'], ref_inf on layouts['ref']."""
    world = 3

    def allocation(name, ranks):
        mesh = DeviceMesh(1, world, tuple(ranks))
        return MFCAllocation(name, mesh, ParallelStrategy(data=len(ranks)))

    config = ModelRoleConfig(path=str(model_path))
    mfcs = [
        MFCDef("actor_gen", "actor", "generate", "ppo_actor", None, ("p",), ("x",)),
        MFCDef("ref_inf", "ref", "inference", "reference", None, ("x",), ("r",)),
        MFCDef("actor_train", "actor", "train_step", "ppo_actor", None, ("x", "r"),
               post_hooks=[ParamReallocHook("actor", "ref", eta)]),
    ]
    return RunPlan(
        base=BaseExperimentConfig(n_devices_per_node=world), dataset=DatasetConfig(),
        dataset_kind=DatasetKind.prompt,
        models={"actor": ModelSpec("actor", ModelKind.lm, config, True),
                "ref": ModelSpec("ref", ModelKind.lm, config)},
        mfcs=mfcs,
        allocations={"actor_gen": allocation("actor_gen", layouts["gen"]),
                     "ref_inf": allocation("ref_inf", layouts["ref"]),
                     "actor_train": allocation("actor_train", layouts["train"])},
    )


def worker(rank, world, port, model_path, layouts, etas, result_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    plan = make_plan(model_path, layouts, etas[0])
    groups = ProcessGroups.create(plan)
    engines = {}
    for layout in plan.layouts():
        if rank in layout.ranks:
            engines[layout] = TorchEngine(load_pretrained(model_path), None, ParallelContext())
    owner, ref_owner = plan.owner_layout("actor"), plan.owner_layout("ref")
    if owner in engines:  # "training": move the owner's weights away from the checkpoint
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for parameter in engines[owner].module.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    gen_layout = plan.layout_of("actor_gen")
    transfers = [(owner, gen_layout, 1.0, "gen")] + [(owner, ref_owner, eta, f"ema{eta}")
                                                     for eta in etas]
    for source, target, weight, label in transfers:
        if target == ref_owner and ref_owner in engines:  # each eta starts from the checkpoint
            engines[ref_owner] = TorchEngine(load_pretrained(model_path), None, ParallelContext())
        if rank in transfer_ranks(source, target):
            transfer_parameters(engines.get(source), engines.get(target), source, target, rank,
                                weight, groups, plan)
        dist.barrier()
        if target in engines:
            state = {n: p.detach().clone() for n, p in engines[target].module.named_parameters()}
            torch.save(state, os.path.join(result_dir, f"{label}-rank{rank}.pt"))
    dist.destroy_process_group()


LAYOUT_CASES = {
    "train d1 on rank 0, gen d3 on all, ref on rank 2": {"train": [0], "gen": [0, 1, 2],
                                                       "ref": [2]},
    "train d2, gen d1 on a sub-mesh outside it": {"train": [0, 1], "gen": [2], "ref": [0]},
    "train d3, gen d2 on a sub-mesh, ref on rank 1": {"train": [0, 1, 2], "gen": [1, 2],
                                                      "ref": [1]},
}


ETAS = (1.0, 0.5, 0.01)


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_reallocation_and_ema_match_the_formula_across_layouts(tmp_path, case):
    layouts = LAYOUT_CASES[case]
    model_path = fresh_default_model(tmp_path / "model")
    from realrl.launcher.run import free_port

    mp.start_processes(worker, args=(3, free_port(), str(model_path), layouts, ETAS,
                                     str(tmp_path)), nprocs=3, start_method="spawn")
    initial = {n: p.detach() for n, p in load_pretrained(model_path).named_parameters()}
    trained = {}
    generator = torch.Generator().manual_seed(7)
    for name, parameter in initial.items():
        trained[name] = parameter + torch.randn(parameter.shape, generator=generator)
    results = {path.name: torch.load(path) for path in tmp_path.glob("*.pt")}
    gen_files = [name for name in results if name.startswith("gen-")]
    assert len(gen_files) == len(layouts["gen"])
    for name in gen_files:  # every generation replica equals the trained weights exactly
        for key, value in results[name].items():
            assert torch.equal(value, trained[key]), (name, key)
    for eta in ETAS:
        ref_files = [name for name in results if name.startswith(f"ema{eta}-")]
        assert len(ref_files) == len(layouts["ref"])
        for name in ref_files:  # ref = eta * actor + (1 - eta) * ref
            for key, value in results[name].items():
                expected = eta * trained[key] + (1 - eta) * initial[key]
                torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
