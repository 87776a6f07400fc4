"""What a trainable engine's optimizer backend does, and the learning-rate schedule both share.

`TorchEngine` runs the training loop (micro-batches, kept forwards, statistics); an
`OptimizerBackend` owns everything about gradients and the optimizer: where gradients are
summed over micro-batches and data-parallel ranks, clipping, the AdamW step and writing its
result into the module's weights, and the optimizer's checkpoint state. Two implement it:

- `realrl.backends.torch_optimizer.TorchOptimizerBackend` (`<role>.optimizer.backend=torch`,
  and `auto` on CPU): `torch.optim.AdamW` on every rank, fp32 masters of a bf16 module
  (`realrl.backends.mixed_precision`), gradients summed in buckets that overlap the backward
  or in shared memory (`realrl.backends.gradient_buckets`);
- `realrl.backends.megatron_optimizer.MegatronOptimizerBackend` (`megatron`, and `auto` on
  CUDA): megatron-core's `DistributedDataParallel` and `DistributedOptimizer`, which shard the
  fp32 masters and AdamW moments over the data-parallel group.

Both apply realrl's rules: gradients are *summed* over micro-batches and data-parallel ranks
(losses carry whole-batch denominators, `realrl.algo.aggregation`), the global norm counts
every tensor-parallel shard once, clipping scales by `max_norm / (norm + 1e-6)` when that is
below 1, and AdamW decays every parameter alike.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist

from realrl.api.experiment import LRScheduler, OptimizerConfig


class OptimizerBackend(Protocol):
    # The torch optimizer whose param groups carry the learning rate `lr_scheduler` sets.
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    # Whether data-parallel ranks hold different parts of the optimizer state (each writes
    # its own checkpoint file) rather than equal copies (replica 0 writes).
    shards_over_data_parallel: bool

    def zero_gradients(self) -> None:
        """Start a step: clear the gradients of the previous one."""

    def backward(self, loss: torch.Tensor, last_microbatch: bool) -> None:
        """Add `loss`'s gradients to the step's sums; data-parallel sums may start during the
        last micro-batch's backward."""

    def step(self, max_norm: float, skip_non_finite: bool = False) -> float:
        """Finish the data-parallel sums, clip to `max_norm` (<= 0: no clipping), step AdamW
        and write the result into the module's weights; returns the global gradient norm
        before clipping (one host sync). With `skip_non_finite` a NaN or inf norm leaves
        weights and optimizer state as they were (`nan_policy=skip`); the norm is the same
        on every rank, so every rank skips alike."""

    def state_dict(self) -> dict:
        """This rank's optimizer state (and fp32 masters) for a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s state; raises, naming the fix, if another layout wrote it."""

    def weights_written(self) -> None:
        """The module's weights were written outside the optimizer: fp32 masters take them."""


def lr_multiplier(step: int, total_steps: int, config: OptimizerConfig) -> float:
    """Linear warm-up from 0 over `warmup_steps_proportion`, then constant, linear or cosine
    decay to `min_lr_ratio` at `total_steps`."""
    warmup_steps = int(config.warmup_steps_proportion * total_steps)
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if config.lr_scheduler == LRScheduler.constant:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if config.lr_scheduler == LRScheduler.linear:
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: OptimizerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of `lr_multiplier`, stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, config)
    )


def clip_scale(total_norm: float, max_norm: float) -> float | None:
    """The factor gradients are scaled by, as `torch.nn.utils.clip_grad_norm_` computes it, or
    None when they are not clipped (`max_norm` <= 0, or the norm is within it)."""
    if 0 < max_norm < total_norm + 1e-6:
        return max_norm / (total_norm + 1e-6)
    return None


def sum_sequence_parallel_gradients(
    gradients: list[tuple[torch.nn.Parameter, torch.Tensor]], parallel
) -> None:
    """Sum over the tp group, in place, the gradients of parameters marked `sequence_parallel`
    (the norms of a sequence-parallel model, `realrl.models.transformer.Transformer`): each tp
    rank saw only its share of the tokens, so each holds a partial sum. One all-reduce of their
    concatenation, as megatron's `finalize_model_grads` does; afterwards they are equal on
    every tp rank and the gradient norm counts them once, like every replicated parameter.
    `gradients`: (parameter, the tensor holding its gradient) pairs."""
    if parallel.tp_size == 1:
        return
    grads = [grad for p, grad in gradients if getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    summed = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(summed, group=parallel.tp_group)
    pieces = summed.split([grad.numel() for grad in grads])
    torch._foreach_copy_(grads, [piece.view_as(grad) for piece, grad in zip(pieces, grads)])
