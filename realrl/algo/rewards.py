"""Processing of sequence-level task rewards before they become token rewards.

Order used by the actor interface (each step optional, see docs/algorithms.md):

1. `overlong_reward_penalty` added to the raw reward (DAPO soft overlong punishment);
2. `mask_no_eos_with_zero` (truncated answers score 0);
3. `scale_rewards`: ``clip((r - reward_bias) * reward_scaling, -reward_clip, reward_clip)``;
4. `realrl.algo.kl.kl_penalized_token_rewards` spreads them over tokens.

`mask_truncated_from_loss` and `dynamic_sampling_filter` decide which sequences train at all.
All functions are pure: ``[num_seqs]`` tensors in, new tensors out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from realrl.algo.layout import broadcast_to_tokens


def scale_rewards(
    rewards: torch.Tensor,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float | None = None,
) -> torch.Tensor:
    """``clip((r - reward_bias) * reward_scaling, -reward_clip, reward_clip)``, ``[num_seqs]``.

    The bias is *subtracted* (ReaLHF/AReaL's ``reward_output_bias`` convention), then scaled,
    then clipped symmetrically; ``reward_clip=None`` disables clipping.
    """
    if reward_clip is not None and reward_clip <= 0:
        raise ValueError(f"ppo.reward_clip must be positive or None, got {reward_clip}")
    out = (rewards.float() - reward_bias) * reward_scaling
    if reward_clip is not None:
        out = out.clamp(-reward_clip, reward_clip)
    return out


def mask_no_eos_with_zero(rewards: torch.Tensor, seq_no_eos: torch.Tensor) -> torch.Tensor:
    """Reward 0 for sequences that hit the length limit without EOS (``ppo.mask_no_eos_with_zero``).

    A truncated answer is usually unfinished; scoring it would reward whatever prefix happens to
    match. ``seq_no_eos [num_seqs]`` is True for truncated sequences.
    """
    return torch.where(seq_no_eos.bool(), torch.zeros_like(rewards), rewards)


def mask_truncated_from_loss(
    loss_mask: torch.Tensor, seq_no_eos: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Loss mask ``[total_tokens - num_seqs]`` with truncated sequences removed entirely.

    DAPO's "overlong filtering" (Yu et al. 2025, section 3.4): truncated samples neither reward
    nor punish, they do not train. ``ppo.mask_too_long`` selects this.
    """
    keep = broadcast_to_tokens(~seq_no_eos.bool(), cu_seqlens)
    return loss_mask.bool() & keep


def overlong_reward_penalty(
    response_lens: torch.Tensor,
    max_response_len: int,
    overlong_buffer_len: int,
    overlong_penalty_factor: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. (13)), ``[num_seqs]``, values <= 0.

    With ``L_max = max_response_len`` and buffer ``B``: 0 if ``len <= L_max - B``;
    ``-(len - (L_max - B)) / B * penalty_factor`` inside the buffer; ``-penalty_factor`` at and
    beyond ``L_max``. Added to the task reward.
    """
    if overlong_buffer_len <= 0 or overlong_buffer_len > max_response_len:
        raise ValueError(
            f"ppo.overlong_buffer_len must be in (0, max_new_tokens={max_response_len}], "
            f"got {overlong_buffer_len}"
        )
    expected_len = max_response_len - overlong_buffer_len
    excess = (response_lens.float() - expected_len).clamp(min=0, max=overlong_buffer_len)
    return -excess / overlong_buffer_len * overlong_penalty_factor


@dataclass
class DynamicSamplingResult:
    keep_sequence: torch.Tensor  # [num_seqs] bool, True if its group has differing rewards
    kept_group_ids: torch.Tensor  # [num_kept_groups] sorted unique group ids
    dropped_group_ids: torch.Tensor  # [num_dropped_groups]


def dynamic_sampling_filter(
    group_ids: torch.Tensor, rewards: torch.Tensor, tolerance: float = 0.0
) -> DynamicSamplingResult:
    """DAPO dynamic sampling (Yu et al. 2025, eq. (11)): keep groups whose rewards differ.

    A group whose rewards are all equal (max - min <= ``tolerance``) has zero group-relative
    advantage and only dilutes the batch, so it is dropped; a single-sample group is all-equal
    and is dropped too. The caller over-samples and refills until the batch is full.
    """
    unique_ids, dense = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    rewards = rewards.float()
    group_max = torch.full((num_groups,), -torch.inf, device=rewards.device)
    group_max = group_max.scatter_reduce(0, dense, rewards, reduce="amax")
    group_min = torch.full((num_groups,), torch.inf, device=rewards.device)
    group_min = group_min.scatter_reduce(0, dense, rewards, reduce="amin")
    keep_group = (group_max - group_min) > tolerance
    return DynamicSamplingResult(
        keep_sequence=keep_group[dense],
        kept_group_ids=unique_ids[keep_group],
        dropped_group_ids=unique_ids[~keep_group],
    )
