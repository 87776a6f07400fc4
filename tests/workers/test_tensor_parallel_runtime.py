"""Tensor parallelism inside the runtime, with real gloo processes and a real `ModelWorker`.

Four ranks host the tiny default actor as d2t2 (tp groups [0, 1] and [2, 3]) on megatron-core's
layers and train it with the SFT interface (vocab-parallel log-probs); rank 0 also trains a
single-device (t1) copy on the whole batch. Checked: the full parameters equal the t1 ones,
replicated parameters are identical on every rank, the clipped gradient norm counts every
parameter once, a checkpoint holds the full HF weights and recovery is exact, and generation on
the tp shards equals t1.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from rank_processes import start_ranks

from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.config import BaseExperimentConfig
from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef, MicroBatchSpec
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    DType,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    OptimizerConfig,
)
from realrl.backends.torch_engine import ParallelContext
from realrl.interfaces.sft import SFTInterface
from realrl.launcher.defaults import fresh_default_model
from realrl.models.checkpoint import load_pretrained
from realrl.models.generation import generate
from realrl.models.sampling import GenerationConfig
from realrl.models.tensor_parallel import unshard_state_dicts
from realrl.workers.model_loading import load_engine
from realrl.workers.model_worker import ModelWorker
from realrl.workers.realloc import ProcessGroups
from realrl.workers.run_plan import RunPlan
from realrl.workers.wire import Message

WORLD = 4
MEGATRON_LAYERS = "megatron.core.tensor_parallel.layers"
MAX_GRAD_NORM = 0.05  # small enough that every step clips
SFT_KEYS = ("packed_input_ids", "prompt_mask")


def make_plan(model_path: str) -> RunPlan:
    # Adam eps 1e-4 keeps near-zero gradients (float noise between layouts) from becoming
    # full-size updates, as in the other data-parallel invariance tests.
    optimizer = OptimizerConfig(lr=1e-3, eps=1e-4, gradient_clipping=MAX_GRAD_NORM)
    config = ModelRoleConfig(path=model_path, dtype=DType.float32, optimizer=optimizer)
    mfc = MFCDef("sft_train", "actor", "train_step", "sft", None, SFT_KEYS, ())
    mesh = DeviceMesh(1, WORLD, tuple(range(WORLD)))
    return RunPlan(
        base=BaseExperimentConfig(n_devices_per_node=WORLD, total_train_steps=3),
        dataset=DatasetConfig(),
        dataset_kind=DatasetKind.sft,
        models={"actor": ModelSpec("actor", ModelKind.lm, config, True)},
        mfcs=[mfc],
        allocations={"sft_train": MFCAllocation("sft_train", mesh, ParallelStrategy(2, 2))},
    )


def make_batch(vocab_size: int) -> SequenceSample:
    lengths = [7, 12, 5, 9, 11, 6]
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, vocab_size, (sum(lengths),), generator=generator)
    prompt_mask = torch.cat([torch.arange(n) < 3 for n in lengths])  # 3 prompt tokens each
    return SequenceSample.from_default(
        ids=[f"s{i}" for i in range(len(lengths))],
        seqlens=lengths,
        data={"packed_input_ids": tokens, "prompt_mask": prompt_mask},
    )


def shard_state(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def greedy_and_sampled(module, generator_seed: int | None, generator=None) -> dict:
    prompts = torch.tensor([5, 9, 14, 3, 22, 7, 30, 11, 4])
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    greedy = generate(
        module,
        prompts,
        cu_seqlens,
        GenerationConfig(max_new_tokens=8, greedy=True),
        torch.Generator().manual_seed(0),
    )
    if generator is None:
        generator = torch.Generator().manual_seed(generator_seed)
    sampled = generate(
        module, prompts, cu_seqlens, GenerationConfig(n=2, max_new_tokens=8), generator
    )
    return {
        "greedy_ids": greedy.packed_input_ids,
        "greedy_logprobs": greedy.packed_logprobs,
        "sampled_ids": sampled.packed_input_ids,
    }


def train_message(part: SequenceSample) -> Message:
    meta, tensors = part.to_wire()
    return Message("mfc", {"mfc": "sft_train", "data": meta}, tensors)


def run_worker(rank: int, port: int, model_path: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    plan = make_plan(model_path)
    worker = ModelWorker(rank, plan, ProcessGroups.create(plan))
    layout = plan.layout_of("sft_train")
    engine = worker.models[layout].engine
    coordinates = plan.allocations["sft_train"].coordinates_of(rank)
    batch = make_batch(engine.module.config.vocab_size)
    part = batch.split_data_parallel(2)[0][coordinates.dp]
    checkpoint = os.path.join(result_dir, "checkpoint")
    result = {"dp": coordinates.dp, "tp": coordinates.tp, "stats": []}
    result["layers"] = {  # every tp layer's class -> the megatron-core class it is or extends
        type(m).__name__: [c.__name__ for c in type(m).__mro__ if c.__module__ == MEGATRON_LAYERS]
        for m in engine.module.modules()
        if hasattr(m, "tp_group")
    }

    result["stats"].append(worker.handle(train_message(part)).raise_if_error().header["stats"])
    result["step1"] = shard_state(engine)
    worker.handle(Message("save", {"directory": checkpoint})).raise_if_error()
    dist.barrier()
    result["stats"].append(worker.handle(train_message(part)).raise_if_error().header["stats"])
    result["step2"] = shard_state(engine)
    worker.handle(Message("load", {"directory": checkpoint})).raise_if_error()
    result["loaded"] = shard_state(engine)
    result["generation"] = greedy_and_sampled(engine.module, None, engine.generator)
    result["generation_t1"] = greedy_and_sampled(
        load_pretrained(os.path.join(checkpoint, "actor")), 0
    )
    worker.handle(train_message(part)).raise_if_error()
    result["step2_again"] = shard_state(engine)
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    if rank == 0:
        train_single_device(plan, batch, result_dir)
    dist.barrier()
    dist.destroy_process_group()


def train_single_device(plan: RunPlan, batch: SequenceSample, result_dir: str) -> None:
    engine = load_engine(
        plan.models["actor"],
        ParallelContext(),
        trains=True,
        total_optimizer_steps=plan.base.total_train_steps,
        seed=0,
    )
    reference = {"stats": []}
    for step in (1, 2):
        stats = SFTInterface().train_step(engine, batch, MicroBatchSpec()).stats
        reference["stats"].append(stats)
        reference[f"step{step}"] = shard_state(engine)
    torch.save(reference, os.path.join(result_dir, "reference.pt"))


def full_parameters(results: dict, key: str, dp: int, config) -> dict[str, torch.Tensor]:
    shards = sorted((r for r in results.values() if r["dp"] == dp), key=lambda r: r["tp"])
    return unshard_state_dicts([shard[key] for shard in shards], config)


def test_tensor_parallel_runtime_trains_checkpoints_and_generates_like_one_device(tmp_path):
    from realrl.api.ports import free_port

    model_path = str(fresh_default_model(tmp_path / "model"))
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(run_worker, (free_port(), model_path, str(tmp_path)), WORLD)
    config = load_pretrained(model_path).config
    results = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)}
    reference = torch.load(tmp_path / "reference.pt")

    for rank_result in results.values():  # the tp layers are (thin subclasses of) megatron's
        assert rank_result["layers"] == {
            "_ColumnParallelLinear": ["ColumnParallelLinear"],
            "_RowParallelLinear": ["RowParallelLinear"],
            "VocabParallelEmbedding": ["VocabParallelEmbedding"],
            "VocabParallelHead": ["ColumnParallelLinear"],
        }
    for step in ("step1", "step2"):  # every replica's full parameters equal one device's
        for dp in (0, 1):
            full = full_parameters(results, step, dp, config)
            for name, expected in reference[step].items():
                torch.testing.assert_close(
                    full[name], expected, rtol=0, atol=1e-6, msg=f"{step} replica {dp}: {name}"
                )
    for name in results[0]["step2"]:  # norms are replicated: identical on all four ranks
        if "norm" in name:
            assert all(
                torch.equal(r["step2"][name], results[0]["step2"][name]) for r in results.values()
            ), name
    for index, expected in enumerate(reference["stats"]):
        assert expected["grad_norm"] > MAX_GRAD_NORM  # clipping was active
        for rank_result in results.values():
            got = rank_result["stats"][index]
            assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
            assert abs(got["loss"] - expected["loss"]) <= 1e-5

    saved = load_pretrained(tmp_path / "checkpoint" / "actor").state_dict()
    step1 = full_parameters(results, "step1", 0, config)
    assert all(torch.equal(saved[name], step1[name]) for name in step1)
    optimizer_files = sorted(p.name for p in (tmp_path / "checkpoint" / "actor").glob("opt*"))
    assert optimizer_files == ["optimizer.tp0of2.pt", "optimizer.tp1of2.pt"]
    for rank_result in results.values():  # loading re-shards, and recovery is exact
        for name, value in rank_result["loaded"].items():
            assert torch.equal(value, rank_result["step1"][name]), name
            assert torch.equal(rank_result["step2_again"][name], rank_result["step2"][name]), name

    for rank_result in results.values():
        generated, single = rank_result["generation"], rank_result["generation_t1"]
        assert torch.equal(generated["greedy_ids"], single["greedy_ids"])
        torch.testing.assert_close(
            generated["greedy_logprobs"], single["greedy_logprobs"], rtol=0, atol=1e-5
        )
    for dp in (0, 1):  # tp ranks of a replica share the sampling seed and sample alike
        tp0, tp1 = (r["generation"]["sampled_ids"] for r in results.values() if r["dp"] == dp)
        assert torch.equal(tp0, tp1)
    assert not torch.equal(
        results[0]["generation"]["sampled_ids"], results[2]["generation"]["sampled_ids"]
    )  # replicas differ
