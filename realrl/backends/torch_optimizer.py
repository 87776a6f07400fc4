"""The torch optimizer backend (`<role>.optimizer.backend=torch`; `auto` on CPU workers).

Every rank holds the whole optimizer state: `torch.optim.AdamW` on the trainable parameters,
or, for a module in a lower precision than fp32 (bf16), on their fp32 masters
(`realrl.backends.mixed_precision`): gradients are summed, clipped and stepped in fp32 and the
result rounded into the weights.

With tensor parallelism (Shoeybi et al. 2019) every tp rank of a replica sees the same data;
sharded parameters' gradients are summed over data-parallel peers with the same tp rank, and
replicated parameters (norms, a critic's value head) get identical gradients on every tp rank
because the column-parallel layers all-reduce their input gradients; under sequence
parallelism the norms see a share of the tokens each and their gradients are summed over the
tp group before clipping (`sum_sequence_parallel_gradients`). The global gradient norm
counts each sharded slice once (its squared norm is summed over the tp group) and each
replicated parameter once.

Data-parallel gradient sums overlap the backward, as in PyTorch DDP (Li et al. 2020): the
gradients live in flat buckets (`realrl.backends.gradient_buckets`), and during the last
micro-batch's backward each bucket's all-reduce starts as soon as the backward has finished
all of its gradients.
Measured for the 4M-parameter benchmark model on 2 gloo ranks: concatenating the gradients,
the all-reduce and copying them back cost 8 + 18 + 4 ms per step when done after the backward.

When every rank of a CPU data-parallel group runs on one machine, the buckets live in shared
memory instead and are summed there after the backward (`realrl.backends.shared_memory`):
gloo's socket all-reduce still cost ~25 ms of each rank's CPU per step with the overlap, and
the summation through shared memory ~4 ms. `REALRL_SHARED_MEMORY=0` turns it off.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from realrl.api import environment
from realrl.api.experiment import OptimizerConfig
from realrl.backends.gradient_buckets import GradientBuckets
from realrl.backends.mixed_precision import MasterWeights, check_saved_masters
from realrl.backends.optimizer_backend import (
    clip_scale,
    make_lr_scheduler,
    sum_sequence_parallel_gradients,
)

# Gradients are summed over data-parallel ranks in buckets of about this many bytes.
GRADIENT_BUCKET_BYTES = 4 * 2**20


class TorchOptimizerBackend:
    """AdamW, fp32 masters of a low-precision module, and data-parallel gradient buckets
    (`realrl.backends.optimizer_backend.OptimizerBackend`)."""

    shards_over_data_parallel = False

    def __init__(self, module: torch.nn.Module, parallel, config: OptimizerConfig,
                 total_optimizer_steps: int, sharded_parameter_ids: set[int]) -> None:
        self.module = module
        self.parallel = parallel
        self.sharded_parameter_ids = sharded_parameter_ids
        trainable = [p for p in module.parameters() if p.requires_grad]
        # fp32 masters of a low-precision module's trainable parameters (None in fp32).
        self.master_weights: MasterWeights | None = None
        if any(p.dtype != torch.float32 for p in trainable):
            self.master_weights = MasterWeights(trainable)
            trainable = self.master_weights.masters
        device = next(module.parameters()).device
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            # One fused kernel instead of ~10 ops per tensor: 31 -> 6 ms per step for the
            # 4M-parameter benchmark model on one CPU thread; same update up to fp32 rounding.
            fused=device.type in ("cpu", "cuda"),
        )
        self.lr_scheduler = make_lr_scheduler(self.optimizer, total_optimizer_steps, config)
        self.gradient_buckets: GradientBuckets | None = None  # made by the first step

    def zero_gradients(self) -> None:
        buckets = self._gradient_buckets()
        if buckets is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            buckets.zero()

    def backward(self, loss: torch.Tensor, last_microbatch: bool) -> None:
        if last_microbatch and self.gradient_buckets is not None:
            self.gradient_buckets.arm()
        loss.backward()

    def step(self, max_norm: float, skip_non_finite: bool = False) -> float:
        if self.gradient_buckets is not None:
            self.gradient_buckets.finish()
        sum_sequence_parallel_gradients(
            [(p, holder.grad) for p, holder in self._gradient_holders()], self.parallel
        )
        grad_norm = self._clip_gradients(max_norm)
        if skip_non_finite and not math.isfinite(grad_norm):
            return grad_norm
        self.optimizer.step()
        if self.master_weights is not None:
            self.master_weights.copy_to_module()
        return grad_norm

    def _gradient_buckets(self) -> GradientBuckets | None:
        """The data-parallel gradient buckets (None without data-parallel peers), remade if the
        module's parameters were replaced since they were built."""
        group = self.parallel.dp_group
        if group is None or self.parallel.dp_size == 1:
            return None
        masters = self.master_weights
        if masters is not None:  # the buckets hold the masters' fp32 main gradients
            parameters = masters.masters
        else:
            parameters = [p for p in self.module.parameters() if p.requires_grad]
        buckets = self.gradient_buckets
        if buckets is None or [id(p) for p in buckets.parameters] != [id(p) for p in parameters]:
            if buckets is not None:
                buckets.remove()
            buckets = GradientBuckets(
                parameters,
                group,
                GRADIENT_BUCKET_BYTES,
                use_shared_memory=environment.shared_memory_enabled(),
                hook_backward=masters is None,
            )
            if masters is not None:
                masters.on_gradient = buckets.gradient_done
            self.gradient_buckets = buckets
        return buckets

    def _gradient_holders(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, the tensor whose `.grad` holds its gradient) for every parameter with a
        gradient: the parameter itself, or the fp32 master of a low-precision module's."""
        if self.master_weights is not None:
            pairs = zip(self.master_weights.parameters, self.master_weights.masters, strict=True)
        else:
            pairs = ((p, p) for p in self.module.parameters())
        return [(p, holder) for p, holder in pairs if holder.grad is not None]

    def _clip_gradients(self, max_norm: float) -> float:
        """Scale gradients to a global L2 norm of at most `max_norm` (no clipping when <= 0), as
        `torch.nn.utils.clip_grad_norm_` does, over the full (unsharded) model; returns the norm
        before clipping. Costs one host sync, once per optimizer step. A low-precision module's
        gradients are its masters' fp32 main gradients."""
        with_grads = self._gradient_holders()
        if not with_grads:
            return 0.0
        tp_group = self.parallel.tp_group if self.parallel.tp_size > 1 else None
        if self.gradient_buckets is not None and tp_group is None:
            # Every gradient is a view of a bucket: a few long reductions and scalings instead of
            # one per parameter (the 4M-parameter benchmark model: 2.3 -> 1.0 ms on one thread).
            grads = self.gradient_buckets.buckets
            is_sharded = [False] * len(grads)
        else:
            grads = [holder.grad for _, holder in with_grads]
            is_sharded = [id(p) in self.sharded_parameter_ids for p, _ in with_grads]
        squared = torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads]
        )  # [num_gradient_tensors]
        sharded = torch.tensor(is_sharded, device=squared.device)
        sharded_squared = squared[sharded].sum()
        if tp_group is not None:
            dist.all_reduce(sharded_squared, group=tp_group)
        total_norm = float((sharded_squared + squared[~sharded].sum()).sqrt())
        scale = clip_scale(total_norm, max_norm)
        if scale is not None:
            torch._foreach_mul_(grads, scale)
        return total_norm

    def state_dict(self) -> dict:
        """AdamW's state and, for a low-precision module, the fp32 master weights (its bf16
        weights alone would lose what the masters hold below one bf16 spacing)."""
        state = {"optimizer": self.optimizer.state_dict()}
        if self.master_weights is not None:
            state["master_weights"] = self.master_weights.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Saved fp32 masters become the masters (and, rounded, the weights); an fp32 module
        resuming a bf16 run takes them as its weights."""
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if "master_weights" not in state:
            return
        if self.master_weights is not None:
            self.master_weights.load_state_dict(state["master_weights"])
            return
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        check_saved_masters(state["master_weights"], trainable)
        with torch.no_grad():
            device = trainable[0].device
            torch._foreach_copy_(trainable, [m.to(device) for m in state["master_weights"]])

    def weights_written(self) -> None:
        if self.master_weights is not None:
            self.master_weights.copy_from_module()

