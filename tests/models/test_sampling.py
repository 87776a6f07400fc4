"""Inverse-CDF token selection, one- and two-level: right frequencies, never a masked token."""

from __future__ import annotations

import pytest
import torch

from realrl.models.sampling import TWO_LEVEL_MIN_VOCAB, select_tokens


@pytest.mark.parametrize("vocab", [50, TWO_LEVEL_MIN_VOCAB, 4096])
def test_selected_tokens_follow_the_weights(vocab):
    # 40000 draws from one distribution: every token's frequency within 5 standard errors.
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(vocab, generator=generator) ** 4  # uneven, unnormalised
    weights[: vocab // 2 : 3] = 0.0  # masked tokens, some at block edges
    rows = 40_000
    draws = torch.rand(rows, 1, generator=generator)
    tokens = select_tokens(weights.expand(rows, vocab).contiguous(), draws)
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = weights.double() / weights.sum() * rows
    standard_error = (expected * (1 - expected / rows)).sqrt().clamp_min(1.0)
    assert torch.all((counts - expected).abs() <= 5 * standard_error)
    assert counts[weights == 0].sum() == 0


def test_extreme_draws_never_pick_zero_weight_tokens():
    # Draws of 0 and of the largest float below 1 select the first and the last token with
    # weight, even when a block ends, or the vocabulary ends, with zero-weight tokens.
    vocab = 2 * TWO_LEVEL_MIN_VOCAB
    weights = torch.zeros(2, vocab)
    weights[:, 5] = 1.0  # first token with weight
    weights[:, 1100] = 2.0  # last token with weight; block 8 ends with zeros
    draws = torch.tensor([[0.0], [1.0 - 2**-24]])
    for width in (vocab, 1000):  # two-level and one-level
        tokens = select_tokens(weights[:, :width].contiguous(), draws)
        assert tokens.tolist() == ([5, 1100] if width == vocab else [5, 5])
