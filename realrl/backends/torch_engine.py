"""The torch backend: one model shard on one worker, its optimizer, and how it trains.

An engine is what an interface gets handed: it holds the module, the tokenizer, the optimizer
and LR schedule, and the data-parallel / tensor-parallel process groups of its layout, passed
explicitly (no ambient "current model"). Training follows one rule everywhere: losses are
normalised by whole-batch denominators (see `realrl.algo.aggregation`), so gradients are
**summed** over micro-batches and over data-parallel ranks, and the result equals a single
process on the same data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from realrl.api.data import SequenceSample
from realrl.api.experiment import LRScheduler, OptimizerConfig
from realrl.models.transformer import Transformer

logger = logging.getLogger(__name__)


@dataclass
class ParallelContext:
    """Where this shard sits in its layout. Groups are None when their size is 1."""

    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None


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


LossFn = Callable[[Transformer, SequenceSample], tuple[torch.Tensor, dict[str, float]]]


class TorchEngine:
    def __init__(
        self,
        module: Transformer,
        tokenizer,
        parallel: ParallelContext,
        optimizer_config: OptimizerConfig | None = None,
        total_optimizer_steps: int = 1,
        seed: int = 0,
    ) -> None:
        self.module = module
        self.tokenizer = tokenizer
        self.parallel = parallel
        self.optimizer_config = optimizer_config
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.generator = torch.Generator(device=module.device).manual_seed(seed)  # sampling
        if optimizer_config is not None:
            self.optimizer = torch.optim.AdamW(
                [p for p in module.parameters() if p.requires_grad],
                lr=optimizer_config.lr,
                betas=(optimizer_config.beta1, optimizer_config.beta2),
                eps=optimizer_config.eps,
                weight_decay=optimizer_config.weight_decay,
            )
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer,
                lambda step: lr_multiplier(step, total_optimizer_steps, optimizer_config),
            )
        else:
            module.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.module.device

    @torch.no_grad()
    def forward(self, packed_input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        self.module.eval()
        return self.module(packed_input_ids.to(self.device), cu_seqlens.to(self.device))

    def train_microbatches(self, microbatches: Sequence[SequenceSample], loss_fn: LossFn) -> dict:
        """One optimizer step over `microbatches`; `loss_fn` returns each one's share of the
        whole-batch loss. Returns the summed stats plus `grad_norm` and `lr`."""
        assert self.optimizer is not None, "train_microbatches on a frozen model"
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for microbatch in microbatches:
            loss, stats = loss_fn(self.module, microbatch)
            loss.backward()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        self._all_reduce_gradients()
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        clip = self.optimizer_config.gradient_clipping
        max_norm = clip if clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm) if parameters else 0.0
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        totals["grad_norm"] = float(grad_norm)
        totals["lr"] = lr
        return totals

    def _all_reduce_gradients(self) -> None:
        """Sum gradients over data-parallel ranks, bucketed into one flat buffer per dtype."""
        group = self.parallel.dp_group
        if group is None or self.parallel.dp_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for parameter in self.module.parameters():
            if parameter.requires_grad:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                by_dtype.setdefault(parameter.grad.dtype, []).append(parameter.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def state_for_checkpoint(self) -> dict:
        state = {}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
