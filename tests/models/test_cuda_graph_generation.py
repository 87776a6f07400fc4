"""The static-shape decode steps that `generate` captures as CUDA graphs.

On CPU the same steps run without capture (`_generate(..., static_steps=True)`): they must
give exactly the tokens, and the log-probs within fp32 rounding, of the decode path every other
test checks against transformers and a training forward. The `gpu` tests capture and replay
them on CUDA: parity with transformers, log-probs against a forward, captures counted per
bucket, and weights updated in place or reallocated between calls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_generation_engine import (
    EOS,
    PROMPT_LENGTHS,
    _frequent_token,
    forward_logprobs,
    responses,
    split_sequences,
)
from tiny_hf_models import random_packed_batch, save_hf

from realrl.models.checkpoint import load_pretrained
from realrl.models.cuda_graphs import (
    attended_columns,
    release_decode_graphs,
    row_bucket,
    state_columns,
)
from realrl.models.generation import GenerationConfig, _generate, generate, uses_cuda_graphs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    hf_model = save_hf(directory, "qwen2", eos_token_id=EOS)
    return hf_model, load_pretrained(directory), directory


@pytest.fixture
def prompts():
    _, packed, cu_seqlens = random_packed_batch(PROMPT_LENGTHS, 96, seed=5)
    return packed.clamp_min(4), cu_seqlens  # prompts never contain EOS or the stop tokens


def assert_same_generation(static, dynamic, tolerance=1e-5):
    assert torch.equal(static.packed_input_ids, dynamic.packed_input_ids)
    assert torch.equal(static.cu_seqlens, dynamic.cu_seqlens)
    assert torch.equal(static.response_lens, dynamic.response_lens)
    assert torch.equal(static.no_eos, dynamic.no_eos)
    assert (static.packed_logprobs - dynamic.packed_logprobs).abs().max() <= tolerance
    if dynamic.packed_sampling_logprobs is not None:
        difference = static.packed_sampling_logprobs - dynamic.packed_sampling_logprobs
        assert difference.abs().max() <= tolerance


# bf16 greedy rule: two bf16 runs agree token for token, or up to a first differing token whose
# two candidates have fp32 logits (after the shared prefix) within this many nats of each other:
# a near-tie that another bf16 rounding order may flip, after which the sequences diverge.
NEAR_TIE_LOGITS = 0.05


def assert_equal_until_a_near_tie(ours, theirs, fp32_model):
    """Greedy outputs `ours` and `theirs` of the same prompts (see `NEAR_TIE_LOGITS`)."""
    for row, (mine, other) in enumerate(zip(responses(ours), responses(theirs))):
        shared = min(len(mine), len(other))  # an EOS in one run is a differing token there
        differing = (mine[:shared] != other[:shared]).nonzero()
        if len(differing) == 0:
            assert len(mine) == len(other)
            continue
        first = int(differing[0])
        prefix = split_sequences(theirs)[row][: int(theirs.prompt_lens[row]) + first]
        cu_seqlens = torch.tensor([0, len(prefix)], dtype=torch.int32, device=prefix.device)
        with torch.no_grad():
            logits = fp32_model(prefix, cu_seqlens)[-1].float()
        assert (logits[mine[first]] - logits[other[first]]).abs() <= NEAR_TIE_LOGITS


def both_paths(model, prompts, config, seed):
    """(static steps, the dynamic path) with the same seed."""
    return tuple(
        _generate(model, *prompts, config, torch.Generator().manual_seed(seed), static)
        for static in (True, False)
    )


def test_row_and_column_buckets():
    # Powers of two up to 64 rows, then multiples of 64: 12 -> 16, 65 -> 128, 130 -> 192.
    assert [row_bucket(n) for n in (1, 2, 3, 12, 64, 65, 130, 512)] == [
        1, 2, 4, 16, 64, 128, 192, 512
    ]
    # Writing column 40 needs 41 columns: the next multiple of 32 is 64.
    assert [attended_columns(c) for c in (0, 31, 32, 40, 127)] == [32, 32, 64, 64, 128]
    # Calls writing columns < 49 attend over at most 64 columns; the cache holds one block more.
    assert [state_columns(n) for n in (1, 32, 33, 49)] == [64, 64, 96, 96]


def test_static_greedy_steps_equal_the_dynamic_path(models, prompts):
    _, model, _ = models
    static, dynamic = both_paths(model, prompts, GenerationConfig(greedy=True, max_new_tokens=40), 0)
    assert_same_generation(static, dynamic)
    assert static.response_lens.tolist() == [40] * len(PROMPT_LENGTHS)  # two attended blocks


def test_static_sampled_steps_with_stops_and_n_equal_the_dynamic_path(models, prompts):
    # 4 prompts of 2-9 tokens x n=3 = 12 rows in a 16-row state (4 padding rows); temperature,
    # top-k, top-p, a stop token masked until min_new_tokens, sampled-distribution log-probs.
    _, model, _ = models
    config = GenerationConfig(
        n=3,
        max_new_tokens=40,
        min_new_tokens=3,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        stop_token_ids=[_frequent_token(model, prompts)],
        return_sampling_logprobs=True,
        check_done_every=1,
    )
    static, dynamic = both_paths(model, prompts, config, 11)
    assert_same_generation(static, dynamic)
    lengths = static.response_lens.tolist()
    assert min(lengths) >= 3 and len(set(lengths)) > 3  # rows finish at different steps
    assert int(static.no_eos.sum()) < len(lengths)
    assert (static.packed_logprobs - forward_logprobs(model, static)).abs().max() <= 1e-5


def test_static_plain_sampling_equals_the_dynamic_path(models, prompts):
    _, model, _ = models
    config = GenerationConfig(n=2, max_new_tokens=12)
    assert_same_generation(*both_paths(model, prompts, config, 3))


def test_static_steps_stop_early_once_every_row_has_finished(models):
    _, model, _ = models
    with torch.no_grad():
        model.lm_head.weight[EOS] += 100.0  # EOS is the greedy choice everywhere
    try:
        prompts = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 2, 5], dtype=torch.int32)
        config = GenerationConfig(greedy=True, max_new_tokens=30)
        output = _generate(model, *prompts, config, torch.Generator(), True)
    finally:
        with torch.no_grad():
            model.lm_head.weight[EOS] -= 100.0
    assert output.packed_input_ids.tolist() == [5, 6, EOS, 7, 8, 9, EOS]
    assert output.no_eos.tolist() == [False, False]


def test_static_steps_honour_the_mistral_sliding_window(tmp_path, prompts):
    # The window masks columns of a prefix that is longer than the window.
    save_hf(tmp_path, "mistral", sliding_window=4, eos_token_id=EOS)
    model = load_pretrained(tmp_path)
    config = GenerationConfig(greedy=True, max_new_tokens=36)
    assert_same_generation(*both_paths(model, prompts, config, 0))


def test_static_steps_in_bfloat16_match_the_dynamic_path(models, prompts):
    # In bf16 the static step (rows-first matmuls, attention over a masked prefix) rounds in
    # another order than the CPU's features-first step: equal up to a near-tie; log-probs
    # within the bf16 tolerance of a forward.
    _, fp32_model, directory = models
    model = load_pretrained(directory, dtype=torch.bfloat16)
    config = GenerationConfig(greedy=True, max_new_tokens=12)
    static, dynamic = both_paths(model, prompts, config, 0)
    assert_equal_until_a_near_tie(static, dynamic, fp32_model)
    assert (static.packed_logprobs - forward_logprobs(model, static)).abs().max() <= 0.1


@pytest.mark.slow
def test_compiled_static_step_equals_the_eager_static_step(models, prompts):
    # What `gen.compile=true` captures on CUDA: dynamo traces the in-place step over the state,
    # once (dynamic shapes) for both attended prefixes (32 and 64 columns) and every row count.
    _, model, _ = models
    config = GenerationConfig(n=2, max_new_tokens=40, top_p=0.9, return_sampling_logprobs=True)
    eager = _generate(model, *prompts, config, torch.Generator().manual_seed(5), True)
    compiled_config = dataclasses.replace(config, compile=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _generate(model, *prompts, compiled_config, torch.Generator().manual_seed(5), True)
    assert_same_generation(compiled, eager)
    more_rows = dataclasses.replace(compiled_config, n=5)  # 20 rows in a 32-row state
    _generate(model, *prompts, more_rows, torch.Generator().manual_seed(5), True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1


def test_cpu_generation_never_uses_graphs(models):
    _, model, _ = models
    assert not uses_cuda_graphs(model, GenerationConfig())


# ---------------------------------------------------------------------------------- CUDA


def cuda_model(directory, dtype=torch.float32):
    return load_pretrained(directory, dtype=dtype, device="cuda")


def cuda_generate(model, prompts, config, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return generate(model, prompts[0].cuda(), prompts[1].cuda(), config, generator)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_greedy_generation_equals_transformers_in_fp32(models, prompts):
    hf_model, _, directory = models
    model = cuda_model(directory)
    config = GenerationConfig(greedy=True, max_new_tokens=40)
    assert uses_cuda_graphs(model, config)
    output = cuda_generate(model, prompts, config)
    assert model.decode_graphs.captures > 0
    packed, _ = prompts
    hf_cuda = hf_model.cuda()
    try:
        for prompt, sequence in zip(packed.split(PROMPT_LENGTHS), split_sequences(output)):
            with torch.no_grad():
                expected = hf_cuda.generate(
                    prompt[None].cuda(), max_new_tokens=40, do_sample=False, pad_token_id=0
                )[0]
            assert sequence.tolist() == expected.tolist()
    finally:
        hf_model.cpu()


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_bfloat16_greedy_tokens_match_eager_until_a_near_tie(models, prompts):
    # bf16: graphs and eager CUDA decoding agree by `assert_equal_until_a_near_tie`.
    _, _, directory = models
    model = cuda_model(directory, torch.bfloat16)
    config = GenerationConfig(greedy=True, max_new_tokens=24)
    graphs = cuda_generate(model, prompts, config)
    eager = cuda_generate(model, prompts, dataclasses.replace(config, cuda_graphs=False))
    assert_equal_until_a_near_tie(graphs, eager, cuda_model(directory))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_sampled_log_probs_match_a_bfloat16_forward(models, prompts):
    _, model_cpu, directory = models
    model = cuda_model(directory, torch.bfloat16)
    stop = _frequent_token(model_cpu, prompts)
    config = GenerationConfig(n=3, max_new_tokens=40, top_p=0.95, stop_token_ids=[stop])
    output = cuda_generate(model, prompts, config, seed=2)
    # bf16 tolerance: 0.1 nats, as for the eager bf16 paths.
    assert (output.packed_logprobs - forward_logprobs(model, output)).abs().max() <= 0.1


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_are_captured_once_per_bucket_and_match_eager_steps(models, prompts):
    _, _, directory = models
    model = cuda_model(directory)
    config = GenerationConfig(n=2, max_new_tokens=40, temperature=0.9)
    first = cuda_generate(model, prompts, config, seed=4)
    captures = model.decode_graphs.captures
    second = cuda_generate(model, prompts, config, seed=5)
    assert model.decode_graphs.captures == captures  # same bucket: replayed, not recaptured
    eager = cuda_generate(model, prompts, dataclasses.replace(config, cuda_graphs=False), seed=5)
    assert_same_generation(second, eager)
    assert not torch.equal(first.packed_input_ids, second.packed_input_ids)
    more_rows = dataclasses.replace(config, n=5)  # 4 x 5 = 20 rows: the 32-row bucket, not 8
    cuda_generate(model, prompts, more_rows, seed=6)
    assert model.decode_graphs.captures > captures
    assert sorted(model.decode_graphs.buckets) == [8, 32]


def perturbed(parameter: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    noise = torch.randn(parameter.shape, generator=generator, device="cuda")
    return parameter + 0.05 * noise * parameter.abs().mean()


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_see_weights_changed_in_place_and_recapture_reallocated_ones(
    models, prompts
):
    # Graphs read the weights at their captured addresses. In place (an optimizer step): the
    # next replay decodes with the new values, like eager steps, without a capture. A
    # reallocated parameter: every graph is captured again (a stale graph would read the freed
    # old storage and differ from the eager steps).
    _, _, directory = models
    model = cuda_model(directory)
    config = GenerationConfig(greedy=True, max_new_tokens=24)
    eager_config = dataclasses.replace(config, cuda_graphs=False)
    before = cuda_generate(model, prompts, config)
    captures = model.decode_graphs.captures
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            parameter.copy_(perturbed(parameter, index))
    in_place = cuda_generate(model, prompts, config)
    assert model.decode_graphs.captures == captures
    assert not torch.equal(in_place.packed_input_ids, before.packed_input_ids)
    assert_same_generation(in_place, cuda_generate(model, prompts, eager_config))
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            parameter.data = perturbed(parameter, 100 + index)  # new values, new addresses
    reallocated = cuda_generate(model, prompts, config)
    assert model.decode_graphs.captures > captures
    assert not torch.equal(reallocated.packed_input_ids, in_place.packed_input_ids)
    assert_same_generation(reallocated, cuda_generate(model, prompts, eager_config))


@pytest.mark.gpu
@needs_cuda
def test_releasing_the_decode_graphs_frees_their_cache(models, prompts):
    _, _, directory = models
    model = cuda_model(directory)
    config = GenerationConfig(n=8, max_new_tokens=16)
    first = cuda_generate(model, prompts, config, seed=1)
    held = torch.cuda.memory_allocated()
    release_decode_graphs(model)
    assert torch.cuda.memory_allocated() < held
    again = cuda_generate(model, prompts, config, seed=1)  # allocates and captures anew
    assert_same_generation(again, first)


@pytest.mark.gpu
@needs_cuda
def test_compiled_cuda_graph_steps_match_the_eager_graph_steps(models, prompts):
    _, _, directory = models
    model = cuda_model(directory)
    config = GenerationConfig(n=2, max_new_tokens=24, return_sampling_logprobs=True)
    graphs = cuda_generate(model, prompts, config, seed=8)
    compiled = cuda_generate(model, prompts, dataclasses.replace(config, compile=True), seed=8)
    assert_same_generation(compiled, graphs)


@pytest.mark.gpu
@needs_cuda
def test_a_train_step_frees_the_graphs_kv_caches_and_generation_captures_again(models, prompts):
    """One GPU, actor colocated: the captured state is released before training (its memory
    goes back to the allocator's free pool), and the next call captures anew, same tokens."""
    from realrl.api.experiment import OptimizerConfig
    from realrl.backends.torch_engine import ParallelContext, TorchEngine

    _, _, directory = models
    engine = TorchEngine(cuda_model(directory), None, ParallelContext(), OptimizerConfig(lr=0.0))
    config = GenerationConfig(greedy=True, max_new_tokens=40)
    ids, cu = prompts[0].cuda(), prompts[1].cuda()

    def train():
        engine.train_microbatches([None], lambda forward, _: (forward(ids, cu).square().mean(),
                                                              {}))

    train()  # the optimizer state and gradients exist from here on
    first = cuda_generate(engine.module, prompts, config)
    held = torch.cuda.memory_allocated()
    train()
    assert engine.module.decode_graphs is None
    assert torch.cuda.memory_allocated() < held
    again = cuda_generate(engine.module, prompts, config)  # lr 0: the same weights
    assert engine.module.decode_graphs.captures > 0
    assert torch.equal(again.packed_input_ids, first.packed_input_ids)
