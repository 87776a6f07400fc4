"""LoRA roles inside the runtime: real `ModelWorker`s on 2 gloo ranks.

Two plans of the tiny default actor with adapters (rank 4), each trained one SFT step:
- frozen reference: actor_train d1 on rank 0, actor_gen and ref_inf d2 on both ranks;
- EMA reference: actor_train d1t2 (adapters sharded), actor_gen and ref_inf d2, and an EMA
  hook actor -> ref with eta 0.5.
Checked: the reference holds no weights of its own (its base parameters are the actor's
tensors; parameters held per rank, counted), `ref_inf` gives the base model's log-probs
without the adapter, a transfer moves the adapters only (a base weight changed on the owner
does not travel), EMA blends adapters only, the optimizer state is the adapters', a
checkpoint (PEFT format) restores the adapters, and every write into a layout's weights is
counted where it lands (`TorchEngine.weight_writes`, by which a vLLM engine knows its copy is
stale), on the rank whose generation replica shares its peer's tensors too.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from rank_processes import start_ranks

from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.config import BaseExperimentConfig
from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef, ParamReallocHook
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    DType,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    OptimizerConfig,
)
from realrl.api.lora import LoRAConfig
from realrl.launcher.defaults import fresh_default_model
from realrl.models.checkpoint import load_pretrained
from realrl.models.tensor_parallel import unshard_state_dicts
from realrl.workers.model_worker import ModelWorker
from realrl.workers.realloc import ProcessGroups
from realrl.workers.run_plan import RunPlan
from realrl.workers.wire import Message

WORLD = 2
LORA = LoRAConfig(rank=4)
SFT_KEYS = ("packed_input_ids", "prompt_mask")
LAYOUTS = {
    "frozen_ref": {"actor_train": ([0], "d1"), "actor_gen": ([0, 1], "d2"),
                   "ref_inf": ([0, 1], "d2")},
    "ema_ref": {"actor_train": ([0, 1], "d1t2"), "actor_gen": ([0, 1], "d2"),
                "ref_inf": ([0, 1], "d2")},
}


def make_plan(model_path: str, case: str) -> RunPlan:
    optimizer = OptimizerConfig(lr=1e-2)
    actor = ModelRoleConfig(path=model_path, dtype=DType.float32, optimizer=optimizer, lora=LORA)
    ema = case == "ema_ref"
    ref = ModelRoleConfig(path=model_path, dtype=DType.float32, lora=LORA if ema else LoRAConfig())
    hooks = [ParamReallocHook("actor", "ref", 0.5)] if ema else []
    mfcs = [
        MFCDef("actor_gen", "actor", "generate", "ppo_actor", None, ("p",), ("x",)),
        MFCDef("ref_inf", "ref", "inference", "reference", None, ("packed_input_ids",),
               ("packed_ref_logprobs",)),
        MFCDef("actor_train", "actor", "train_step", "sft", None, SFT_KEYS, (),
               post_hooks=hooks),
    ]
    return RunPlan(
        base=BaseExperimentConfig(n_devices_per_node=WORLD, total_train_steps=2),
        dataset=DatasetConfig(), dataset_kind=DatasetKind.sft,
        models={"actor": ModelSpec("actor", ModelKind.lm, actor, True),
                "ref": ModelSpec("ref", ModelKind.lm, ref, shares_base_with="actor")},
        mfcs=mfcs,
        allocations={name: MFCAllocation(name, DeviceMesh(1, WORLD, tuple(ranks)),
                                         ParallelStrategy.parse(strategy))
                     for name, (ranks, strategy) in LAYOUTS[case].items()},
    )


def make_batch(vocab_size: int) -> SequenceSample:
    lengths = [7, 12, 5, 9]
    tokens = torch.randint(2, vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(3))
    prompt_mask = torch.cat([torch.arange(n) < 3 for n in lengths])
    return SequenceSample.from_default(ids=[f"s{i}" for i in range(len(lengths))], seqlens=lengths,
                                       data={"packed_input_ids": tokens, "prompt_mask": prompt_mask})


def mfc_message(name: str, part: SequenceSample) -> Message:
    meta, tensors = part.to_wire()
    return Message("mfc", {"mfc": name, "data": meta}, tensors)


def transfer(worker, source, target, eta: float) -> None:
    header = {"source": dataclasses.asdict(source), "target": dataclasses.asdict(target),
              "eta": eta}
    worker.handle(Message("transfer", header)).raise_if_error()
    dist.barrier()  # replicas sharing one copy: its writer may finish after this rank


def named(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def memory(worker) -> dict:
    """Parameter bytes on this rank: held (unique tensors) and each hosted role's."""
    seen, held, per_role = set(), 0, {}
    for layout, hosted in worker.models.items():
        for parameter in hosted.engine.module.parameters():
            nbytes = parameter.numel() * parameter.element_size()
            per_role[layout.role] = per_role.get(layout.role, 0) + nbytes
            if parameter.data_ptr() not in seen:
                seen.add(parameter.data_ptr())
                held += nbytes
    return {"held": held, "per_role": per_role}


def weight_writes(worker, layouts: dict) -> dict[str, int]:
    """Each hosted layout's count of writes into its weights (`TorchEngine.weight_writes`,
    what a vLLM engine compares to know its copy is stale)."""
    return {name: worker.models[layout].engine.weight_writes
            for name, layout in layouts.items() if layout in worker.models}


def run_case(rank: int, model_path: str, case: str) -> dict:
    plan = make_plan(model_path, case)
    worker = ModelWorker(rank, plan, ProcessGroups.create(plan))
    owner, gen = plan.owner_layout("actor"), plan.layout_of("actor_gen")
    ref = plan.owner_layout("ref")
    layouts = {"owner": owner, "gen": gen, "ref": ref}
    result = {"memory": memory(worker), "writes": [weight_writes(worker, layouts)],
              "gen_shares": worker.models[gen].engine.shared_weights is not None}
    actor_pointers = {p.data_ptr() for layout, hosted in worker.models.items()
                      if layout.role == "actor" for p in hosted.engine.module.parameters()}
    result["ref_base_is_actors"] = all(
        p.data_ptr() in actor_pointers
        for n, p in worker.models[ref].engine.module.named_parameters() if "_lora." not in n)
    batch = make_batch(worker.models[gen].engine.module.config.vocab_size)
    result["ref_before"] = named(worker.models[ref].engine)
    if rank in owner.ranks:
        coords = plan.allocations["actor_train"].coordinates_of(rank)
        data_parallel = ParallelStrategy.parse(owner.strategy).data
        part = batch.split_data_parallel(data_parallel)[0][coords.dp]
        worker.handle(mfc_message("actor_train", part)).raise_if_error()
        engine = worker.models[owner].engine
        result["optimizer_tensors"] = len(engine.optimizer.state)
        result["owner"] = named(engine)
        result["tp"] = engine.parallel.tp_rank
        with torch.no_grad():  # a base weight changed on the owner must not travel
            engine.module.final_norm.weight.add_(1.0)
    result["writes"].append(weight_writes(worker, layouts))
    transfer(worker, owner, gen, 1.0)
    result["writes"].append(weight_writes(worker, layouts))
    result["gen"] = named(worker.models[gen].engine)
    if rank in owner.ranks:  # back as it was (the reference may compute with these tensors)
        with torch.no_grad():
            worker.models[owner].engine.module.final_norm.weight.sub_(1.0)
    if case == "ema_ref":
        transfer(worker, owner, ref, 0.5)
    result["writes"].append(weight_writes(worker, layouts))
    result["ref_after"] = named(worker.models[ref].engine)
    part = batch.split_data_parallel(2)[0][rank]
    reply = worker.handle(mfc_message("ref_inf", part)).raise_if_error()
    output = SequenceSample.from_wire(reply.header["data"], reply.tensors)
    result["ref_logprobs"] = output.data["packed_ref_logprobs"]
    result["part"] = (part.data["packed_input_ids"], part.seqlens_of("packed_input_ids"))
    checkpoint = os.path.join(os.path.dirname(model_path), f"checkpoint-{case}")
    worker.handle(Message("save", {"directory": checkpoint})).raise_if_error()
    dist.barrier()
    if rank in owner.ranks:
        with torch.no_grad():
            for name, parameter in worker.models[owner].engine.module.named_parameters():
                if "_lora." in name:
                    parameter.zero_()
    worker.handle(Message("load", {"directory": checkpoint})).raise_if_error()
    result["writes"].append(weight_writes(worker, layouts))
    if rank in owner.ranks:
        result["owner_loaded"] = named(worker.models[owner].engine)
    return result


def run_worker(rank: int, port: int, model_path: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    results = {case: run_case(rank, model_path, case) for case in LAYOUTS}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def adapters(state: dict) -> dict:
    return {name: tensor for name, tensor in state.items() if "_lora." in name}


def base(state: dict) -> dict:
    return {name: tensor for name, tensor in state.items() if "_lora." not in name}


def logprobs_of(model, part: tuple[torch.Tensor, list[int]]) -> torch.Tensor:
    ids, lengths = part
    cu_seqlens = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    with torch.no_grad():
        return model.shifted_logprobs(model(ids, cu_seqlens, apply_lm_head=False), ids, cu_seqlens)


@pytest.mark.slow
def test_lora_roles_share_the_base_and_move_only_adapters(tmp_path):
    from realrl.api.ports import free_port
    from realrl.models.lora import add_adapters

    model_path = str(fresh_default_model(tmp_path / "model"))
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(run_worker, (free_port(), model_path, str(tmp_path)), WORLD)
    results = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)}
    checkpoint_model = load_pretrained(model_path)
    config, checkpoint_base = checkpoint_model.config, checkpoint_model.state_dict()
    adapter_tensors = 4 * 7 * 2  # layers x projections x (A, B)

    for case in LAYOUTS:
        per_rank = {rank: results[rank][case] for rank in range(WORLD)}
        for rank, result in per_rank.items():
            # Every write into a layout's weights is counted where it lands, on every rank
            # (the optimizer step on the owner's, a transfer on its target's, a checkpoint
            # load on all), a rank whose replica shares its peer's tensors included.
            start, stepped, moved, blended, loaded = result["writes"]
            grew = {name: [after[name] - before[name] for before, after in
                           ((start, stepped), (stepped, moved), (moved, blended),
                            (blended, loaded))]
                    for name in start}
            assert grew["gen"] == [0, 1, 0, 1], (case, rank, grew)
            assert result["gen_shares"], (case, rank)  # the replicas share one copy
            ema = 1 if case == "ema_ref" else 0
            assert grew["ref"] == [0, 0, ema, 1], (case, rank, grew)
            if "owner" in grew:
                assert grew["owner"] == [1, 0, 0, 1], (case, rank, grew)
        owners = [r for r in per_rank.values() if "owner" in r]
        full_owner = unshard_state_dicts([r["owner"] for r in sorted(owners, key=lambda r: r["tp"])],
                                         config)
        trained = adapters(full_owner)
        assert len(trained) == adapter_tensors
        assert any(t.abs().max() > 0 for n, t in trained.items() if ".lora_B." in n)
        for rank, result in per_rank.items():
            # No copy: the reference's base parameters are the actor's tensors, and the rank
            # holds no more parameter bytes than its actor layouts (plus an EMA adapter).
            assert result["ref_base_is_actors"], (case, rank)
            ref_adapter_bytes = sum(t.numel() * 4 for t in adapters(result["ref_before"]).values())
            held = result["memory"]["held"]
            assert held == result["memory"]["per_role"]["actor"] + ref_adapter_bytes, (case, rank)
            assert result["memory"]["per_role"]["ref"] >= 4 * sum(
                t.numel() for t in checkpoint_base.values())
            # Only the adapters moved: the gen layout has the owner's adapters and the
            # checkpoint's base, though the owner's final norm was changed after training.
            for name, tensor in trained.items():
                torch.testing.assert_close(result["gen"][name], tensor, rtol=0, atol=0)
            for name, tensor in checkpoint_base.items():
                assert torch.equal(result["gen"][name], tensor), (case, name)
                assert torch.equal(result["ref_after"][name], tensor), (case, name)
        for owner in owners:
            assert owner["optimizer_tensors"] == adapter_tensors  # AdamW state: adapters only
            for name, tensor in adapters(owner["owner"]).items():  # the checkpoint restores them
                assert torch.equal(owner["owner_loaded"][name], tensor), (case, name)
        actor_dir = tmp_path / f"checkpoint-{case}" / "actor"
        assert (actor_dir / "adapter_model.safetensors").is_file()
        assert not (actor_dir / "model.safetensors").exists()
        adapted_actor = add_adapters(load_pretrained(model_path), LORA, seed=0)
        adapted_actor.load_state_dict({**checkpoint_base, **trained})
        for result in per_rank.values():
            got = result["ref_logprobs"]
            if case == "frozen_ref":  # the reference is the base, without the adapter
                assert result["ref_after"].keys() == checkpoint_base.keys()
                expected = logprobs_of(checkpoint_model, result["part"])
            else:  # EMA blended the actor's adapter into the reference's own, and only that
                before = adapters(result["ref_before"])
                for name, tensor in adapters(result["ref_after"]).items():
                    torch.testing.assert_close(tensor, 0.5 * trained[name] + 0.5 * before[name],
                                               rtol=0, atol=1e-7)
                reference = add_adapters(load_pretrained(model_path), LORA, seed=0)
                reference.load_state_dict(result["ref_after"])
                expected = logprobs_of(reference, result["part"])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            assert (logprobs_of(adapted_actor, result["part"]) - got).abs().max() > 1e-3
    ema_files = sorted(p.name for p in (tmp_path / "checkpoint-ema_ref").glob("*/*"))
    assert "optimizer.tp0of2.pt" in ema_files and "optimizer.tp1of2.pt" in ema_files
    assert (tmp_path / "checkpoint-ema_ref" / "ref" / "adapter_config.json").is_file()
