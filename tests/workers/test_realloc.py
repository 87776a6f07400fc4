"""Parameter reallocation and the EMA hook across layouts, with real gloo processes.

A layout is a list of ranks (data parallel over them) or (ranks, "dNtM") for tensor-parallel
layouts; every rank saves its shard and the test reassembles each replica's full parameters.
"""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rank_processes import start_ranks

from realrl.api import environment
from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.config import BaseExperimentConfig
from realrl.api.dfg import MFCDef, ParamReallocHook
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    DType,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
)
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.launcher.defaults import fresh_default_model
from realrl.models.checkpoint import load_pretrained
from realrl.models.tensor_parallel import unshard_state_dicts
from realrl.workers.model_loading import shard_module
from realrl.workers.realloc import (
    ProcessGroups,
    share_replica_weights,
    transfer_group_ranks,
    transfer_parameters,
    transfer_ranks,
)
from realrl.workers.run_plan import LayoutKey, RunPlan

# Layouts whose replicas shared one copy of their weights on this rank.
SHARED_LAYOUTS: set[LayoutKey] = set()


def ranks_and_strategy(layout) -> tuple[list[int], ParallelStrategy]:
    if isinstance(layout, tuple):
        return list(layout[0]), ParallelStrategy.parse(layout[1])
    return list(layout), ParallelStrategy(data=len(layout))


def world_size(layouts) -> int:
    return 1 + max(max(ranks_and_strategy(layout)[0]) for layout in layouts.values())


def make_plan(model_path, layouts, eta, world):
    """actor_train on layouts['train'], actor_gen on layouts['gen'], ref_inf on layouts['ref']."""

    def allocation(name, layout):
        ranks, strategy = ranks_and_strategy(layout)
        return MFCAllocation(name, DeviceMesh(1, world, tuple(ranks)), strategy)

    config = ModelRoleConfig(path=str(model_path), dtype=DType.float32)
    mfcs = [
        MFCDef("actor_gen", "actor", "generate", "ppo_actor", None, ("p",), ("x",)),
        MFCDef("ref_inf", "ref", "inference", "reference", None, ("x",), ("r",)),
        MFCDef(
            "actor_train",
            "actor",
            "train_step",
            "ppo_actor",
            None,
            ("x", "r"),
            post_hooks=[ParamReallocHook("actor", "ref", eta)],
        ),
    ]
    return RunPlan(
        base=BaseExperimentConfig(n_devices_per_node=world),
        dataset=DatasetConfig(),
        dataset_kind=DatasetKind.prompt,
        models={
            "actor": ModelSpec("actor", ModelKind.lm, config, True),
            "ref": ModelSpec("ref", ModelKind.lm, config),
        },
        mfcs=mfcs,
        allocations={
            "actor_gen": allocation("actor_gen", layouts["gen"]),
            "ref_inf": allocation("ref_inf", layouts["ref"]),
            "actor_train": allocation("actor_train", layouts["train"]),
        },
    )


def build_engine(model_path, plan, layout, rank, groups, trained: bool) -> TorchEngine:
    """The layout's shard of the checkpoint, or of the "trained" weights (checkpoint + noise)."""
    allocation = plan.allocation_of_layout(layout)
    coordinates = allocation.coordinates_of(rank)
    parallel = ParallelContext(
        dp_rank=coordinates.dp,
        dp_size=allocation.strategy.data,
        tp_rank=coordinates.tp,
        tp_size=allocation.strategy.tensor,
        tp_group=groups.tensor_group(layout, rank),
        dp_group=groups.data_group(layout, rank),
    )
    full = load_pretrained(model_path)
    if trained:  # move the owner's weights away from the checkpoint
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for parameter in full.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    engine = TorchEngine(shard_module(full, parallel), None, parallel)
    if share_replica_weights(engine, layout, private=trained):  # as a model worker does
        SHARED_LAYOUTS.add(layout)
    return engine


def run_transfers(rank, world, model_path, layouts, etas, result_dir):
    plan = make_plan(model_path, layouts, etas[0], world)
    groups = ProcessGroups.create(plan)
    owner, ref_owner = plan.owner_layout("actor"), plan.owner_layout("ref")
    engines = {
        layout: build_engine(model_path, plan, layout, rank, groups, layout == owner)
        for layout in plan.layouts()
        if rank in layout.ranks
    }
    gen_layout = plan.layout_of("actor_gen")
    transfers = [(owner, gen_layout, 1.0, "gen")] + [
        (owner, ref_owner, eta, f"ema{eta}") for eta in etas
    ]
    for source, target, weight, label in transfers:
        if target == ref_owner and ref_owner in engines:  # each eta starts from the checkpoint
            engines[ref_owner] = build_engine(model_path, plan, ref_owner, rank, groups, False)
        if rank in transfer_ranks(source, target):
            transfer_parameters(
                engines.get(source), engines.get(target), source, target, rank, weight, groups, plan
            )
        dist.barrier()
        if target in engines:
            parallel = engines[target].parallel
            state = {n: p.detach().clone() for n, p in engines[target].module.named_parameters()}
            torch.save(
                {"dp": parallel.dp_rank, "tp": parallel.tp_rank, "state": state},
                os.path.join(result_dir, f"{label}-rank{rank}.pt"),
            )


def worker(rank, world, port, model_path, cases, etas, result_dir, shared_memory):
    from realrl.workers import realloc

    torch.set_num_threads(1)
    os.environ[environment.SHARED_MEMORY] = "1" if shared_memory else "0"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    for case_index, layouts in enumerate(cases):
        case_dir = os.path.join(result_dir, f"case{case_index}")
        os.makedirs(case_dir, exist_ok=True)
        run_transfers(rank, world, model_path, layouts, etas, case_dir)
    # Which broadcasts went through shared memory (True) or gloo (False) on this rank, and
    # which layouts shared their weights.
    paths = [buffer is not None for buffer in realloc._SHARED_BUFFERS.values()]
    torch.save(paths, os.path.join(result_dir, f"broadcast-paths-rank{rank}.pt"))
    shared = sorted((layout.ranks, layout.strategy) for layout in SHARED_LAYOUTS)
    torch.save(shared, os.path.join(result_dir, f"shared-layouts-rank{rank}.pt"))
    dist.destroy_process_group()


LAYOUT_CASES = {
    "train d1 on rank 0, gen d3 on all, ref on rank 2": {
        "train": [0],
        "gen": [0, 1, 2],
        "ref": [2],
    },
    "train d2, gen d1 on a sub-mesh outside it": {"train": [0, 1], "gen": [2], "ref": [0]},
    "train d3, gen d2 on a sub-mesh, ref on rank 1": {
        "train": [0, 1, 2],
        "gen": [1, 2],
        "ref": [1],
    },
}


TENSOR_PARALLEL_CASES = {
    "train d1t2 -> gen d2t1 on the same ranks, ref t1 elsewhere": {
        "train": ([0, 1], "d1t2"),
        "gen": ([0, 1], "d2t1"),
        "ref": [2],
    },
    "train d2t1 -> gen d1t2 on the same ranks, ref t2 elsewhere": {
        "train": [0, 1],
        "gen": ([0, 1], "d1t2"),
        "ref": ([2, 3], "d1t2"),
    },
    "train d1t2 -> gen d1 on a sub-mesh outside it, ref t2 -> t2 on other ranks": {
        "train": ([0, 1], "d1t2"),
        "gen": [2],
        "ref": ([2, 3], "d1t2"),
    },
    "train d2t2 -> gen d2t1 on half of it, ref t2 blended in place": {
        "train": ([0, 1, 2, 3], "d2t2"),
        "gen": [2, 3],
        "ref": ([0, 1], "d1t2"),
    },
    "train d1t2 -> gen t2 shifted by one rank, ref d2t1 on the train ranks": {
        "train": ([0, 1], "d1t2"),
        "gen": ([1, 2], "d1t2"),
        "ref": [0, 1],
    },
}


ETAS = (1.0, 0.5, 0.01)


def run_cases(tmp_path, cases: list[dict], shared_memory: bool = True) -> tuple[dict, dict]:
    """Runs every case in one set of processes; returns (initial, trained) full parameters.
    Broadcasts go through shared memory or, with `shared_memory=False`, through gloo."""
    from realrl.api.ports import free_port

    model_path = fresh_default_model(tmp_path / "model")
    world = max(world_size(layouts) for layouts in cases)
    start_ranks(worker, (world, free_port(), str(model_path), cases, ETAS, str(tmp_path), shared_memory), world)
    paths = [p for r in range(world) for p in torch.load(tmp_path / f"broadcast-paths-rank{r}.pt")]
    assert paths == [True] * len(paths) if shared_memory else paths == []
    assert not shared_memory or paths  # some case broadcasts
    # Frozen data-parallel layouts without tensor parallelism share one copy of their weights;
    # a transfer into one is written by one rank, so a copy that was not shared fails the case.
    saved = [torch.load(tmp_path / f"shared-layouts-rank{r}.pt") for r in range(world)]
    shared = {(ranks, ParallelStrategy.parse(strategy)) for s in saved for ranks, strategy in s}
    expected = set()
    for layouts in cases:
        for role in ("gen", "ref"):
            ranks, strategy = ranks_and_strategy(layouts[role])
            if layouts[role] != layouts["train"] and strategy.data > 1 and strategy.tensor == 1:
                expected.add((tuple(ranks), strategy))
    assert shared == (expected if shared_memory else set())
    initial = {n: p.detach() for n, p in load_pretrained(model_path).named_parameters()}
    trained = {}
    generator = torch.Generator().manual_seed(7)
    for name, parameter in initial.items():
        trained[name] = parameter + torch.randn(parameter.shape, generator=generator)
    return initial, trained


def full_replicas(case_dir, label: str, config) -> dict[int, dict[str, torch.Tensor]]:
    """Each data-parallel replica's full parameters, from its tp ranks' saved shards."""
    saved = [torch.load(path) for path in case_dir.glob(f"{label}-rank*.pt")]
    replicas = {}
    for dp in sorted({entry["dp"] for entry in saved}):
        shards = sorted((e for e in saved if e["dp"] == dp), key=lambda e: e["tp"])
        replicas[dp] = unshard_state_dicts([shard["state"] for shard in shards], config)
    return replicas


def check_case(case_dir, layouts, initial, trained, config, case_name) -> None:
    gen_ranks, gen_strategy = ranks_and_strategy(layouts["gen"])
    assert len(list(case_dir.glob("gen-rank*.pt"))) == len(gen_ranks), case_name
    generation = full_replicas(case_dir, "gen", config)
    assert len(generation) == gen_strategy.data, case_name
    for dp, parameters in generation.items():  # every replica equals the trained weights
        for key, value in parameters.items():
            assert torch.equal(value, trained[key]), (case_name, dp, key)
    ref_ranks, ref_strategy = ranks_and_strategy(layouts["ref"])
    for eta in ETAS:
        assert len(list(case_dir.glob(f"ema{eta}-rank*.pt"))) == len(ref_ranks), case_name
        references = full_replicas(case_dir, f"ema{eta}", config)
        assert len(references) == ref_strategy.data, case_name
        for dp, parameters in references.items():  # ref = eta * actor + (1 - eta) * ref
            for key, value in parameters.items():
                expected = eta * trained[key] + (1 - eta) * initial[key]
                torch.testing.assert_close(
                    value, expected, rtol=0, atol=1e-6, msg=f"{case_name} eta={eta} dp={dp} {key}"
                )


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "gloo"])
def test_reallocation_and_ema_match_the_formula_across_data_parallel_layouts(
    tmp_path, shared_memory
):
    """Every data-parallel case runs in one set of 3 processes (spawning costs seconds)."""
    initial, trained = run_cases(tmp_path, list(LAYOUT_CASES.values()), shared_memory)
    config = load_pretrained(tmp_path / "model").config
    for index, (name, layouts) in enumerate(LAYOUT_CASES.items()):
        check_case(tmp_path / f"case{index}", layouts, initial, trained, config, name)


def test_reallocation_and_ema_between_tensor_and_data_parallel_layouts(tmp_path):
    """Every tensor-parallel case runs in one set of 4 processes (spawning costs seconds)."""
    cases = list(TENSOR_PARALLEL_CASES.values())
    initial, trained = run_cases(tmp_path, cases)
    config = load_pretrained(tmp_path / "model").config
    for index, (name, layouts) in enumerate(TENSOR_PARALLEL_CASES.items()):
        check_case(tmp_path / f"case{index}", layouts, initial, trained, config, name)


def test_transfer_ranks_name_gatherers_senders_receivers_and_local_blenders():
    def layout(ranks, strategy):
        return LayoutKey("actor", tuple(ranks), strategy)

    d2t2 = layout([0, 1, 2, 3], "d2t2p1")
    # Same slicing on ranks 0-1: blended locally, nothing gathered or sent.
    assert transfer_group_ranks(d2t2, layout([0, 1], "d1t2p1")) == []
    assert transfer_ranks(d2t2, layout([0, 1], "d1t2p1")) == [0, 1]
    # t2 -> d2t1 on ranks 2-3: rank 0 gathers from rank 1 and broadcasts to 2 and 3.
    assert transfer_group_ranks(d2t2, layout([2, 3], "d2t1p1")) == [0, 2, 3]
    assert transfer_ranks(d2t2, layout([2, 3], "d2t1p1")) == [0, 1, 2, 3]
    # t1 sender blending into its own t2 shard; rank 1 receives.
    assert transfer_ranks(layout([0], "d1t1p1"), layout([0, 1], "d1t2p1")) == [0, 1]
    assert transfer_group_ranks(layout([0], "d1t1p1"), layout([0, 1], "d1t2p1")) == [0, 1]


def test_broadcast_buckets_reuse_one_flat_buffer_that_grows_to_the_largest():
    # A fresh tensor per bucket paid first-touch page faults on every transfer (96 vs 39 ms
    # for 63 MB); every bucket must land in the same storage, grown only when one is larger.
    from realrl.workers import realloc

    realloc._FLAT_BUFFERS.clear()
    small = realloc._flat_buffer(10, torch.float32, "cpu")
    large = realloc._flat_buffer(100, torch.float32, "cpu")
    again = realloc._flat_buffer(60, torch.float32, "cpu")
    other_dtype = realloc._flat_buffer(60, torch.bfloat16, "cpu")
    assert (small.numel(), large.numel(), again.numel()) == (10, 100, 60)
    assert again.data_ptr() == large.data_ptr() != small.data_ptr()
    assert other_dtype.dtype == torch.bfloat16 and other_dtype.data_ptr() != large.data_ptr()


def posted_send_worker(rank, port, model_path, result_dir, shared_memory, one_bucket):
    """Rank 0 owns the trained actor and only starts its last broadcast; rank 1 receives. With
    `one_bucket`, after a first transfer together (which connects the shared memory), a split
    transfer (`Master.refresh`): rank 1 starts its part only after rank 0 has returned from its
    own and changed its weights. With several buckets only the last one may be in flight."""
    from realrl.workers import realloc

    torch.set_num_threads(1)
    os.environ[environment.SHARED_MEMORY] = "1" if shared_memory else "0"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if not one_bucket:
        realloc.BUCKET_BYTES = 64 * 1024
    plan = make_plan(model_path, {"train": [0], "gen": [1], "ref": [0]}, 1.0, 2)
    groups = ProcessGroups.create(plan)
    owner, gen = plan.owner_layout("actor"), plan.layout_of("actor_gen")
    engine = build_engine(model_path, plan, owner if rank == 0 else gen, rank, groups, rank == 0)
    sent = Path(result_dir) / "sent"
    if one_bucket:
        transfer_parameters(engine if rank == 0 else None, engine if rank == 1 else None,
                            owner, gen, rank, 1.0, groups, plan)
    if rank == 1 and one_bucket:
        deadline = time.monotonic() + 60
        while not sent.exists():
            assert time.monotonic() < deadline, "the sender never returned on its own"
            time.sleep(0.01)
    pending: list = []
    alone = transfer_parameters(engine if rank == 0 else None, engine if rank == 1 else None,
                                owner, gen, rank, 1.0, groups, plan,
                                pending=pending if rank == 0 else None, split=one_bucket)
    if rank == 0:
        assert alone is one_bucket
        if not shared_memory:
            assert len(pending) == 1  # the broadcast
        elif one_bucket:
            assert pending == []  # nothing in flight: the master orders the two sides
        else:
            assert len(pending) == 2  # the publishing barrier and the receivers' release
        with torch.no_grad():  # the next train step may change the weights at once
            for parameter in engine.module.parameters():
                parameter.add_(1000.0)
        sent.touch()
        for handle in pending:
            handle.wait()
    else:
        assert alone is None
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.save(state, os.path.join(result_dir, "received.pt"))
    assert [b is not None for b in realloc._SHARED_BUFFERS.values()] == [True] * shared_memory
    dist.destroy_process_group()


@pytest.mark.parametrize("one_bucket", [True, False], ids=["one-bucket", "buckets"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "gloo"])
def test_a_posted_send_returns_before_the_receiver_and_sends_the_weights_it_had(
    tmp_path, shared_memory, one_bucket
):
    from realrl.api.ports import free_port

    model_path = fresh_default_model(tmp_path / "model")
    start_ranks(posted_send_worker,
                (free_port(), str(model_path), str(tmp_path), shared_memory, one_bucket), 2)
    generator = torch.Generator().manual_seed(7)
    received = torch.load(tmp_path / "received.pt")
    for name, parameter in load_pretrained(model_path).named_parameters():
        trained = parameter.detach() + torch.randn(parameter.shape, generator=generator)
        assert torch.equal(received[name], trained), name
