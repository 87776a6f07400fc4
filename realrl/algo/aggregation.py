"""Turning per-token losses into the scalar to back-propagate (``ppo.loss_agg_mode``).

The denominator of every mode is a property of the whole (mini-)batch, across micro-batches and
data-parallel ranks, never of one micro-batch. The train step therefore works in two parts:

1. before the micro-batch loop, ``normaliser = loss_normaliser(mode, loss_mask, cu_seqlens,
   process_group=dp_group)`` on this rank's full mini-batch (one all-reduce over the
   data-parallel group sums the counts of every rank);
2. per micro-batch, ``loss = aggregate_loss(per_token_loss, mb_loss_mask, mb_cu_seqlens, mode,
   normaliser)`` and ``loss.backward()``.

The micro-batch losses then add up to the full-batch loss, so their gradients accumulate to the
full-batch gradient; across ranks gradients must be all-reduced with **SUM** (not averaged). If a
data-parallel wrapper averages gradients, multiply the loss by the data-parallel world size.

Modes (``N`` = sequences with at least one response token, ``T_i`` = response tokens of sequence
``i``, ``l_it`` the per-token loss):

- ``token-mean``               ``sum_it l_it / sum_i T_i``: every token weighs the same (DAPO).
- ``seq-mean-token-sum``       ``sum_i (sum_t l_it) / N``.
- ``seq-mean-token-mean``      ``sum_i (sum_t l_it / T_i) / N``: every sequence weighs the same
  (original GRPO, Shao et al. 2024, eq. (3)).
- ``seq-mean-token-sum-norm``  ``sum_i (sum_t l_it / L) / N`` with a constant ``L =
  norm_length`` (Dr.GRPO, Liu et al. 2025: no length bias). verl 0.9.1's mode of the same name
  divides by ``N * L`` too (``agg_loss`` in ``verl/trainer/ppo/core_algos.py``: the
  ``seq-mean-token-sum`` loss, then ``/ loss_scale_factor``); its 0.8.0.dev code (git b178a3c)
  divided by ``L`` only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.algo.distributed_stats import all_reduce_sum
from realrl.algo.layout import segment_sum, shifted_cu_seqlens

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown ppo.loss_agg_mode={mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def loss_normaliser(
    mode: str,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    process_group: dist.ProcessGroup | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """The global denominator (float64 scalar) for this rank's whole mini-batch.

    ``loss_mask [total_tokens - num_seqs]`` and ``cu_seqlens [num_seqs + 1]`` describe every
    micro-batch of the mini-batch on this rank; ``process_group`` (None = this rank only) sums the
    counts over data-parallel ranks. Clamped to >= 1 so an all-masked batch gives loss 0, not NaN.
    """
    _check_mode(mode)
    mask = loss_mask.bool()
    if mode == "token-mean":
        count = mask.sum().double()
    else:
        tokens_per_seq = segment_sum(mask.double(), shifted_cu_seqlens(cu_seqlens))
        count = (tokens_per_seq > 0).sum().double()
    count = all_reduce_sum(count.reshape(1), process_group)[0].clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                "ppo.loss_agg_mode=seq-mean-token-sum-norm needs a positive constant length "
                f"(ppo.loss_agg_norm_length, usually the generation max_new_tokens); got {norm_length}"
            )
        count = count * norm_length
    return count


def aggregate_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str,
    normaliser: torch.Tensor,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: ``sum(...) / normaliser`` (a scalar).

    ``per_token_loss [total_tokens - num_seqs]`` is shifted like the loss mask; ``cu_seqlens``
    are this micro-batch's own boundaries; ``normaliser`` comes from `loss_normaliser` on the
    whole mini-batch with the same ``mode``. Masked-out entries never contribute (even if NaN).
    """
    _check_mode(mode)
    mask = loss_mask.bool()
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "seq-mean-token-mean":
        shifted = shifted_cu_seqlens(cu_seqlens)
        tokens_per_seq = segment_sum(mask.to(masked.dtype), shifted)  # [num_seqs]
        total = (segment_sum(masked, shifted) / tokens_per_seq.clamp(min=1)).sum()
    else:
        total = masked.sum()
    return total / normaliser.to(total.dtype)
