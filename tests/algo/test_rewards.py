"""Reward shaping and the DAPO filters, by hand."""

import pytest
import torch

from realrl.algo.layout import response_mask
from realrl.algo.rewards import (
    dynamic_sampling_filter,
    mask_no_eos_with_zero,
    mask_truncated_from_loss,
    overlong_reward_penalty,
    scale_rewards,
)


def test_scale_rewards_subtracts_bias_scales_then_clips():
    # (2 - 0.5) * 2 = 3; (-3 - 0.5) * 2 = -7 -> clip -3; (0.5 - 0.5) * 2 = 0
    out = scale_rewards(torch.tensor([2.0, -3.0, 0.5]), 2.0, 0.5, 3.0)
    torch.testing.assert_close(out, torch.tensor([3.0, -3.0, 0.0]))
    torch.testing.assert_close(
        scale_rewards(torch.tensor([2.0, -3.0]), 2.0, 0.5, None), torch.tensor([3.0, -7.0])
    )
    with pytest.raises(ValueError, match="reward_clip"):
        scale_rewards(torch.tensor([1.0]), reward_clip=0.0)


def test_mask_no_eos_with_zero_zeroes_truncated_rewards():
    out = mask_no_eos_with_zero(torch.tensor([1.0, 0.5]), torch.tensor([True, False]))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5]))


def test_truncated_sequences_are_removed_from_the_loss_mask():
    # seq 0 (truncated): prompt 1 + response 2 -> entries [T, T] -> [F, F]
    # seq 1 (EOS): prompt 2 + response 1 -> entries [F, T] unchanged
    mask = response_mask(torch.tensor([1, 2]), torch.tensor([3, 3]))
    out = mask_truncated_from_loss(mask, torch.tensor([True, False]), torch.tensor([0, 3, 6]))
    assert out.tolist() == [False, False, False, True]


def test_overlong_penalty_is_linear_inside_the_buffer():
    # max 20, buffer 5 -> free up to 15; 16 -> -1/5; 18 -> -3/5; 20 and beyond -> -1
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    out = overlong_reward_penalty(
        lengths, max_response_len=20, overlong_buffer_len=5, overlong_penalty_factor=1.0
    )
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]))
    half = overlong_reward_penalty(torch.tensor([18]), 20, 5, 0.5)  # -3/5 * 0.5
    torch.testing.assert_close(half, torch.tensor([-0.3]))
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty(lengths, 20, 0, 1.0)


def test_dynamic_sampling_keeps_only_groups_with_differing_rewards():
    # group 3: [1, 0] differs -> keep; group 1: [1, 1, 1] equal; group 8: single; group 5: [0, 0]
    group_ids = torch.tensor([3, 3, 1, 1, 1, 8, 5, 5])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    result = dynamic_sampling_filter(group_ids, rewards)
    assert result.keep_sequence.tolist() == [True, True] + [False] * 6
    assert result.kept_group_ids.tolist() == [3]
    assert result.dropped_group_ids.tolist() == [1, 5, 8]
    # a tolerance treats nearly-equal rewards as equal: group 3 spread is 1.0
    assert not dynamic_sampling_filter(group_ids, rewards, tolerance=1.0).keep_sequence.any()
