"""Reallocation and the EMA hook out of a role trained by the megatron optimizer backend.

Real `ModelWorker`s on 4 gloo ranks host a PPO-like plan: the actor trained with the SFT
interface on megatron-core's DDP + DistributedOptimizer (installed under the test-only device
shim in place of the torch backend the CPU worker built, as in `test_megatron_runtime`;
`replace_with_megatron_backend`), a generation layout of the actor, and a frozen reference
that the actor's training MFC blends into (`ParamReallocHook("actor", "ref", eta)`). Each
round trains one step, then sends the workers the two "transfer" requests the master would.
Megatron's parameters live in its DDP parameter buffer, and a bf16 module's updated weights
are its fp32 master shards rounded and all-gathered over the data-parallel group: these tests
check that what reallocation and EMA read is that live, complete, trained state.

Cases (one spawn runs both):
- fp32: train d2t2 -> gen d4t1 (gathered over tp, broadcast, each replica takes it all) and
  ref d1t2 on ranks 2, 3 (blended locally from replica 1's own shards).
- bf16: train d2t1 on ranks 0, 1 -> gen d1t2 on ranks 2, 3 (broadcast, sliced by the
  receivers) and ref d2t1 on ranks 0, 1 (blended locally, in its fp32 EMA masters).
Checked, over two rounds: each layout of the actor holds the trained full weights bit for bit
(in bf16 the module's weights are its masters rounded); the reference equals
`eta * actor + (1 - eta) * ref` computed here (fp32 within 1e-6; bf16 masters within 1e-6 and
the weights those rounded).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from megatron_cpu_shim import cuda_to_cpu
from test_megatron_runtime import install_megatron_backend, spawn_world
from test_tensor_parallel_runtime import (
    WORLD,
    full_parameters,
    make_batch,
    make_plan,
    shard_state,
    train_message,
)

from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.dfg import MFCDef, ParamReallocHook
from realrl.api.experiment import DType, ModelKind, ModelSpec
from realrl.models.checkpoint import load_pretrained
from realrl.workers.model_worker import ModelWorker
from realrl.workers.realloc import ProcessGroups, transfer_ranks
from realrl.workers.run_plan import LayoutKey, RunPlan
from realrl.workers.wire import Message

ETA = 0.5
ROUNDS = 2
CASES = {
    "fp32": {"dtype": DType.float32, "train": ([0, 1, 2, 3], "d2t2"),
             "gen": ([0, 1, 2, 3], "d4t1"), "ref": ([2, 3], "d1t2")},
    "bf16": {"dtype": DType.bfloat16, "train": ([0, 1], "d2t1"),
             "gen": ([2, 3], "d1t2"), "ref": ([0, 1], "d2t1")},
}


def realloc_plan(model_path: str, case: dict) -> RunPlan:
    """`test_tensor_parallel_runtime.make_plan`'s actor (SFT, clipped) at the case's dtype and
    train layout, plus actor_gen and a frozen ref that sft_train's post-hook blends into."""
    base = make_plan(model_path)
    config = dataclasses.replace(base.models["actor"].config, dtype=case["dtype"])
    train = dataclasses.replace(base.mfcs[0], post_hooks=[ParamReallocHook("actor", "ref", ETA)])
    mfcs = [
        MFCDef("actor_gen", "actor", "generate", "sft", None, ("p",), ("x",)),
        MFCDef("ref_inf", "ref", "inference", "sft", None, ("x",), ("r",)),
        train,
    ]

    def allocation(name: str, layout: tuple[list[int], str]) -> MFCAllocation:
        mesh = DeviceMesh(1, WORLD, tuple(layout[0]))
        return MFCAllocation(name, mesh, ParallelStrategy.parse(layout[1]))

    return dataclasses.replace(
        base,
        models={"actor": ModelSpec("actor", ModelKind.lm, config, True),
                "ref": ModelSpec("ref", ModelKind.lm, config)},
        mfcs=mfcs,
        allocations={"actor_gen": allocation("actor_gen", case["gen"]),
                     "ref_inf": allocation("ref_inf", case["ref"]),
                     "sft_train": allocation("sft_train", case["train"])},
    )


def replace_with_megatron_backend(worker: ModelWorker, engine) -> None:
    """`install_megatron_backend`, after removing the gradient hooks of the torch backend the
    CPU worker built: a bf16 module's fp32 masters take (and clear) each bf16 gradient, which
    megatron's own hooks need. On a CUDA worker megatron is the only backend ever built."""
    masters = engine.backend.master_weights
    for hook in masters.hooks if masters is not None else ():
        hook.remove()
    install_megatron_backend(worker, engine)


def transfer_message(source: LayoutKey, target: LayoutKey, eta: float) -> Message:
    """The request `realrl.workers.master.Master._transfer` sends every rank taking part."""
    header = {"source": vars(source) | {"ranks": list(source.ranks)},
              "target": vars(target) | {"ranks": list(target.ranks)}, "eta": eta}
    return Message("transfer", header)


def masters_rounded(engine) -> bool | None:
    """Whether each bf16 parameter's slice this rank's DistributedOptimizer owns equals its
    fp32 master shard rounded (None for fp32 modules: their masters are the weights)."""
    distributed = engine.backend.distributed
    parameters = [p for group in distributed.model_float16_groups for p in group]
    if not parameters:
        return None
    for parameter in parameters:
        owned = distributed._get_model_param_range_map(parameter)["param"]
        weights = parameter.detach().view(-1)[owned.start:owned.end]
        if not torch.equal(weights, parameter.main_param.to(weights.dtype)):
            return False
    return True


def layout_state(worker: ModelWorker, plan: RunPlan, layout: LayoutKey) -> dict:
    engine = worker.models[layout].engine
    coordinates = plan.allocation_of_layout(layout).coordinates_of(worker.rank)
    return {"dp": coordinates.dp, "tp": coordinates.tp, "state": shard_state(engine),
            "ema_masters": {n: m.clone() for n, m in engine.ema_masters.items()}}


def run_case(rank: int, model_path: str, case: dict) -> dict:
    """Two rounds of train step, reallocation to actor_gen and EMA into ref on this rank."""
    plan = realloc_plan(model_path, case)
    worker = ModelWorker(rank, plan, ProcessGroups.create(plan))
    train, gen = plan.layout_of("sft_train"), plan.layout_of("actor_gen")
    ref = plan.owner_layout("ref")
    if rank in train.ranks:
        replace_with_megatron_backend(worker, worker.models[train].engine)
    batch = make_batch(load_pretrained(model_path).config.vocab_size)
    strategy = plan.allocations["sft_train"].strategy
    rounds = []
    for _ in range(ROUNDS):
        result = {}
        if rank in train.ranks:
            dp = plan.allocations["sft_train"].coordinates_of(rank).dp
            part = batch.split_data_parallel(strategy.data)[0][dp]
            worker.handle(train_message(part)).raise_if_error()
            result["actor"] = layout_state(worker, plan, train)
            result["masters_rounded"] = masters_rounded(worker.models[train].engine)
        if rank in ref.ranks:
            result["ref_before"] = layout_state(worker, plan, ref)
        for target, eta in ((gen, 1.0), (ref, ETA)):
            if rank in transfer_ranks(train, target):
                worker.handle(transfer_message(train, target, eta)).raise_if_error()
        dist.barrier()
        for label, layout in (("gen", gen), ("ref", ref)):
            if rank in layout.ranks:
                result[label] = layout_state(worker, plan, layout)
        rounds.append(result)
    return {"rounds": rounds}


def run_worker(rank: int, port: int, model_path: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    with cuda_to_cpu():
        from realrl.backends import megatron_optimizer

        megatron_optimizer.BUCKET_PARAMETERS = 50_000  # several buckets
        results = {name: run_case(rank, model_path, case) for name, case in CASES.items()}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    _, config, results = spawn_world(tmp_path_factory, "megatron_realloc", run_worker)
    return config, results


def replicas(results: dict, case: str, round_index: int, label: str, config,
             key: str = "state") -> list[dict[str, torch.Tensor]]:
    """Every data-parallel replica's full tensors (`key`: "state" or "ema_masters") of the
    layout saved as `label` ("actor", "gen", "ref_before", "ref") after round `round_index`."""
    shards = {}
    for rank, rank_result in results.items():
        saved = rank_result[case]["rounds"][round_index].get(label)
        if saved is not None:
            shards[rank] = {"dp": saved["dp"], "tp": saved["tp"], "values": saved[key]}
    dp_size = 1 + max(shard["dp"] for shard in shards.values())
    return [full_parameters(shards, "values", dp, config) for dp in range(dp_size)]


def trained_actor(results: dict, case: str, round_index: int, config) -> dict:
    """The actor's full weights after the round's step; every replica holds the same."""
    actor = replicas(results, case, round_index, "actor", config)
    for index, replica in enumerate(actor[1:], start=1):
        for name, expected in actor[0].items():  # each replica stepped its 1/d of the masters
            assert torch.equal(replica[name], expected), (
                f"{case} round {round_index}: actor replica {index} differs from replica 0 in "
                f"{name}: megatron's parameter all-gather has not completed the weights")
    return actor[0]


@pytest.mark.parametrize("case", CASES)
def test_reallocation_moves_the_megatron_trained_weights_exactly(run, case):
    config, results = run
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    previous = None
    for round_index in range(ROUNDS):
        trained = trained_actor(results, case, round_index, config)
        assert all(tensor.dtype == dtype for tensor in trained.values())
        if previous is not None:  # the step moved the weights: a stale copy would not match
            moved = [n for n in trained if not torch.equal(trained[n], previous[n])]
            assert set(moved) >= {n for n in trained if "norm" not in n}
        previous = trained
        for rank_result in results.values():  # bf16 weights are the fp32 masters rounded
            saved = rank_result[case]["rounds"][round_index]
            if "actor" in saved:
                assert saved["masters_rounded"] is (None if case == "fp32" else True)
        for index, replica in enumerate(replicas(results, case, round_index, "gen", config)):
            for name, expected in trained.items():
                assert replica[name].dtype == dtype
                assert torch.equal(replica[name], expected), (
                    f"{case} round {round_index}: gen replica {index}, {name}")


@pytest.mark.parametrize("case", CASES)
def test_ema_into_the_reference_follows_the_formula_from_megatron_trained_weights(run, case):
    config, results = run
    for round_index in range(ROUNDS):
        actor = trained_actor(results, case, round_index, config)
        before = replicas(results, case, round_index, "ref_before", config)
        after = replicas(results, case, round_index, "ref", config)
        if case == "bf16":  # blended in fp32 masters: the last round's, else the weights
            masters = replicas(results, case, round_index, "ref", config, "ema_masters")
            if round_index > 0:
                before = replicas(results, case, round_index - 1, "ref", config, "ema_masters")
        changed = 0
        for index, (start, blended) in enumerate(zip(before, after, strict=True)):
            for name, source in actor.items():
                expected = ETA * source.float() + (1 - ETA) * start[name].float()
                where = f"{case} round {round_index}: ref replica {index}, {name}"
                if case == "fp32":
                    torch.testing.assert_close(blended[name], expected, rtol=0, atol=1e-6,
                                               msg=where)
                else:
                    master = masters[index][name]
                    torch.testing.assert_close(master, expected, rtol=0, atol=1e-6, msg=where)
                    assert torch.equal(blended[name], master.to(torch.bfloat16)), where
                changed += int((blended[name].float() != start[name].float()).sum())
        assert changed > 0
