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
gradients live in flat buckets (`GradientBuckets`), and during the last micro-batch's backward
each bucket's all-reduce starts as soon as the backward has finished all of its gradients.
Measured for the 4M-parameter benchmark model on 2 gloo ranks: concatenating the gradients,
the all-reduce and copying them back cost 8 + 18 + 4 ms per step when done after the backward.

When every rank of a CPU data-parallel group runs on one machine, the buckets live in shared
memory instead and are summed there after the backward (`realrl.backends.shared_memory`):
gloo's socket all-reduce still cost ~25 ms of each rank's CPU per step with the overlap, and
the summation through shared memory ~4 ms. `REALRL_SHARED_MEMORY=0` turns it off.
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
from realrl.backends import shared_memory
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


class GradientBuckets:
    """The trainable parameters' gradients as views into flat buckets, summed over the
    data-parallel group while the backward still runs.

    Buckets take the parameters in reverse registration order, roughly the order in which
    the backward finishes their gradients. While `armed` (the last micro-batch's backward),
    a hook counts each bucket's finished gradients, and a complete bucket's all-reduce starts
    at once (asynchronously), provided every earlier bucket has started: all ranks must issue
    their collectives in the same order. `finish` starts the rest (buckets with a parameter
    the backward did not reach, e.g. on a rank without data) and waits for all of them.

    The views stay `.grad` across steps (`zero` clears them in place), so the backward adds
    into the buckets and nothing is copied in or out.

    With `use_shared_memory` and a CPU group whose ranks all share this machine's memory, the
    buckets are views of a `SharedMemorySum` instead, and `finish` sums them there (nothing is
    sent during the backward).
    """

    def __init__(
        self,
        parameters: list[torch.nn.Parameter],
        group,
        bucket_bytes: int,
        use_shared_memory: bool = True,
    ) -> None:
        self.group = group
        self.parameters = parameters
        self.members: list[list[torch.nn.Parameter]] = []
        open_buckets: dict[tuple, list[torch.nn.Parameter]] = {}
        for parameter in reversed(parameters):
            key = (parameter.dtype, parameter.device)
            members = open_buckets.setdefault(key, [])
            members.append(parameter)
            if sum(p.numel() for p in members) * parameter.element_size() >= bucket_bytes:
                self.members.append(open_buckets.pop(key))
        self.members.extend(open_buckets.values())
        specs = [(sum(p.numel() for p in members), members[0].dtype) for members in self.members]
        self.shared: shared_memory.SharedMemorySum | None = None
        if use_shared_memory and all(m[0].device.type == "cpu" for m in self.members):
            self.shared = shared_memory.SharedMemorySum.connect(group, specs)
        if self.shared is not None:
            self.buckets = self.shared.tensors
        else:
            self.buckets = [
                torch.zeros(numel, dtype=dtype, device=members[0].device)
                for (numel, dtype), members in zip(specs, self.members)
            ]
        self.bucket_of = {
            id(parameter): index
            for index, members in enumerate(self.members)
            for parameter in members
        }
        self.armed = False
        self.waiting: list[int] = []  # per bucket: gradients the backward has yet to finish
        self.launched = 0
        self.works: list = []
        # Shared-memory sums run after the backward: nothing to start while it runs.
        self.hooks = [] if self.shared is not None else [
            p.register_post_accumulate_grad_hook(self._finished) for p in parameters
        ]

    def zero(self) -> None:
        """Zero every gradient and (re)attach each parameter's `.grad` to its bucket."""
        for flat, members in zip(self.buckets, self.members):
            flat.zero_()
            offset = 0
            for parameter in members:
                view = flat[offset : offset + parameter.numel()].view_as(parameter)
                if parameter.grad is None or parameter.grad.data_ptr() != view.data_ptr():
                    parameter.grad = view
                offset += parameter.numel()

    def arm(self) -> None:
        """The next backward is the step's last: start each bucket's all-reduce when it is done."""
        self.armed = True
        self.waiting = [len(members) for members in self.members]
        self.launched = 0
        self.works = []

    def _finished(self, parameter: torch.nn.Parameter) -> None:
        if self.armed:
            self.waiting[self.bucket_of[id(parameter)]] -= 1
            self._launch(complete_only=True)

    def _launch(self, complete_only: bool) -> None:
        while self.launched < len(self.buckets) and (
            not complete_only or self.waiting[self.launched] == 0
        ):
            flat = self.buckets[self.launched]
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.launched += 1

    def finish(self) -> None:
        """Start what is left and wait until every bucket holds the sum over the group."""
        if not self.armed:
            self.arm()
        if self.shared is not None:
            self.shared.all_reduce()
        else:
            self._launch(complete_only=False)
            for work in self.works:
                work.wait()
        for flat, members in zip(self.buckets, self.members):
            start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            if any(p.grad is None or not start <= p.grad.data_ptr() < end for p in members):
                raise RuntimeError(
                    "a parameter's .grad was replaced during the step, so its bucket's "
                    "data-parallel sum missed it; only TorchEngine may set gradients"
                )
        self.armed = False
        self.works = []

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


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
        if optimizer_config is not None:
            self.optimizer = torch.optim.AdamW(
                [p for p in module.parameters() if p.requires_grad],
                lr=optimizer_config.lr,
                betas=(optimizer_config.beta1, optimizer_config.beta2),
                eps=optimizer_config.eps,
                weight_decay=optimizer_config.weight_decay,
                # One fused kernel instead of ~10 ops per tensor: 31 -> 6 ms per step for the
                # 4M-parameter benchmark model on one CPU thread; same update up to fp32 rounding.
                fused=module.device.type in ("cpu", "cuda"),
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
            for index, candidate in enumerate(kept):
                if candidate.matches(packed_input_ids, cu_seqlens):
                    reused.append(index)
                    return kept.pop(index).output
            return self.module(packed_input_ids, cu_seqlens)

        return forward

    def train_microbatches(self, microbatches: Sequence[SequenceSample], loss_fn: LossFn) -> dict:
        """One optimizer step over `microbatches`; `loss_fn` returns each one's share of the
        whole-batch loss. Returns the summed stats plus `grad_norm`, `lr` and `forward_reused`
        (the fraction of micro-batches that took a kept forward, see `forward`)."""
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
            )
            self.gradient_buckets = buckets
        return buckets

    def _clip_gradients(self, max_norm: float, buckets: GradientBuckets | None) -> float:
        """Scale gradients to a global L2 norm of at most `max_norm` (no clipping when <= 0), as
        `torch.nn.utils.clip_grad_norm_` does, over the full (unsharded) model; returns the norm
        before clipping. Costs one host sync, once per optimizer step."""
        with_grads = [p for p in self.module.parameters() if p.grad is not None]
        if not with_grads:
            return 0.0
        tp_group = self.parallel.tp_group if self.parallel.tp_size > 1 else None
        if buckets is not None and tp_group is None:
            # Every gradient is a view of a bucket: a few long reductions and scalings instead of
            # one per parameter (the 4M-parameter benchmark model: 2.3 -> 1.0 ms on one thread).
            grads = buckets.buckets
            is_sharded = [False] * len(grads)
        else:
            grads = [p.grad for p in with_grads]
            is_sharded = [id(p) in self.sharded_parameter_ids for p in with_grads]
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
        state = {}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])


def sharded_parameter_ids(module: torch.nn.Module) -> set[int]:
    """ids of the parameters that tensor-parallel layers split across ranks: those megatron-core
    marks `tensor_model_parallel` (`realrl.models.megatron_layers`). The rest, norms and a
    row-parallel layer's bias included, are replicated."""
    return {
        id(parameter)
        for parameter in module.parameters()
        if getattr(parameter, "tensor_model_parallel", False)
    }
