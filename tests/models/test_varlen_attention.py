"""Packed causal attention kernels against a naive per-sequence reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from realrl.models.attention import PackedLayout, varlen_attention


def reference_attention(query, key, value, lengths, sliding_window=None):
    """Loops over sequences and heads with explicit softmax(q k^T / sqrt(d)) v."""
    groups = query.shape[1] // key.shape[1]
    outputs, start = [], 0
    for length in lengths:
        end = start + length
        q = query[start:end].transpose(0, 1)  # [heads, length, dim]
        k = key[start:end].transpose(0, 1).repeat_interleave(groups, 0)
        v = value[start:end].transpose(0, 1).repeat_interleave(groups, 0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        allowed = j <= i
        if sliding_window is not None:
            allowed &= j > i - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
        start = end
    return torch.cat(outputs)


# `padded` runs matmul attention up to MATMUL_ATTENTION_MAX_SEQLEN tokens and SDPA beyond.
SHORT_AND_LONG = [[4, 1, 9, 6], [70, 3, 66]]


@pytest.mark.parametrize("kernel", ["auto", "padded", "per_sequence", "block_diagonal"])
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("lengths", SHORT_AND_LONG, ids=["short", "long"])
def test_kernels_match_reference_with_grouped_heads(kernel, sliding_window, lengths):
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    query = torch.randn(total, 4, 8, generator=generator)
    key = torch.randn(total, 2, 8, generator=generator)
    value = torch.randn(total, 2, 8, generator=generator)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    layout = PackedLayout.from_cu_seqlens(cu_seqlens)
    out = varlen_attention(query, key, value, layout, sliding_window, kernel)
    expected = reference_attention(query, key, value, lengths, sliding_window)
    assert (out - expected).abs().max() <= 1e-5


def test_layout_rejects_empty_or_decreasing_sequences():
    with pytest.raises(ValueError, match="strictly increasing"):
        PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 3, 5]))


def test_unknown_kernel_lists_the_choices():
    layout = PackedLayout.from_cu_seqlens(torch.tensor([0, 2]))
    x = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="per_sequence"):
        varlen_attention(x, x, x, layout, kernel="magic")


@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("length", [5, 66], ids=["short", "long"])
def test_padded_kernel_on_equal_lengths_matches_per_sequence_with_gradients(sliding_window, length):
    # Equal lengths take the view path (no scatter/gather); values and gradients must not change.
    generator = torch.Generator().manual_seed(1)
    lengths = [length] * 3
    inputs = [torch.randn(3 * length, heads, 8, generator=generator) for heads in (4, 2, 2)]
    layout = PackedLayout.from_cu_seqlens(torch.arange(0, 3 * length + 1, length, dtype=torch.int32))
    results = {}
    for kernel in ("padded", "per_sequence"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = varlen_attention(*leaves, layout, sliding_window, kernel)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        results[kernel] = (out, [leaf.grad for leaf in leaves])
    expected = reference_attention(*inputs, lengths, sliding_window)
    assert (results["padded"][0] - expected).abs().max() <= 1e-5
    for padded_grad, sequence_grad in zip(results["padded"][1], results["per_sequence"][1]):
        assert (padded_grad - sequence_grad).abs().max() <= 1e-5
