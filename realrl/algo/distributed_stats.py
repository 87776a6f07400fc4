"""Masked statistics that can span data-parallel ranks.

Convention for every ``process_group`` argument in ``realrl.algo``: ``None`` means *no*
reduction (the statistic covers this process's tensors only), not the default world group.
Pass the data-parallel group explicitly to make a statistic global. Reductions are SUMs of
(count, sum, sum of squares) in float64, so the result does not depend on how the batch was
split between ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.backends.worker_device import group_device


def all_reduce_sum(tensor: torch.Tensor, process_group: dist.ProcessGroup | None) -> torch.Tensor:
    """A new tensor holding the SUM of ``tensor`` over ``process_group`` (None: a copy), on
    ``tensor``'s device: reduced where the group's backend can (`group_device`), so that the
    CPU statistics of a PPO batch (advantages, whitening, group moments) reduce over NCCL too.

    ``tensor`` itself keeps this rank's values, so a caller that reduces a local count and
    later needs it again gets the local one, not the global one (`paired_rw` once divided its
    accuracy by the data-parallel size that way). The copy costs nothing next to the
    collective: the statistics reduced here hold a few numbers each.
    """
    if process_group is None:
        return tensor.clone()
    total = tensor.to(group_device(process_group), copy=True)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
    return total.to(tensor.device)


def masked_moments(
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    unbiased: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, variance) of the masked entries of ``values``, as float64 scalars.

    One all-reduce of a 3-vector. ``unbiased=True`` divides by ``count - 1`` (Bessel);
    the variance is 0 when there are fewer than two entries, and the mean is 0 when none.
    """
    values = values.detach().double()
    weights = torch.ones_like(values) if mask is None else mask.to(values.dtype)
    totals = torch.stack([weights.sum(), (values * weights).sum(), (values**2 * weights).sum()])
    count, value_sum, square_sum = all_reduce_sum(totals, process_group).unbind()
    mean = value_sum / count.clamp(min=1)
    sum_sq_dev = (square_sum - count * mean**2).clamp(min=0)
    divisor = count - 1 if unbiased else count
    variance = torch.where(divisor > 0, sum_sq_dev / divisor.clamp(min=1), torch.zeros_like(mean))
    return count, mean, variance
