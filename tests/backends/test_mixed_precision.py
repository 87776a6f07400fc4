"""bf16 training on fp32 master weights (`realrl.backends.mixed_precision`) through TorchEngine.

A reference "plain bf16" trainer (AdamW directly on the bf16 parameters, which is what the
engine did before master weights) is written out here to show what the masters change.
"""

from __future__ import annotations

import functools
import io
import os

import pytest
import torch
import torch.distributed as dist
from rank_processes import start_ranks

from realrl.api import environment
from realrl.api.experiment import LRScheduler, OptimizerConfig
from realrl.backends import torch_optimizer
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer
from realrl.workers.model_loading import shard_module

VOCAB_SIZE = 52
# Four packed sequences of 20, 24, 26 and 26 tokens, with fixed random next-token targets.
BOUNDS = [0, 20, 44, 70, 96]


def tiny_model(seed: int = 0) -> Transformer:
    """A tiny Qwen2-style model whose fp32 weights are exactly representable in bf16, so that
    fp32 and bf16 runs start from the same weights."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, model_type="qwen2",
        eos_token_id=1,
    ))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    return model


def make_engine(model, lr: float, parallel=None, adam_eps: float = 1e-8,
                gradient_clipping: float = 0.0) -> TorchEngine:
    optimizer = OptimizerConfig(lr=lr, weight_decay=0.0, lr_scheduler=LRScheduler.constant,
                                gradient_clipping=gradient_clipping, eps=adam_eps)
    return TorchEngine(model, None, parallel or ParallelContext(), optimizer, 100)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(2, VOCAB_SIZE, (BOUNDS[-1],), generator=generator)
    targets = torch.randint(2, VOCAB_SIZE, (BOUNDS[-1],), generator=generator)
    return input_ids, targets


def microbatches(sequences: list[int], per_microbatch: int) -> list[tuple]:
    """`sequences` (indices into BOUNDS) in micro-batches of `per_microbatch` sequences each:
    (packed_input_ids [tokens], cu_seqlens [n + 1], targets [tokens])."""
    input_ids, targets = batch()
    result = []
    for start in range(0, len(sequences), per_microbatch):
        chosen = sequences[start : start + per_microbatch]
        pieces = [slice(BOUNDS[i], BOUNDS[i + 1]) for i in chosen]
        lengths = torch.tensor([0] + [s.stop - s.start for s in pieces])
        result.append((
            torch.cat([input_ids[s] for s in pieces]),
            lengths.cumsum(0).to(torch.int32),
            torch.cat([targets[s] for s in pieces]),
        ))
    return result


def cross_entropy(module):
    """Each micro-batch's share of the whole batch's mean cross-entropy (global denominator),
    from the final hidden states the engine's forward returns, through `module`'s LM head."""

    def loss_fn(forward, microbatch):
        input_ids, cu_seqlens, targets = microbatch
        logits = module.head(forward(input_ids, cu_seqlens)).float()  # [tokens, vocab]
        loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum") / BOUNDS[-1]
        return loss, {"loss": float(loss.detach())}

    return loss_fn


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def train(dtype: torch.dtype, lr: float, steps: int, per_microbatch: int = 4,
          adam_eps: float = 1e-8) -> TorchEngine:
    engine = make_engine(tiny_model().to(dtype), lr, adam_eps=adam_eps)
    for _ in range(steps):
        engine.train_microbatches(microbatches([0, 1, 2, 3], per_microbatch), cross_entropy(engine.module))
    return engine


def train_plain_bf16(lr: float, steps: int) -> Transformer:
    """AdamW stepping the bf16 parameters themselves (no masters): each update is rounded to
    bf16 as it is applied."""
    model = tiny_model().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        for microbatch in microbatches([0, 1, 2, 3], 4):
            forward = functools.partial(model, apply_lm_head=False)
            cross_entropy(model)(forward, microbatch)[0].backward()
        optimizer.step()
    return model


def test_tiny_updates_move_the_fp32_masters_every_step_and_the_bf16_weights_follow():
    """lr=1e-6 is far below half a bf16 spacing of most weights: stepping bf16 weights would
    round nearly every update away. The masters take every update, the bf16 weights are
    always the masters rounded, and the updates add up until they cross a bf16 spacing."""
    initial = flat(tiny_model().parameters())
    engine = make_engine(tiny_model().to(torch.bfloat16), lr=1e-6)
    masters = engine.backend.master_weights.masters
    assert all(m.dtype == torch.float32 for m in masters)
    assert [p.data_ptr() for p in engine.optimizer.param_groups[0]["params"]] == [
        m.data_ptr() for m in masters
    ]
    weight_pointers = [p.data_ptr() for p in engine.module.parameters()]
    previous = flat(masters)
    for _ in range(20):
        engine.train_microbatches(microbatches([0, 1, 2, 3], 2), cross_entropy(engine.module))
        current = flat(masters)
        moved = current != previous
        # Embedding rows of tokens absent from the batch get no gradient; the rest move.
        assert moved.float().mean() > 0.9
        assert (current - previous).abs().max() < 3e-6  # Adam: about lr per step
        previous = current
        for weight, master in zip(engine.module.parameters(), masters, strict=True):
            assert weight.dtype == torch.bfloat16
            assert torch.equal(weight, master.to(torch.bfloat16))
    # Written in place: shared-memory copies and reallocation keep the same tensors.
    assert [p.data_ptr() for p in engine.module.parameters()] == weight_pointers
    changed = (flat(engine.module.parameters()) != initial).float().mean()
    plain_changed = (flat(train_plain_bf16(1e-6, 20).parameters()) != initial).float().mean()
    assert changed > 0.03
    assert changed > 5 * plain_changed


def test_bf16_with_masters_tracks_an_fp32_run_far_better_than_plain_bf16():
    initial = flat(tiny_model().parameters())
    reference = flat(train(torch.float32, 1e-4, 10).module.parameters())
    update = (reference - initial).norm()
    engine = train(torch.bfloat16, 1e-4, 10)
    masters_error = (flat(engine.backend.master_weights.masters) - reference).norm() / update
    weights_error = (flat(engine.module.parameters()) - reference).norm() / update
    plain_error = (flat(train_plain_bf16(1e-4, 10).parameters()) - reference).norm() / update
    # Measured: masters 0.05, their bf16 rounding 0.24, plain bf16 0.91 of the update.
    assert masters_error < 0.15
    assert weights_error < 0.5
    assert plain_error > 2 * weights_error


def test_bf16_micro_batches_sum_in_fp32():
    """1 vs 4 micro-batches: only the rounding of each micro-batch's bf16 gradient differs
    (measured 0.3% of the update; summing them in bf16 instead: 2-3%). A large Adam eps keeps
    near-zero gradients from turning rounding noise into lr-sized steps."""
    initial = flat(tiny_model().parameters())
    one = flat(train(torch.bfloat16, 1e-3, 1, per_microbatch=4, adam_eps=1e-4)
               .backend.master_weights.masters)
    four = flat(train(torch.bfloat16, 1e-3, 1, per_microbatch=1, adam_eps=1e-4)
                .backend.master_weights.masters)
    assert (one - four).norm() < 0.01 * (one - initial).norm()


def test_fp32_engine_keeps_its_path_without_masters():
    engine = train(torch.float32, 1e-3, 1)
    assert engine.backend.master_weights is None
    assert "master_weights" not in engine.state_for_checkpoint()
    optimized = engine.optimizer.param_groups[0]["params"]
    assert [id(p) for p in optimized] == [id(p) for p in engine.module.parameters()]


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _resumed(engine: TorchEngine, dtype: torch.dtype) -> TorchEngine:
    """What `checkpointing.load_worker_state` does: the checkpoint's (bf16) weights into a
    freshly built module, `weights_written`, then the engine's saved state."""
    resumed = make_engine(tiny_model(seed=1).to(dtype), lr=1e-5)
    with torch.no_grad():
        for target, saved in zip(resumed.module.parameters(), engine.module.parameters()):
            target.copy_(saved)
    resumed.weights_written()
    resumed.load_checkpoint_state(_round_trip(engine.state_for_checkpoint()))
    return resumed


def masters(engine: TorchEngine) -> torch.Tensor:
    return flat(engine.backend.master_weights.masters)


def test_a_resume_restores_the_masters_exactly():
    first = train(torch.bfloat16, 1e-5, 3)
    resumed = _resumed(first, torch.bfloat16)
    assert torch.equal(masters(resumed), masters(first))
    for engine in (first, resumed):
        engine.train_microbatches(microbatches([0, 1, 2, 3], 2), cross_entropy(engine.module))
    assert torch.equal(masters(resumed), masters(first))
    assert torch.equal(flat(resumed.module.parameters()), flat(first.module.parameters()))
    # The bf16 weights alone would have lost what the masters hold below one bf16 spacing.
    assert not torch.equal(flat(first.module.parameters()), masters(first))
    # An fp32 run resuming the bf16 run takes the masters as its weights.
    as_fp32 = _resumed(first, torch.float32)
    assert torch.equal(flat(as_fp32.module.parameters()), masters(first))


def test_weights_written_outside_the_optimizer_become_the_masters():
    """A weights-only checkpoint: no saved masters, the masters take the loaded weights."""
    engine = train(torch.bfloat16, 1e-5, 2)
    loaded = tiny_model(seed=3).to(torch.bfloat16)
    with torch.no_grad():
        for target, source in zip(engine.module.parameters(), loaded.parameters()):
            target.copy_(source)
    engine.weights_written()
    assert torch.equal(flat(engine.backend.master_weights.masters), flat(loaded.parameters()))


def test_mismatched_saved_masters_are_refused_with_the_fix():
    engine = train(torch.bfloat16, 1e-5, 1)
    state = engine.state_for_checkpoint()
    state["master_weights"] = state["master_weights"][:-1]
    with pytest.raises(ValueError, match="resume with the model and tensor-parallel layout"):
        make_engine(tiny_model().to(torch.bfloat16), lr=1e-5).load_checkpoint_state(state)


# ------------------------------------------------------------------ data parallel


def _data_parallel_run(parallel: ParallelContext, sequences: list[int]) -> dict:
    """Per clipping setting: masters and weights after two steps on `sequences`, one
    micro-batch per sequence (as two ranks with one each, or one rank with both)."""
    results = {}
    for clipping in (0.0, 0.05):
        engine = make_engine(tiny_model().to(torch.bfloat16), 1e-3, parallel,
                             gradient_clipping=clipping)
        for _ in range(2):
            stats = engine.train_microbatches(microbatches(sequences, 1), cross_entropy(engine.module))
        buckets = engine.backend.gradient_buckets
        results[clipping] = {
            "masters": flat(engine.backend.master_weights.masters),
            "weights": flat(engine.module.parameters()),
            "grad_norm": stats["grad_norm"],
            "bucket_dtypes": None if buckets is None else {b.dtype for b in buckets.buckets},
            "shared": buckets is not None and buckets.shared is not None,
        }
    return results


def _data_parallel_worker(rank: int, rendezvous: str, output: str, shared: bool) -> None:
    torch.set_num_threads(1)
    os.environ[environment.SHARED_MEMORY] = "1" if shared else "0"
    torch_optimizer.GRADIENT_BUCKET_BYTES = 2048  # several buckets, started during the backward
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        parallel = ParallelContext(dp_rank=rank, dp_size=2, dp_group=dist.new_group([0, 1]))
        results = _data_parallel_run(parallel, [0, 1] if rank == 0 else [2, 3])
        torch.save(results, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "gloo"])
def test_two_data_parallel_bf16_ranks_sum_fp32_gradients_like_one(tmp_path, shared):
    """Each micro-batch's bf16 gradient is the same on one rank or two; their fp32 sums (in a
    micro-batch loop or over ranks) are then equal, and without clipping bit for bit."""
    torch.set_num_threads(1)
    output = str(tmp_path / "result")
    start_ranks(_data_parallel_worker, (str(tmp_path / "rendezvous"), output, shared), 2)
    single = _data_parallel_run(ParallelContext(), [0, 1, 2, 3])
    for rank in range(2):
        ranks = torch.load(f"{output}.rank{rank}", weights_only=False)
        for clipping, expected in single.items():
            result = ranks[clipping]
            assert result["shared"] == shared
            assert result["bucket_dtypes"] == {torch.float32}
            if clipping == 0.0:
                assert torch.equal(result["masters"], expected["masters"])
                assert torch.equal(result["weights"], expected["weights"])
            else:  # the norm is summed in another order: equal up to fp32 rounding
                assert expected["grad_norm"] > clipping
                torch.testing.assert_close(result["masters"], expected["masters"],
                                           atol=1e-6, rtol=0)
            assert abs(result["grad_norm"] - expected["grad_norm"]) < 1e-5


def test_kept_forward_is_reused_with_masters_until_the_weights_are_written():
    engine = make_engine(tiny_model().to(torch.bfloat16), 1e-3)
    reference = make_engine(tiny_model().to(torch.bfloat16), 1e-3)
    (microbatch,) = microbatches([0, 1, 2, 3], 4)
    engine.forward(microbatch[0], microbatch[1], keep=True)
    stats = engine.train_microbatches([microbatch], cross_entropy(engine.module))
    reference_stats = reference.train_microbatches([microbatch], cross_entropy(reference.module))
    assert stats["forward_reused"] == 1.0
    assert stats["loss"] == reference_stats["loss"]
    assert torch.equal(masters(engine), masters(reference))
    # Weights written between the kept forward and the train call (a checkpoint load): the
    # kept output is stale, and the train call runs its own forward.
    engine.forward(microbatch[0], microbatch[1], keep=True)
    with torch.no_grad():
        for target, source in zip(engine.module.parameters(), tiny_model(seed=3).parameters()):
            target.copy_(source)
    engine.weights_written()
    assert engine.train_microbatches([microbatch], cross_entropy(engine.module))["forward_reused"] == 0.0


# ------------------------------------------------------------------ tensor parallel


def next_token_loss_fn(module):
    """The mean next-token NLL through `module.shifted_logprobs`: a tensor-parallel model's
    LM head holds a vocabulary slice on each rank, and only the model reduces over its group."""

    def loss_of(forward, microbatch):
        input_ids, cu_seqlens, _ = microbatch
        logprobs = module.shifted_logprobs(forward(input_ids, cu_seqlens), input_ids, cu_seqlens)
        loss = -logprobs.sum() / (BOUNDS[-1] - len(BOUNDS) + 1)
        return loss, {"loss": loss.detach()}

    return loss_of


def _tensor_parallel_worker(rank: int, rendezvous: str, output: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        parallel = ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.new_group([0, 1]))
        module = shard_module(tiny_model().to(torch.bfloat16), parallel)
        engine = make_engine(module, 1e-3, parallel, gradient_clipping=0.05)
        stats = [engine.train_microbatches(microbatches([0, 1, 2, 3], 2),
                                           next_token_loss_fn(module)) for _ in range(3)]
        torch.save([(s["loss"], s["grad_norm"]) for s in stats], f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_bf16_clips_on_fp32_gradients_counting_shards_once(tmp_path):
    """tp=2 in bf16: each sharded master's slice enters the global norm once, each replicated
    one once, so the norm (and the clipped steps after it) match one device's up to bf16
    rounding of the sharded matmuls."""
    torch.set_num_threads(1)
    output = str(tmp_path / "result")
    start_ranks(_tensor_parallel_worker, (str(tmp_path / "rendezvous"), output), 2)
    module = tiny_model().to(torch.bfloat16)
    engine = make_engine(module, 1e-3, gradient_clipping=0.05)
    single = [engine.train_microbatches(microbatches([0, 1, 2, 3], 2), next_token_loss_fn(module))
              for _ in range(3)]
    for rank in range(2):
        for (loss, grad_norm), expected in zip(torch.load(f"{output}.rank{rank}"), single):
            assert expected["grad_norm"] > 0.05  # every step clips
            assert loss == pytest.approx(expected["loss"], rel=1e-2)
            assert grad_norm == pytest.approx(expected["grad_norm"], rel=2e-2)
