"""Building blocks of the packed transformer: the layer factory, RMSNorm and rotary embeddings.

Every weight-holding linear or embedding layer of `Transformer` is made by a `LayerFactory`.
The plain factory below makes ordinary `nn.Linear` / `nn.Embedding`; the tensor-parallel
factory (`realrl.models.megatron_layers`) makes megatron-core's column/row-parallel layers on
an explicit process group. The model asks the factory how many ranks share a layer
(`tp_size`) to size its local heads, and reads log-probabilities and entropies off its LM head
weight (full vocabulary here, one vocabulary slice per rank there) reduced over the factory's
`process_group` (`realrl.models.lm_head`).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from realrl.models.config import ModelConfig

LinearKind = Literal["column", "row", "replicated"]


class LayerFactory(Protocol):
    """Makes the weight-holding layers; `kind` says how a tensor-parallel version splits them.

    `column`: output features split across ranks, output stays split.
    `row`: input features split, outputs summed across ranks.
    `replicated`: every rank holds the whole layer.
    `lm_head`: the LM head, split over the vocabulary. Called as
    `lm_head(hidden, tied_weight, gather_vocab)`; with `tied` it owns no weight and multiplies
    by `tied_weight` (the embedding matrix). None: the single-device tied head, which is
    `F.linear(hidden, embedding.weight)`.
    `sequence_parallel`: the column/row-parallel layers take/return token-split activations;
    such a factory also has `scatter_sequence` / `gather_sequence` (`Transformer` calls them).
    `process_group`: the ranks sharing the layers (None on one device); the fused LM head's
    log-softmax reduces the vocabulary slices over it.
    """

    tp_size: int
    sequence_parallel: bool
    process_group: dist.ProcessGroup | None

    def linear(
        self, in_features: int, out_features: int, bias: bool, kind: LinearKind
    ) -> nn.Module: ...

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module: ...

    def lm_head(self, in_features: int, vocab_size: int, tied: bool) -> nn.Module | None: ...


class PlainLayerFactory:
    """Single-device layers; the logits hold the whole vocabulary."""

    tp_size = 1
    sequence_parallel = False
    process_group = None

    def linear(
        self, in_features: int, out_features: int, bias: bool, kind: LinearKind
    ) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, embedding_dim)

    def lm_head(self, in_features: int, vocab_size: int, tied: bool) -> nn.Module | None:
        return None if tied else nn.Linear(in_features, vocab_size, bias=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back before the weight, as Llama does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.eps)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm`'s math as a function of its weight [hidden] (compiled blocks pass weights)."""
    normed = F.rms_norm(hidden.float(), weight.shape, eps=eps)
    return weight * normed.to(hidden.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] of rotary embeddings, incl. Llama-3 scaling.

    Llama 3 ("llama3" rope type, Meta's Llama 3.1 report, section on long context) keeps high
    frequencies, divides low frequencies by `factor`, and interpolates smoothly in between.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inverse_frequencies = 1.0 / (config.rope_theta**exponents)  # [head_dim / 2]
    rope_type = config.rope_type
    if rope_type == "default":
        return inverse_frequencies
    scaling = config.rope_scaling or {}
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inverse_frequencies / factor
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inverse_frequencies
    scaled = torch.where(
        wavelen > low_freq_wavelen, inverse_frequencies / factor, inverse_frequencies
    )
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin [positions, head_dim] of every position up to a capacity that grows on demand.

    Deliberately not module buffers: `model.to(torch.bfloat16)` must not round the fp32
    frequencies (HF computes the angles in fp32 and casts only cos/sin).
    """

    def __init__(self, config: ModelConfig) -> None:
        self.inverse_frequencies = rope_inverse_frequencies(config)  # [head_dim / 2] fp32
        self.cos_table = torch.empty(0, device="cpu")
        self.sin_table = torch.empty(0, device="cpu")

    def ensure_capacity(self, num_positions: int, device: torch.device) -> None:
        if self.cos_table.shape[0] >= num_positions and self.cos_table.device == device:
            return
        capacity = max(num_positions, 2 * self.cos_table.shape[0], 256)
        inverse_frequencies = self.inverse_frequencies.to(device)
        positions = torch.arange(capacity, device=device, dtype=torch.float32)
        angles = positions[:, None] * inverse_frequencies[None, :]  # [positions, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)  # [positions, head_dim]
        self.cos_table = angles.cos()
        self.sin_table = angles.sin()

    def lookup(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*position_ids.shape, 1, head_dim] in `dtype`, ready to broadcast over heads.

        The caller must have called `ensure_capacity` beyond the largest position (done once
        per forward, outside any hot loop, so no host sync happens here).
        """
        cos = self.cos_table[position_ids].to(dtype).unsqueeze(-2)
        sin = self.sin_table[position_ids].to(dtype).unsqueeze(-2)
        return cos, sin


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., heads, head_dim] by the position angles (rotate-half convention of HF)."""
    half = states.shape[-1] // 2
    rotated_half = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated_half * sin


def split_rotated_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection [..., (heads + 2 * kv_heads) * head_dim] -> rotated query
    [..., heads, head_dim], rotated key and value [..., kv_heads, head_dim].

    `qk_norm` (Qwen3): the query norm's and key norm's weights [head_dim] and their eps; each
    head's query and key are RMS-normalised over head_dim before the rotation, as transformers'
    `Qwen3Attention` does.

    One split, not slices: its backward is one cat, where each slice's backward fills a zero
    tensor the size of qkv and adds into it.
    """
    qkv = qkv.unflatten(-1, (num_heads + 2 * num_kv_heads, -1))
    query_key, value = qkv.split([num_heads + num_kv_heads, num_kv_heads], -2)
    if qk_norm is not None:
        query_weight, key_weight, eps = qk_norm
        query, key = query_key.split([num_heads, num_kv_heads], -2)
        query_key = torch.cat([rms_norm(query, query_weight, eps), rms_norm(key, key_weight, eps)],
                              dim=-2)
    query, key = apply_rotary(query_key, cos, sin).split([num_heads, num_kv_heads], -2)
    return query, key, value
