"""Packed causal attention kernels against a naive per-sequence reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from realrl.models.attention import PackedLayout, choose_kernel, length_buckets, varlen_attention


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
KERNELS = ["auto", "padded", "bucketed", "per_sequence", "block_diagonal"]


@pytest.mark.parametrize("kernel", KERNELS)
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
    assert_matches_per_sequence_with_gradients("padded", inputs, lengths, layout, sliding_window)


def assert_matches_per_sequence_with_gradients(kernel, inputs, lengths, layout, sliding_window):
    """`kernel`'s output equals the reference and its input gradients `per_sequence`'s."""
    results = {}
    for name in (kernel, "per_sequence"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = varlen_attention(*leaves, layout, sliding_window, name)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        results[name] = (out, [leaf.grad for leaf in leaves])
    expected = reference_attention(*inputs, lengths, sliding_window)
    assert (results[kernel][0] - expected).abs().max() <= 1e-5
    for kernel_grad, sequence_grad in zip(results[kernel][1], results["per_sequence"][1]):
        assert (kernel_grad - sequence_grad).abs().max() <= 1e-5


def test_length_buckets_pad_each_group_to_at_most_twice_its_exact_work():
    # Longest first: 40 takes one 16 (padded 2 x 1600 = 3200 <= 2 x (1600 + 256) = 3712) but
    # not a second (3 x 1600 = 4800 > 2 x 2112 = 4224); 16, 12, 9 pad within twice (768 <= 962).
    assert length_buckets([16, 40, 16, 12, 9]) == [[1, 0], [2, 3, 4]]
    # All within twice the exact work: one bucket, longest first.
    assert length_buckets([10, 12, 9]) == [[1, 0, 2]]
    # Longer than 64 tokens: a bucket of its own, whatever the padding.
    assert length_buckets([65, 65, 3]) == [[0], [1], [2]]


def test_auto_buckets_a_batch_that_one_outlier_would_pad():
    def picked(lengths):
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        return choose_kernel("auto", torch.empty(sum(lengths), 1, 1),
                             PackedLayout.from_cu_seqlens(cu_seqlens))

    assert picked([12] * 20 + [13] * 20) == "padded"
    assert picked([12] * 39 + [40]) == "bucketed"  # padded: 40 x 1600 > 2 x 7216
    assert picked([300, 200, 100]) == "per_sequence"  # every bucket one sequence
    assert picked([300] + [16] * 31) == "bucketed"


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_bucketed_kernel_matches_per_sequence_with_gradients(sliding_window):
    # Buckets of unequal lengths (scatter path), equal lengths (view path) and a lone long
    # sequence, interleaved in packed order.
    lengths = [5, 40, 5, 70, 12, 5]
    generator = torch.Generator().manual_seed(2)
    total = sum(lengths)
    inputs = [torch.randn(total, heads, 8, generator=generator) for heads in (4, 2, 2)]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    layout = PackedLayout.from_cu_seqlens(cu_seqlens)
    assert layout.ensure_buckets() == [[3], [1, 4], [0, 2, 5]]
    assert_matches_per_sequence_with_gradients("bucketed", inputs, lengths, layout, sliding_window)
