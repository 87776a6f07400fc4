"""realrl's packed transformer against Hugging Face transformers, in both directions."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_hf_models import build_hf_model, hf_logits_per_sequence, random_packed_batch, save_hf
from transformers import AutoModelForCausalLM

from realrl.models.checkpoint import load_pretrained, save_pretrained
from realrl.models.families import to_hf_state_dict

LENGTHS = [7, 1, 19, 12, 3]
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2_untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    # Qwen3: per-head query/key norms, and a head_dim that is not hidden_size / heads (64 / 4)
    "qwen3_untied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    # every layer windowed (max_window_layers=0: transformers windows layers from it on)
    "qwen2_windowed": ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                 "max_window_layers": 0}),
    "llama3_rope_scaling": (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),
}


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_loaded_model_matches_transformers_logits_on_packed_batch(tmp_path, variant):
    model_type, overrides = FAMILIES[variant]
    hf_model = save_hf(tmp_path, model_type, **overrides)
    model = load_pretrained(tmp_path)
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        logits = model(packed, cu_seqlens)
    assert logits.shape == (sum(LENGTHS), model.config.vocab_size)
    assert (logits - hf_logits_per_sequence(hf_model, sequences)).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_saved_model_loads_in_transformers_with_identical_logits(tmp_path, variant):
    model_type, overrides = FAMILIES[variant]
    save_hf(tmp_path / "source", model_type, **overrides)
    model = load_pretrained(tmp_path / "source")
    save_pretrained(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == model_type and config["torch_dtype"] == "float32"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(reloaded).__name__ == config["architectures"][0]
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size, seed=1)
    with torch.no_grad():
        logits = model(packed, cu_seqlens)
    assert (logits - hf_logits_per_sequence(reloaded, sequences)).abs().max() <= 1e-5


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    """Guards the parity test above: the scaling must actually be exercised."""
    _, scaled = FAMILIES["llama3_rope_scaling"]
    save_hf(tmp_path / "plain", "llama", rope_theta=500000.0)
    save_hf(tmp_path / "scaled", "llama", **scaled)
    sequences, packed, cu_seqlens = random_packed_batch([40], 96)
    with torch.no_grad():
        plain = load_pretrained(tmp_path / "plain")(packed, cu_seqlens)
        rescaled = load_pretrained(tmp_path / "scaled")(packed, cu_seqlens)
    assert (plain - rescaled).abs().max() > 1e-3


def test_packed_log_probs_equal_right_padded_transformers_batch(tmp_path):
    hf_model = save_hf(tmp_path, "qwen2")
    model = load_pretrained(tmp_path)
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size, seed=2)
    max_len = max(LENGTHS)
    padded = torch.zeros(len(LENGTHS), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(padded)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = sequence
        attention_mask[row, : len(sequence)] = 1
    with torch.no_grad():
        packed_logprobs = model(packed, cu_seqlens).log_softmax(-1)
        padded_logprobs = hf_model(padded, attention_mask=attention_mask).logits.log_softmax(-1)
    unpadded = padded_logprobs[attention_mask.bool()]  # [total_tokens, vocab], row-major order
    assert (packed_logprobs - unpadded).abs().max() <= 1e-5


@pytest.mark.parametrize("kernel", ["padded", "bucketed", "per_sequence", "block_diagonal"])
def test_every_attention_kernel_gives_the_same_packed_logits(tmp_path, kernel):
    hf_model = save_hf(tmp_path, "llama")
    model = load_pretrained(tmp_path)
    model.attention_kernel = kernel
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size, seed=3)
    with torch.no_grad():
        logits = model(packed, cu_seqlens)
    assert (logits - hf_logits_per_sequence(hf_model, sequences)).abs().max() <= 1e-5


def test_explicit_position_ids_shift_rotary_positions_like_transformers(tmp_path):
    hf_model = save_hf(tmp_path, "llama")
    model = load_pretrained(tmp_path)
    sequences, packed, cu_seqlens = random_packed_batch([6, 4], model.config.vocab_size)
    position_ids = torch.cat([torch.arange(5, 11), torch.arange(20, 24)])
    with torch.no_grad():
        logits = model(packed, cu_seqlens, position_ids)
        expected = torch.cat(
            [
                hf_model(sequences[0][None], position_ids=torch.arange(5, 11)[None]).logits[0],
                hf_model(sequences[1][None], position_ids=torch.arange(20, 24)[None]).logits[0],
            ]
        )
    assert (logits - expected).abs().max() <= 1e-5


def test_mistral_sliding_window_matches_transformers_beyond_the_window(tmp_path):
    hf_model = save_hf(tmp_path, "mistral", sliding_window=4)
    model = load_pretrained(tmp_path)
    assert model.config.sliding_window == 4
    sequences, packed, cu_seqlens = random_packed_batch([11, 3, 9], model.config.vocab_size)
    with torch.no_grad():
        logits = model(packed, cu_seqlens)
    assert (logits - hf_logits_per_sequence(hf_model, sequences)).abs().max() <= 1e-5


@pytest.mark.parametrize("max_window_layers,window", [(0, 4), (2, None)])
def test_qwen_sliding_window_follows_transformers_per_layer_rule(tmp_path, max_window_layers,
                                                                 window):
    # transformers windows the layers from max_window_layers on: all of them, or none
    hf_model = save_hf(tmp_path, "qwen3", use_sliding_window=True, sliding_window=4,
                       max_window_layers=max_window_layers)
    model = load_pretrained(tmp_path)
    assert model.config.sliding_window == window
    sequences, packed, cu_seqlens = random_packed_batch([11, 3, 9], model.config.vocab_size)
    with torch.no_grad():
        logits = model(packed, cu_seqlens)
    assert (logits - hf_logits_per_sequence(hf_model, sequences)).abs().max() <= 1e-5


def test_qwen_windowing_some_layers_only_is_refused(tmp_path):
    save_hf(tmp_path, "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(Exception, match="windows 1 of its 2 layers .* every layer or none"):
        load_pretrained(tmp_path)


def test_hf_named_state_dict_matches_the_transformers_state_dict(tmp_path):
    hf_model = save_hf(tmp_path, "qwen2")
    model = load_pretrained(tmp_path)
    ours = to_hf_state_dict(model)
    theirs = hf_model.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_bfloat16_model_stays_close_to_fp32(tmp_path):
    save_hf(tmp_path, "qwen2")
    full = load_pretrained(tmp_path)
    half = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.embedding.weight.dtype == torch.bfloat16
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, full.config.vocab_size)
    with torch.no_grad():
        difference = (full(packed, cu_seqlens) - half(packed, cu_seqlens).float()).abs().max()
    assert 0 < difference < 0.1


def test_hf_model_builder_perturbs_norms_so_they_matter():
    model = build_hf_model("qwen2")
    assert not torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
