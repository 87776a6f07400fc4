"""Helpers for the model tests: tiny random Hugging Face models built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                  "mistral": MistralConfig}


def build_hf_model(model_type: str, seed: int = 0, **overrides):
    """A random HF causal LM in eval mode, with non-trivial norm weights and biases."""
    torch.manual_seed(seed)
    config = CONFIG_CLASSES[model_type](**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so they matter
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def save_hf(directory, model_type: str, **overrides):
    """Build a tiny HF model, save it to `directory`, return it."""
    model = build_hf_model(model_type, **overrides)
    model.save_pretrained(directory)
    return model


def random_packed_batch(lengths: list[int], vocab_size: int, seed: int = 0):
    """(list of [len] sequences, packed ids [total], cu_seqlens [num_seqs + 1] int32)."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths).cumsum(0)
    return sequences, torch.cat(sequences), cu_seqlens


def hf_logits_per_sequence(hf_model, sequences) -> torch.Tensor:
    """HF logits [total_tokens, vocab] computed one unpadded sequence at a time."""
    with torch.no_grad():
        return torch.cat([hf_model(sequence[None]).logits[0] for sequence in sequences])
