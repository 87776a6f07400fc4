"""The KV-cache generation engine: parity with transformers, log-probs, stopping, grouping."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_hf_models import random_packed_batch, save_hf

from realrl.models.checkpoint import load_pretrained
from realrl.models.generation import GenerationConfig, _features_first_block, generate

PROMPT_LENGTHS = [5, 9, 2, 6]
EOS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    hf_model = save_hf(directory, "qwen2", eos_token_id=EOS)
    return hf_model, load_pretrained(directory)


@pytest.fixture
def prompts():
    _, packed, cu_seqlens = random_packed_batch(PROMPT_LENGTHS, 96, seed=5)
    packed = packed.clamp_min(4)  # prompts never contain EOS or the stop tokens used below
    return packed, cu_seqlens


def split_sequences(output):
    offsets = output.cu_seqlens.tolist()
    return [output.packed_input_ids[start:end] for start, end in zip(offsets[:-1], offsets[1:])]


def responses(output):
    return [seq[int(p) :] for seq, p in zip(split_sequences(output), output.prompt_lens)]


def forward_logprobs(model, output) -> torch.Tensor:
    """Log-probs [total_response_tokens] of the response tokens by one training forward."""
    with torch.no_grad():
        logprobs = model(output.packed_input_ids, output.cu_seqlens).log_softmax(-1)
    offsets, pieces = output.cu_seqlens.tolist(), []
    for row, start in enumerate(offsets[:-1]):
        first, end = start + int(output.prompt_lens[row]), offsets[row + 1]
        tokens = output.packed_input_ids[first:end]
        pieces.append(logprobs[first - 1 : end - 1].gather(1, tokens[:, None]).squeeze(1))
    return torch.cat(pieces)


def test_greedy_generation_equals_transformers_generate_token_for_token(models, prompts):
    hf_model, model = models
    packed, cu_seqlens = prompts
    config = GenerationConfig(greedy=True, max_new_tokens=16)
    output = generate(model, packed, cu_seqlens, config, torch.Generator().manual_seed(0))
    prompt_list = packed.split(PROMPT_LENGTHS)
    for prompt, sequence in zip(prompt_list, split_sequences(output)):
        with torch.no_grad():
            expected = hf_model.generate(
                prompt[None], max_new_tokens=16, do_sample=False, pad_token_id=0
            )[0]
        assert sequence.tolist() == expected.tolist()


def test_qwen3_greedy_generation_and_sampled_log_probs_match_transformers(tmp_path, prompts):
    # per-head query/key norms in the features-first decode step, head_dim 32 != 64 / 4
    hf_model = save_hf(tmp_path, "qwen3", head_dim=32, eos_token_id=EOS)
    model = load_pretrained(tmp_path)
    packed, cu_seqlens = prompts
    greedy = GenerationConfig(greedy=True, max_new_tokens=12)
    output = generate(model, packed, cu_seqlens, greedy, torch.Generator().manual_seed(0))
    for prompt, sequence in zip(packed.split(PROMPT_LENGTHS), split_sequences(output)):
        with torch.no_grad():
            expected = hf_model.generate(
                prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0
            )[0]
        assert sequence.tolist() == expected.tolist()
    sampled = GenerationConfig(n=2, max_new_tokens=8, temperature=0.8)
    output = generate(model, packed, cu_seqlens, sampled, torch.Generator().manual_seed(1))
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 1e-5


def test_sampled_log_probs_match_a_training_forward(models, prompts):
    _, model = models
    config = GenerationConfig(n=3, max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9)
    output = generate(model, *prompts, config, torch.Generator().manual_seed(1))
    assert output.packed_logprobs.shape == (int(output.response_lens.sum()),)
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 1e-5


def test_sampling_log_probs_reflect_temperature_and_filters(models, prompts):
    _, model = models
    config = GenerationConfig(
        max_new_tokens=8, temperature=0.5, top_k=5, return_sampling_logprobs=True
    )
    output = generate(model, *prompts, config, torch.Generator().manual_seed(2))
    # Sharper, truncated distribution: each sampled token is at least as likely under it.
    assert torch.all(output.packed_sampling_logprobs >= output.packed_logprobs - 1e-6)
    assert torch.any(output.packed_sampling_logprobs > output.packed_logprobs + 1e-3)


def test_samples_are_grouped_by_prompt_with_n_per_prompt(models, prompts):
    _, model = models
    packed, cu_seqlens = prompts
    output = generate(
        model,
        packed,
        cu_seqlens,
        GenerationConfig(n=3, max_new_tokens=6),
        torch.Generator().manual_seed(3),
    )
    assert output.cu_seqlens.shape == (len(PROMPT_LENGTHS) * 3 + 1,)
    assert output.prompt_lens.tolist() == [n for n in PROMPT_LENGTHS for _ in range(3)]
    prompt_list = packed.split(PROMPT_LENGTHS)
    for row, sequence in enumerate(split_sequences(output)):
        assert torch.equal(sequence[: PROMPT_LENGTHS[row // 3]], prompt_list[row // 3])
    assert len({tuple(r.tolist()) for r in responses(output)[:3]}) > 1  # samples differ


def test_generation_is_reproducible_with_the_same_seed(models, prompts):
    _, model = models
    config = GenerationConfig(n=2, max_new_tokens=10)
    first = generate(model, *prompts, config, torch.Generator().manual_seed(7))
    second = generate(model, *prompts, config, torch.Generator().manual_seed(7))
    third = generate(model, *prompts, config, torch.Generator().manual_seed(8))
    assert torch.equal(first.packed_input_ids, second.packed_input_ids)
    assert torch.equal(first.packed_logprobs, second.packed_logprobs)
    assert not torch.equal(first.packed_input_ids, third.packed_input_ids)


def _frequent_token(model, prompts) -> int:
    """A token the model samples often (so stopping on it is exercised)."""
    output = generate(
        model, *prompts, GenerationConfig(n=4, max_new_tokens=12), torch.Generator().manual_seed(0)
    )
    counts = torch.bincount(torch.cat(responses(output)), minlength=96)
    counts[:4] = 0
    return int(counts.argmax())


def test_stop_tokens_end_responses_and_are_kept(models, prompts):
    _, model = models
    stop = _frequent_token(model, prompts)
    config = GenerationConfig(n=4, max_new_tokens=12, stop_token_ids=[stop])
    output = generate(model, *prompts, config, torch.Generator().manual_seed(0))
    stopped_by_stop_token = 0
    for response, no_eos in zip(responses(output), output.no_eos.tolist()):
        is_end = (response == stop) | (response == EOS)  # the model's EOS also ends a response
        assert int(is_end.sum()) == (0 if no_eos else 1)
        if no_eos:
            assert len(response) == 12
        else:
            assert is_end[-1]
            stopped_by_stop_token += int(response[-1] == stop)
    assert stopped_by_stop_token > 0
    assert output.response_lens.tolist() == [len(r) for r in responses(output)]


def test_min_new_tokens_masks_stop_tokens_until_reached(models, prompts):
    _, model = models
    stop = _frequent_token(model, prompts)
    unconstrained = GenerationConfig(n=4, max_new_tokens=12, stop_token_ids=[stop])
    control = generate(model, *prompts, unconstrained, torch.Generator().manual_seed(0))
    assert int(control.response_lens.min()) < 6  # without the constraint some stop early
    config = GenerationConfig(n=4, max_new_tokens=12, min_new_tokens=6, stop_token_ids=[stop])
    output = generate(model, *prompts, config, torch.Generator().manual_seed(0))
    for response in responses(output):
        assert len(response) >= 6
        assert not torch.any((response[:5] == stop) | (response[:5] == EOS))
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 1e-5


def test_eos_from_model_config_stops_greedy_generation(models):
    _, model = models
    # Make EOS the greedy choice everywhere, so every response is exactly [EOS].
    with torch.no_grad():
        model.lm_head.weight[EOS] += 100.0
    try:
        packed, cu_seqlens = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 4], dtype=torch.int32)
        output = generate(
            model,
            packed,
            cu_seqlens,
            GenerationConfig(greedy=True, max_new_tokens=5),
            torch.Generator(),
        )
    finally:
        with torch.no_grad():
            model.lm_head.weight[EOS] -= 100.0
    assert output.response_lens.tolist() == [1, 1]
    assert output.no_eos.tolist() == [False, False]
    assert output.packed_input_ids.tolist() == [5, 6, EOS, 7, 8, EOS]


def test_bfloat16_generation_log_probs_track_a_bfloat16_forward(tmp_path, prompts):
    save_hf(tmp_path, "qwen2", eos_token_id=EOS)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16)
    output = generate(
        model, *prompts, GenerationConfig(n=2, max_new_tokens=8), torch.Generator().manual_seed(4)
    )
    assert output.packed_logprobs.dtype == torch.float32
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 0.1


def test_invalid_generation_config_reports_every_problem(models, prompts):
    _, model = models
    config = GenerationConfig(n=0, max_new_tokens=4, min_new_tokens=9, top_p=0.0)
    with pytest.raises(ValueError, match=r"n=0.*min_new_tokens=9.*top_p=0\.0"):
        generate(model, *prompts, config, torch.Generator())


def test_generate_refuses_a_critic(tmp_path, prompts):
    save_hf(tmp_path, "qwen2")
    critic = load_pretrained(tmp_path, critic=True)
    with pytest.raises(ValueError, match="critic"):
        generate(critic, *prompts, GenerationConfig(max_new_tokens=2), torch.Generator())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bfloat16_generation_log_probs_track_a_forward(tmp_path, prompts):
    save_hf(tmp_path, "qwen2", eos_token_id=EOS)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    output = generate(model, *prompts, GenerationConfig(n=2, max_new_tokens=8), generator)
    assert output.packed_input_ids.is_cuda
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 0.1


def test_greedy_generation_honours_mistral_sliding_window_like_transformers(tmp_path, prompts):
    hf_model = save_hf(tmp_path, "mistral", sliding_window=4, eos_token_id=EOS)
    model = load_pretrained(tmp_path)
    packed, cu_seqlens = prompts
    config = GenerationConfig(greedy=True, max_new_tokens=10)
    output = generate(model, packed, cu_seqlens, config, torch.Generator())
    for prompt, sequence in zip(packed.split(PROMPT_LENGTHS), split_sequences(output)):
        with torch.no_grad():
            expected = hf_model.generate(
                prompt[None], max_new_tokens=10, do_sample=False, pad_token_id=0
            )[0]
        assert sequence.tolist() == expected.tolist()
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 1e-5
    # The compiled step masks the window over a column count that grows every step.
    config = dataclasses.replace(config, compile=True)
    compiled = generate(model, packed, cu_seqlens, config, torch.Generator())
    assert torch.equal(compiled.packed_input_ids, output.packed_input_ids)


def test_small_decode_runs_on_one_thread_and_restores_the_thread_count(models, prompts):
    # The tiny model's decode is far below SINGLE_THREAD_DECODE_MAX_WORK: it runs on one
    # thread, gives the same tokens as a one-thread run, and leaves the thread count as it was.
    _, model = models
    config = GenerationConfig(n=2, max_new_tokens=10)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = generate(model, *prompts, config, torch.Generator().manual_seed(3))
        torch.set_num_threads(2)
        double = generate(model, *prompts, config, torch.Generator().manual_seed(3))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single.packed_input_ids, double.packed_input_ids)
    assert (single.packed_logprobs - double.packed_logprobs).abs().max() <= 1e-6


def test_compiled_decode_step_matches_the_eager_one(models, prompts):
    # The compiled step pads the cache to COMPILED_COLUMN_MULTIPLE columns and is built once
    # per model: greedy tokens equal transformers' (via the eager test above), log-probs equal
    # a training forward, and a second call with other prompts reuses the compiled graph.
    _, model = models
    eager = generate(
        model, *prompts, GenerationConfig(greedy=True, max_new_tokens=12), torch.Generator()
    )
    config = GenerationConfig(greedy=True, max_new_tokens=12, compile=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = generate(model, *prompts, config, torch.Generator())
    # Each step attends over one more column; one graph serves them all.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1
    assert torch.equal(compiled.packed_input_ids, eager.packed_input_ids)
    assert (compiled.packed_logprobs - eager.packed_logprobs).abs().max() <= 1e-5
    sampled = generate(
        model, *prompts, GenerationConfig(max_new_tokens=12, compile=True),
        torch.Generator().manual_seed(4),
    )  # same rows: a second graph only for the other sampling rule
    assert (sampled.packed_logprobs - forward_logprobs(model, sampled)).abs().max() <= 1e-5
    # Another batch shape (three prompts): one recompile with dynamic shapes, same tokens.
    packed, cu_seqlens = prompts
    fewer = (packed[: int(cu_seqlens[3])], cu_seqlens[:4])
    greedy = GenerationConfig(greedy=True, max_new_tokens=12)
    expected = generate(model, *fewer, greedy, torch.Generator())
    recompiled = generate(model, *fewer, dataclasses.replace(greedy, compile=True), torch.Generator())
    assert torch.equal(recompiled.packed_input_ids, expected.packed_input_ids)
    assert model.compiled_decode_step is not None


def test_compiled_sampling_draws_the_same_tokens_as_eager_sampling(models, prompts):
    # Token choice runs inside the compiled step, from uniforms drawn before the loop: with
    # temperature, top-k, top-p, a stop token masked until min_new_tokens and the sampled
    # distribution's log-probs, the same seed gives the same tokens either way.
    _, model = models
    config = GenerationConfig(
        n=2,
        max_new_tokens=10,
        min_new_tokens=4,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        stop_token_ids=[_frequent_token(model, prompts)],
        return_sampling_logprobs=True,
    )
    eager = generate(model, *prompts, config, torch.Generator().manual_seed(11))
    compiled_config = dataclasses.replace(config, compile=True)
    compiled = generate(model, *prompts, compiled_config, torch.Generator().manual_seed(11))
    assert torch.equal(compiled.packed_input_ids, eager.packed_input_ids)
    assert torch.equal(compiled.response_lens, eager.response_lens)
    assert (compiled.packed_logprobs - eager.packed_logprobs).abs().max() <= 1e-5
    difference = compiled.packed_sampling_logprobs - eager.packed_sampling_logprobs
    assert difference.abs().max() <= 1e-5
    assert int(eager.response_lens.min()) >= 4


def test_the_features_first_cpu_decode_block_equals_the_block_forward(models):
    # CPU decode steps keep activations [features, rows]; GPUs and tensor-parallel shards run
    # `Block.forward` on [rows, features]. Same block, same inputs: the same outputs.
    _, model = models
    rows, config = 6, model.config
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, config.hidden_size, generator=generator)
    model.rotary.ensure_capacity(32, model.device)
    cos, sin = model.rotary.lookup(torch.randint(0, 32, (rows,), generator=generator), model.dtype)
    seen = {}

    def attend(layer_index, query, key, value):
        seen.setdefault("shapes", []).append((query.shape, key.shape, value.shape))
        group = query.shape[1] // key.shape[1]
        return query * key.repeat_interleave(group, 1).sigmoid() + value.repeat_interleave(group, 1)

    block = model.layers[1]
    with torch.no_grad():
        expected = block(hidden, cos, sin, attend)
        features_first = _features_first_block(block, hidden.t(), cos, sin, attend)
    assert features_first.shape == (config.hidden_size, rows)
    assert seen["shapes"][0] == seen["shapes"][1]
    assert (features_first.t() - expected).abs().max() <= 1e-5


def test_compiled_decode_without_a_cpp_compiler_says_what_to_do(tmp_path):
    # A fresh process with no working C++ compiler and an empty inductor cache (so nothing
    # compiled earlier is reused): the error names the key and both fixes.
    script = textwrap.dedent(
        f"""
        import torch
        from tiny_hf_models import save_hf
        from realrl.models.checkpoint import load_pretrained
        from realrl.models.generation import GenerationConfig, generate

        save_hf({str(tmp_path / "model")!r}, "qwen2", eos_token_id=3)
        model = load_pretrained({str(tmp_path / "model")!r})
        prompts, cu_seqlens = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 4], dtype=torch.int32)
        config = GenerationConfig(max_new_tokens=4, compile=True)
        generate(model, prompts, cu_seqlens, config, torch.Generator().manual_seed(0))
        """
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "gen.compile=true: torch.compile could not build the decode step" in result.stderr
    assert "set gen.compile=false" in result.stderr
