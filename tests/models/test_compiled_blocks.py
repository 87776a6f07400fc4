"""Compiled blocks (`realrl.models.compiled`, `<role>.compile=true`) against the eager model.

Each test starts from an empty dynamo cache and counts the graphs dynamo builds: one per
compiled part (before and after attention), whatever the number of layers and batches. A
per-layer or per-batch recompile would show up as more graphs. Inductor's on-disk cache
makes reruns fast; a cold run compiles C++ kernels for a few seconds per graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_hf_models import TINY as HF_TINY
from torch._dynamo.utils import counters

from realrl.models.compiled import enable_compiled_blocks
from realrl.models.config import ModelConfig
from realrl.models.layers import PlainLayerFactory
from realrl.models.transformer import Transformer

# Both families share every size, so they share the part after attention (and its kernels).
TINY = {**HF_TINY, "num_hidden_layers": 3}
FAMILIES = {
    "qwen2": dict(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
    "llama": dict(model_type="llama", qkv_bias=False, rope_theta=500000.0),
    "qwen3": dict(model_type="qwen3", qk_norm=True, head_dim=32),
}
# Different token counts, lengths and attention kernels ("auto": per_sequence, then padded).
FIRST_BATCH = [7, 1, 19, 12, 3]  # 42 tokens
SECOND_BATCH = [6, 9, 8, 9, 7, 9, 5]  # 53 tokens
GRAPHS_PER_MODE = 2  # before_attention and after_attention


@pytest.fixture(autouse=True)
def empty_dynamo_cache():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def build_model(dtype=torch.float32, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **overrides}))
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so that they matter
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.to(dtype)


def eager_and_compiled(model: Transformer) -> tuple[Transformer, Transformer]:
    compiled = copy.deepcopy(model)
    enable_compiled_blocks(compiled, "actor.compile")
    return model, compiled


def packed_batch(lengths: list[int], vocab_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    packed_input_ids = torch.randint(0, vocab_size, (sum(lengths),), generator=generator)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths).cumsum(0)
    return packed_input_ids, cu_seqlens


def logits_and_gradients(model: Transformer, packed_input_ids, cu_seqlens):
    model.zero_grad(set_to_none=True)
    logits = model(packed_input_ids, cu_seqlens)
    # A per-token mean loss whose gradient reaches every logit (largest gradients ~1-5).
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    ((logits.float().log_softmax(-1) * weights).sum() / logits.shape[0]).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def graphs_built() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_blocks_match_eager_logits_and_gradients_without_recompiling(family):
    eager, compiled = eager_and_compiled(build_model(**FAMILIES[family]))
    vocab_size = eager.config.vocab_size
    for seed, lengths in enumerate([FIRST_BATCH, SECOND_BATCH]):
        batch = packed_batch(lengths, vocab_size, seed)
        expected_logits, expected_grads = logits_and_gradients(eager, *batch)
        logits, grads = logits_and_gradients(compiled, *batch)
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad,
                expected_grads[name],
                atol=1e-5,
                rtol=1e-5,
                msg=lambda text, name=name: f"{name}: {text}",
            )
        # Three layers and two token counts, yet one graph per part: weights are arguments
        # and the token dimension is symbolic (per-layer graphs would make 2 x 3).
        assert graphs_built() == GRAPHS_PER_MODE, f"after batch {seed}"


def compiles_so_far() -> int:
    """Graphs dynamo built plus graphs inductor compiled or loaded (forwards and backwards)."""
    inductor = counters["inductor"]
    return graphs_built() + sum(inductor[f"fxgraph_cache_{k}"] for k in ("miss", "hit", "bypass"))


def test_the_first_call_compiles_every_thread_count_a_worker_can_run_at():
    # A model worker that borrows idle cores runs at one or two threads. Its first training
    # call compiles both counts, forwards and backwards, so a core lent at a later step
    # compiles nothing and the results stay equal to eager.
    eager, compiled = eager_and_compiled(build_model(**FAMILIES["qwen2"]))
    compiled.compiled_blocks.thread_counts = (1, 2)
    vocab_size = eager.config.vocab_size
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        logits_and_gradients(compiled, *packed_batch(FIRST_BATCH, vocab_size, 0))
        assert graphs_built() == 2 * GRAPHS_PER_MODE
        compiled_before = compiles_so_far()
        torch.set_num_threads(2)
        batch = packed_batch(SECOND_BATCH, vocab_size, 1)
        logits, grads = logits_and_gradients(compiled, *batch)
        assert compiles_so_far() == compiled_before
        assert torch.get_num_threads() == 2
        expected_logits, expected_grads = logits_and_gradients(eager, *batch)
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_compiled_inference_of_a_frozen_bfloat16_critic_matches_eager():
    # A critic (value head outside the blocks), frozen like the `ref`/`critic_inf` engines,
    # in bf16, without grad: one test for three variants, as each costs its own C++ kernels.
    # Inductor keeps fused intermediates in fp32 where eager rounds each op to bf16, so the
    # two differ by bf16 rounding; both must stay as close to the fp32 model as each other.
    reference = build_model(is_critic=True, qkv_bias=True)
    reference.value_head.weight.data.normal_(generator=torch.Generator().manual_seed(2))
    eager = copy.deepcopy(reference).to(torch.bfloat16).requires_grad_(False)
    compiled = copy.deepcopy(eager)
    enable_compiled_blocks(compiled, "critic.compile")
    with torch.no_grad():
        for seed, lengths in enumerate([FIRST_BATCH, SECOND_BATCH]):
            batch = packed_batch(lengths, reference.config.vocab_size, seed)
            values, expected = compiled(*batch), reference(*batch)
            assert values.dtype == torch.float32 and values.shape == (sum(lengths),)
            eager_error = (eager(*batch) - expected).abs().max()
            assert (values - expected).abs().max() <= 2 * eager_error + 1e-2
    assert graphs_built() == GRAPHS_PER_MODE


def test_tensor_parallel_models_are_not_compiled():
    class TwoRankShapes(PlainLayerFactory):
        tp_size = 2  # only the local sizes matter here; no process group is needed

    model = Transformer(ModelConfig(**TINY), TwoRankShapes())
    with pytest.raises(ValueError, match="actor.compile=true: compiled blocks need"):
        enable_compiled_blocks(model, "actor.compile")
    assert model.compiled_blocks is None


def test_a_model_that_inductor_cannot_build_names_the_key_and_both_fixes():
    # What a missing C++ compiler looks like to the caller (the subprocess test of gen.compile
    # in test_generation_engine.py provokes the real failure through the same helper).
    model = build_model()
    enable_compiled_blocks(model, "critic.compile")

    def fail(*args):
        raise torch._dynamo.exc.BackendCompilerFailed("inductor", OSError("no g++"), None)

    model.compiled_blocks.before_attention = fail
    with pytest.raises(RuntimeError) as info:
        model(*packed_batch(FIRST_BATCH, model.config.vocab_size, 0))
    message = str(info.value)
    assert "critic.compile=true: torch.compile could not build the transformer block" in message
    assert "install a working C++ compiler" in message and "set critic.compile=false" in message
