"""The torch backend: one model shard on one worker, its optimizer, and how it trains.

An engine is what an interface gets handed: it holds the module, the tokenizer, the optimizer
and LR schedule, and the data-parallel / tensor-parallel process groups of its layout, passed
explicitly (no ambient "current model"). Training follows one rule everywhere: losses are
normalised by whole-batch denominators (see `realrl.algo.aggregation`), so gradients are
**summed** over micro-batches and over data-parallel ranks, and the result equals a single
process on the same data.

With tensor parallelism (Shoeybi et al. 2019) every tp rank of a replica sees the same data;
sharded parameters' gradients are summed over data-parallel peers with the same tp rank, and
replicated parameters (norms, a critic's value head) get identical gradients on every tp rank
because the column-parallel layers all-reduce their input gradients. The global gradient norm
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

A module in a lower precision than fp32 (bf16) trains on fp32 master weights: gradients are
summed, clipped and stepped in fp32 and the result rounded into its weights
(`realrl.backends.mixed_precision`). fp32 modules train on their parameters directly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from realrl.api import environment
from realrl.api.data import SequenceSample
from realrl.api.experiment import LRScheduler, OptimizerConfig
from realrl.backends.gradient_buckets import GradientBuckets
from realrl.backends.mixed_precision import MasterWeights, check_saved_masters
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


# The model's forward as a loss sees it: (packed_input_ids, cu_seqlens) -> output.
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossFn = Callable[[Forward, SequenceSample], tuple[torch.Tensor, dict[str, float]]]

# Gradients are summed over data-parallel ranks in buckets of about this many bytes.
GRADIENT_BUCKET_BYTES = 4 * 2**20


@dataclass
class _KeptForward:
    """A training forward run before its train call, with its autograd graph."""

    packed_input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    output: torch.Tensor

    def matches(self, packed_input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
        return torch.equal(self.cu_seqlens, cu_seqlens) and torch.equal(
            self.packed_input_ids, packed_input_ids
        )


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
        # Sampling; tp ranks of a replica must share the seed so that they sample alike.
        self.generator = torch.Generator(device=module.device).manual_seed(seed)
        self.home_device = module.device  # where the module computes; see offload()
        self.offloaded = False
        self.sharded_parameter_ids = sharded_parameter_ids(module)
        self.gradient_buckets: GradientBuckets | None = None  # made by the first train step
        # The shared memory this engine's weights live in, when its data-parallel replicas
        # share one copy (`realloc.share_replica_weights`).
        self.shared_weights = None
        # Forwards kept for the next train call, and the weights they were computed with.
        self._kept: list[_KeptForward] = []
        self._kept_weights: tuple[int, ...] = ()
        # The most tokens one forward ran since the worker last reset it (memory hints).
        self.largest_forward_tokens = 0
        # fp32 masters of a low-precision module's trainable parameters (None in fp32).
        self.master_weights: MasterWeights | None = None
        # fp32 copies of a frozen low-precision module's weights that EMA updates blend into
        # (`ema_master`), by parameter name; made at the first blend.
        self.ema_masters: dict[str, torch.Tensor] = {}
        if optimizer_config is not None:
            self._build_optimizer(optimizer_config, total_optimizer_steps)
        else:
            module.requires_grad_(False)

    def _build_optimizer(self, config: OptimizerConfig, total_optimizer_steps: int) -> None:
        """AdamW on the trainable parameters, or on their fp32 masters when the module computes
        in a lower precision (`realrl.backends.mixed_precision`)."""
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in trainable):
            self.master_weights = MasterWeights(trainable)
            trainable = self.master_weights.masters
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            # One fused kernel instead of ~10 ops per tensor: 31 -> 6 ms per step for the
            # 4M-parameter benchmark model on one CPU thread; same update up to fp32 rounding.
            fused=self.module.device.type in ("cpu", "cuda"),
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_multiplier(step, total_optimizer_steps, config)
        )

    @property
    def device(self) -> torch.device:
        return self.module.device

    def offload(self) -> None:
        """Move a frozen model's weights to host memory until `onload`, freeing its GPU memory
        between uses (the offload hook). On a CPU engine there is nothing to free."""
        if self.optimizer is not None:
            raise RuntimeError("only frozen models are offloaded; this one has an optimizer")
        if self.home_device.type == "cpu" or self.offloaded:
            return
        self.module.to("cpu")
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Bring offloaded weights back to the engine's device (no-op when they are there)."""
        if self.offloaded:
            self.module.to(self.home_device)
            self.offloaded = False

    def forward(
        self, packed_input_ids: torch.Tensor, cu_seqlens: torch.Tensor, keep: bool = False
    ) -> torch.Tensor:
        """The module's output, detached.

        With `keep` (a trainable engine) the forward runs as training runs it and keeps its
        autograd graph: the next `train_microbatches` whose loss runs the forward on the same
        input, with the same weights, takes this output instead of computing it again. PPO
        uses it for the forward its critic computes values with, and for the actor's training
        forward, started before the train call's other inputs exist. Whatever that train call
        does not use is dropped when it ends.
        """
        packed_input_ids, cu_seqlens = packed_input_ids.to(self.device), cu_seqlens.to(self.device)
        self.largest_forward_tokens = max(self.largest_forward_tokens, packed_input_ids.numel())
        if not keep:
            self.module.eval()
            with torch.no_grad():
                return self.module(packed_input_ids, cu_seqlens)
        assert self.optimizer is not None, "forward(keep=True) on a frozen model"
        weights = self._weights_version()
        if weights != self._kept_weights:
            self._kept, self._kept_weights = [], weights
        self.module.train()
        with torch.enable_grad():
            output = self.module(packed_input_ids, cu_seqlens)
        self._kept.append(_KeptForward(packed_input_ids, cu_seqlens, output))
        return output.detach()

    def _weights_version(self) -> tuple[int, ...]:
        """Changes with every in-place write to the weights (reallocation, checkpoint loads).
        The optimizer's steps (the fused step does not count as one) happen only inside
        `train_microbatches`, which drops every kept forward."""
        return tuple(p._version for p in self.module.parameters())

    def _take_kept(self, reused: list[int]) -> Forward:
        """The forward for this train call's losses: a kept output where one matches (its
        index among the kept ones is appended to `reused`)."""
        kept = self._kept if self._kept_weights == self._weights_version() else []
        self._kept, self._kept_weights = [], ()

        def forward(packed_input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
            self.largest_forward_tokens = max(
                self.largest_forward_tokens, packed_input_ids.numel()
            )
            for index, candidate in enumerate(kept):
                if candidate.matches(packed_input_ids, cu_seqlens):
                    reused.append(index)
                    return kept.pop(index).output
            return self.module(packed_input_ids, cu_seqlens)

        return forward

    def train_microbatches(self, microbatches: Sequence[SequenceSample], loss_fn: LossFn) -> dict:
        """One optimizer step over `microbatches`; `loss_fn` returns each one's share of the
        whole-batch loss. Returns the summed stats plus `grad_norm`, `lr` and `forward_reused`
        (the fraction of micro-batches that took a kept forward, see `forward`).

        A low-precision module's gradients are summed in fp32 and the step is taken on its fp32
        masters, then rounded into its weights (`realrl.backends.mixed_precision`)."""
        assert self.optimizer is not None, "train_microbatches on a frozen model"
        self.module.train()
        buckets = self._gradient_buckets()
        if buckets is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            buckets.zero()
        totals: dict[str, float] = {}
        reused: list[int] = []
        forward = self._take_kept(reused)
        for index, microbatch in enumerate(microbatches):
            loss, stats = loss_fn(forward, microbatch)
            if buckets is not None and index == len(microbatches) - 1:
                buckets.arm()
            loss.backward()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        if buckets is not None:
            buckets.finish()
        grad_norm = self._clip_gradients(self.optimizer_config.gradient_clipping, buckets)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.master_weights is not None:
            self.master_weights.copy_to_module()
        self.lr_scheduler.step()
        totals["grad_norm"] = float(grad_norm)
        totals["forward_reused"] = len(reused) / max(len(microbatches), 1)
        totals["lr"] = lr
        return totals

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

    def _clip_gradients(self, max_norm: float, buckets: GradientBuckets | None) -> float:
        """Scale gradients to a global L2 norm of at most `max_norm` (no clipping when <= 0), as
        `torch.nn.utils.clip_grad_norm_` does, over the full (unsharded) model; returns the norm
        before clipping. Costs one host sync, once per optimizer step. A low-precision module's
        gradients are its masters' fp32 main gradients."""
        if self.master_weights is not None:
            pairs = zip(self.master_weights.parameters, self.master_weights.masters, strict=True)
        else:
            pairs = ((p, p) for p in self.module.parameters())
        with_grads = [(p, holder) for p, holder in pairs if holder.grad is not None]
        if not with_grads:
            return 0.0
        tp_group = self.parallel.tp_group if self.parallel.tp_size > 1 else None
        if buckets is not None and tp_group is None:
            # Every gradient is a view of a bucket: a few long reductions and scalings instead of
            # one per parameter (the 4M-parameter benchmark model: 2.3 -> 1.0 ms on one thread).
            grads = buckets.buckets
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
        if 0 < max_norm < total_norm + 1e-6:
            torch._foreach_mul_(grads, max_norm / (total_norm + 1e-6))
        return total_norm

    def state_for_checkpoint(self) -> dict:
        """Optimizer, LR schedule and, for a low-precision module, the fp32 master weights
        (its bf16 weights alone would lose what the masters hold below one bf16 spacing) or
        the fp32 EMA masters of a frozen one. Empty for a frozen module without EMA masters."""
        state = {}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.master_weights is not None:
            state["master_weights"] = self.master_weights.state_dict()
        if self.ema_masters:
            state["ema_masters"] = dict(self.ema_masters)
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore `state_for_checkpoint`'s state. Saved fp32 masters become the masters (and,
        rounded, the weights); an fp32 module resuming a bf16 run takes them as its weights."""
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "ema_masters" in state:
            self._load_ema_masters(state["ema_masters"])
        if self.optimizer is None or "master_weights" not in state:
            return
        if self.master_weights is not None:
            self.master_weights.load_state_dict(state["master_weights"])
            return
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        check_saved_masters(state["master_weights"], trainable)
        with torch.no_grad():
            torch._foreach_copy_(trainable, [m.to(self.device) for m in state["master_weights"]])

    def weights_written(self) -> None:
        """The module's weights were written outside the optimizer (a checkpoint's weights
        loaded into it): the fp32 masters of a low-precision module take them, exactly, and
        EMA masters are made again from them at the next blend. `load_checkpoint_state` may
        then replace either with saved ones."""
        if self.master_weights is not None:
            self.master_weights.copy_from_module()
        self.ema_masters = {}

    def ema_master(self, name: str) -> torch.Tensor | None:
        """The fp32 copy of frozen low-precision parameter `name` that an EMA update
        (`target = eta * source + (1 - eta) * target`, `realrl.workers.realloc`) blends into
        before rounding into the weight; None for an fp32 or a trained module.

        Why: an EMA step moves a weight by `eta * (source - target)`, far below half a bf16
        spacing for the small etas EMA references use, so blending into the bf16 weight itself
        rounds every step away and the reference never moves. The copy costs 4 bytes per
        parameter of the EMA target's owning layout, and checkpoints keep it."""
        if self.optimizer is not None or self.module.dtype == torch.float32:
            return None
        master = self.ema_masters.get(name)
        if master is None:
            parameter = dict(self.module.named_parameters())[name]
            master = self.ema_masters[name] = parameter.detach().to(torch.float32, copy=True)
        return master

    def _load_ema_masters(self, saved: dict[str, torch.Tensor]) -> None:
        parameters = dict(self.module.named_parameters())
        wrong = sorted(name for name, tensor in saved.items()
                       if name not in parameters or parameters[name].shape != tensor.shape)
        if wrong:
            raise ValueError(
                f"the checkpoint's fp32 EMA masters do not fit this model ({wrong[:3]}): resume "
                "with the model and tensor-parallel layout that wrote the checkpoint"
            )
        with torch.no_grad():
            self.ema_masters = {name: tensor.to(self.device, torch.float32)
                                for name, tensor in saved.items()}
            for name, master in self.ema_masters.items():
                parameters[name].copy_(master)


def sharded_parameter_ids(module: torch.nn.Module) -> set[int]:
    """ids of the parameters that tensor-parallel layers split across ranks: those megatron-core
    marks `tensor_model_parallel` (`realrl.models.megatron_layers`). The rest, norms and a
    row-parallel layer's bias included, are replicated."""
    return {
        id(parameter)
        for parameter in module.parameters()
        if getattr(parameter, "tensor_model_parallel", False)
    }
