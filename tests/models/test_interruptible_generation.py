"""Interruptible generation: chunks of decode steps, new weights between them, and each token's
weight version (`realrl.models.interruptible_generation`)."""

from __future__ import annotations

import pytest
import torch
from test_generation_engine import forward_logprobs
from tiny_hf_models import random_packed_batch, save_hf

from realrl.models.checkpoint import load_pretrained
from realrl.models.generation import GenerationConfig, generate
from realrl.models.interruptible_generation import InterruptibleGeneration

PROMPT_LENGTHS = [5, 9, 2, 6]
EOS = 3
MAX_NEW = 12
CHUNK = 4  # the weights change after the prefill's token and CHUNK decode steps


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    save_hf(path, "qwen2", eos_token_id=EOS)
    return path


@pytest.fixture
def prompts():
    _, packed, cu_seqlens = random_packed_batch(PROMPT_LENGTHS, 96, seed=5)
    return packed.clamp_min(4), cu_seqlens  # no EOS in the prompts


def perturbed(model, seed: int):
    """The weights of `model` plus noise: the next version's, as a state dict."""
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()}


def chunked(model, prompts, config, seed, versions, kv_cache, new_weights=None):
    """Generate in chunks of CHUNK steps, chunk i under `versions[i]` (the last one to the
    end); before the first chunk of version 1, `new_weights` are copied into the model."""
    session = InterruptibleGeneration.start(model, *prompts, config,
                                            torch.Generator().manual_seed(seed), versions[0])
    for index, version in enumerate(versions):
        if version != session.version and new_weights is not None:
            model.load_state_dict(new_weights)  # in place, as a weight transfer does
        last = index == len(versions) - 1
        done = session.decode(model, 0 if last else CHUNK, version, kv_cache)
        assert done == last or not done
    return session


@pytest.mark.parametrize("kv_cache", ["recompute", "keep"])
def test_chunks_without_new_weights_give_the_tokens_of_one_call(directory, prompts, kv_cache):
    model = load_pretrained(directory)
    config = GenerationConfig(n=2, max_new_tokens=MAX_NEW, temperature=0.9)
    expected = generate(model, *prompts, config, torch.Generator().manual_seed(3))
    # The version number changes but the weights do not: a recomputed cache holds what the
    # decode steps wrote (up to rounding), a kept one is the same cache.
    session = chunked(model, prompts, config, 3, [0, 1, 1], kv_cache)
    output, versions = session.output()
    assert torch.equal(output.packed_input_ids, expected.packed_input_ids)
    assert torch.equal(output.response_lens, expected.response_lens)
    if kv_cache == "keep":
        assert torch.equal(output.packed_logprobs, expected.packed_logprobs)
    else:
        torch.testing.assert_close(output.packed_logprobs, expected.packed_logprobs,
                                   rtol=0, atol=1e-5)
    assert versions.shape == output.packed_logprobs.shape
    assert session.weight_updates == 1


def test_new_weights_mid_generation_switch_versions_and_lose_no_token(directory, prompts):
    old = load_pretrained(directory)
    new_weights = perturbed(old, seed=11)
    new = load_pretrained(directory)
    new.load_state_dict(new_weights)
    # min_new_tokens = max_new_tokens: every row decodes to the end, so each has tokens of
    # both versions.
    config = GenerationConfig(n=2, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    uninterrupted = generate(old, *prompts, config, torch.Generator().manual_seed(4))
    outputs = {}
    for kv_cache in ("recompute", "keep"):
        model = load_pretrained(directory)
        session = chunked(model, prompts, config, 4, [0, 1], kv_cache, new_weights)
        outputs[kv_cache] = session.output()
    for output, versions in outputs.values():
        num_rows = len(PROMPT_LENGTHS) * 2
        assert output.response_lens.tolist() == [MAX_NEW] * num_rows  # nothing lost or cut
        per_row = versions.view(num_rows, MAX_NEW)
        # Token 0 comes from the prefill, tokens 1..CHUNK from the first chunk: version 0.
        assert per_row[:, : CHUNK + 1].eq(0).all() and per_row[:, CHUNK + 1 :].eq(1).all()
        old_tokens = per_row.eq(0).flatten()
        # Before the swap: the old weights' tokens and log-probs, as in an uninterrupted call.
        same_prefix = uninterrupted.packed_logprobs.view(num_rows, MAX_NEW)[:, : CHUNK + 1]
        assert torch.equal(output.packed_logprobs.view(num_rows, MAX_NEW)[:, : CHUNK + 1],
                           same_prefix)
        torch.testing.assert_close(output.packed_logprobs[old_tokens],
                                   forward_logprobs(old, output)[old_tokens], rtol=0, atol=1e-5)
    # After the swap, a recomputed cache makes the log-probs the new model's own; a kept one
    # mixes the old weights' keys and values in.
    recomputed, versions = outputs["recompute"]
    new_tokens = versions.eq(1)
    torch.testing.assert_close(recomputed.packed_logprobs[new_tokens],
                               forward_logprobs(new, recomputed)[new_tokens], rtol=0, atol=1e-5)
    kept, versions = outputs["keep"]
    gap = (kept.packed_logprobs - forward_logprobs(new, kept))[versions.eq(1)].abs().max()
    assert gap > 1e-3
    # Both continue the same prefix: the tokens up to the swap agree.
    prefix = CHUNK + 1
    for left, right in zip(recomputed.packed_input_ids.split(recomputed.cu_seqlens.diff().tolist()),
                           kept.packed_input_ids.split(kept.cu_seqlens.diff().tolist())):
        assert torch.equal(left[: -MAX_NEW + prefix], right[: -MAX_NEW + prefix])


def test_a_generation_finished_inside_a_chunk_ignores_later_weights(directory, prompts):
    model = load_pretrained(directory)
    config = GenerationConfig(max_new_tokens=3, greedy=True)
    expected = generate(model, *prompts, config, torch.Generator().manual_seed(0))
    session = InterruptibleGeneration.start(model, *prompts, config,
                                            torch.Generator().manual_seed(0), 5)
    assert session.decode(model, 8, 5, "recompute")  # 2 steps left of 8 asked
    assert session.decode(model, 8, 6, "recompute")
    output, versions = session.output()
    assert torch.equal(output.packed_input_ids, expected.packed_input_ids)
    assert versions.eq(5).all() and session.weight_updates == 0
