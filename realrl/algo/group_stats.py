"""Building blocks of the advantage estimators: discounted sums, group baselines, whitening.

All functions take and return packed tensors (see `realrl.algo.layout`) and never need a
gradient: advantages and returns are targets, so inputs are detached and computed in float32
(group statistics in float64).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.algo.distributed_stats import masked_moments
from realrl.algo.layout import positions_in_segment, segment_ids, sequence_lengths


def discounted_reverse_cumsum(
    values: torch.Tensor, segment_cu_seqlens: torch.Tensor, discount: float
) -> torch.Tensor:
    """``out[j] = sum_{k >= j, same segment} discount^(k - j) * values[k]``, ``[total]``.

    The recursion ``out[j] = values[j] + discount * out[j + 1]`` runs backwards over time steps,
    vectorised across segments: ``max_len`` small vector operations, no loop over sequences, and
    no powers of ``discount`` that could underflow on long sequences.
    """
    values = values.detach().float()
    lengths = sequence_lengths(segment_cu_seqlens)
    if values.numel() == 0:
        return values.clone()
    max_len = int(lengths.max())
    ids = segment_ids(segment_cu_seqlens)
    positions = positions_in_segment(segment_cu_seqlens)
    # [max_len + 1, num_segments]; the extra zero row is the "after the end" term.
    time_major = torch.zeros(
        max_len + 1, lengths.numel(), dtype=torch.float32, device=values.device
    )
    time_major[positions, ids] = values
    for step in range(max_len - 1, -1, -1):
        time_major[step] += discount * time_major[step + 1]
    return time_major[positions, ids]


def _dense_group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, dense = torch.unique(group_ids, return_inverse=True)
    num_groups = int(dense.max()) + 1 if dense.numel() else 0
    return dense, num_groups


def group_mean_and_count(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (mean of its group, size of its group), both ``[num_seqs]`` float64."""
    scores = scores.detach().double()
    dense, num_groups = _dense_group_index(group_ids)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    counts = counts.index_add(0, dense, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add(0, dense, scores)
    return (sums / counts)[dense], counts[dense]


def group_std(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence *unbiased* (Bessel, n - 1) std of its group, ``[num_seqs]`` float64.

    A single-sample group has std 0 (not NaN). Computed from deviations, not E[x^2] - E[x]^2.
    """
    scores = scores.detach().double()
    dense, num_groups = _dense_group_index(group_ids)
    means, counts = group_mean_and_count(scores, group_ids)
    squared_dev = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    squared_dev = squared_dev.index_add(0, dense, (scores - means) ** 2)[dense]
    variance = torch.where(counts > 1, squared_dev / (counts - 1).clamp(min=1), 0.0)
    return variance.sqrt()


def group_normalised_scores(
    scores: torch.Tensor, group_ids: torch.Tensor, divide_by_std: bool, std_eps: float
) -> torch.Tensor:
    """GRPO's ``(r - mean_group) / (std_group + eps)``, or ``r - mean_group`` (Dr.GRPO)."""
    means, _ = group_mean_and_count(scores, group_ids)
    centred = scores.detach().double() - means
    if divide_by_std:
        centred = centred / (group_std(scores, group_ids) + std_eps)
    return centred.float()


def leave_one_out_scores(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` over the group, ``= n / (n - 1) * (r_i - mean)``.

    A single-sample group has no other sample to form a baseline: its advantage is 0.
    """
    means, counts = group_mean_and_count(scores, group_ids)
    scale = torch.where(counts > 1, counts / (counts - 1).clamp(min=1), 0.0)
    return (scale * (scores.detach().double() - means)).float()


def whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    process_group: dist.ProcessGroup | None = None,
    eps: float = 1e-5,
    shift_mean: bool = True,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries of the whole batch.

    Mean and *population* variance (divide by n) are global over ``process_group`` (None = this
    process only), so every data-parallel rank whitens with the same statistics. Entries outside
    the mask come out 0. ``shift_mean=False`` only rescales (mean added back).
    """
    _, mean, variance = masked_moments(values, mask, process_group)
    whitened = (values.detach().double() - mean) / torch.sqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * mask.to(whitened.dtype)).float()
