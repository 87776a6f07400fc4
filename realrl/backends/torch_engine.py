"""The engine: one model shard on one worker, and how it trains.

An engine is what an interface gets handed: it holds the module, the tokenizer, the optimizer
backend with its LR schedule, and the data-parallel / tensor-parallel process groups of its
layout, passed explicitly (no ambient "current model"). Training follows one rule everywhere:
losses are normalised by whole-batch denominators (see `realrl.algo.aggregation`), so
gradients are **summed** over micro-batches and over data-parallel ranks, and the result
equals a single process on the same data.

Where gradients are summed and how the optimizer steps is the optimizer backend's business
(`realrl.backends.optimizer_backend`): `torch` (`realrl.backends.torch_optimizer`: AdamW on
every rank, shared-memory or bucketed gradient sums; the choice on CPU) or `megatron`
(`realrl.backends.megatron_optimizer`: megatron-core's DDP and distributed optimizer, fp32
masters and moments sharded over the data-parallel group; the choice on CUDA). A module in a
lower precision than fp32 (bf16) trains on fp32 master weights under both.

A NaN or inf loss or gradient norm follows `nan_policy` (the run-wide key): `stop` raises
`NonFiniteError` naming the micro-batch before the update, `skip` leaves the weights and the
optimizer state as they were, counts the step in `skipped_steps` and warns.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from realrl.api.config import NanPolicy
from realrl.api.data import SequenceSample
from realrl.api.errors import UserFacingError
from realrl.api.experiment import OptimizerBackendName, OptimizerConfig
from realrl.backends.optimizer_backend import OptimizerBackend
from realrl.backends.torch_optimizer import TorchOptimizerBackend
from realrl.models.cuda_graphs import release_decode_graphs
from realrl.models.transformer import Transformer

logger = logging.getLogger(__name__)


class NonFiniteError(UserFacingError):
    """A NaN or inf loss or gradient norm under `nan_policy=stop`; the worker adds the step,
    the MFC and the role to the message."""


@dataclass
class ParallelContext:
    """Where this shard sits in its layout. Groups are None when their size is 1."""

    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    # Every rank of the layout, when both sizes are > 1 (the megatron backend's norm group).
    layout_group: dist.ProcessGroup | None = None


# The model's forward as a loss sees it: (packed_input_ids, cu_seqlens) -> output: an LM's final
# hidden states [total_tokens, hidden] (read log-probs off them with `module.shifted_logprobs`,
# which fuses the LM head), a critic's values [total_tokens].
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossFn = Callable[[Forward, SequenceSample], tuple[torch.Tensor, dict[str, float]]]


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
        backend: OptimizerBackendName = OptimizerBackendName.torch,
    ) -> None:
        """`backend`: the resolved `<role>.optimizer.backend` of a trainable engine (torch or
        megatron; `realrl.workers.model_loading.resolve_optimizer_backend` picks for auto)."""
        self.module = module
        self.tokenizer = tokenizer
        self.parallel = parallel
        self.optimizer_config = optimizer_config
        # Sampling; tp ranks of a replica must share the seed so that they sample alike.
        self.generator = torch.Generator(device=module.device).manual_seed(seed)
        self.home_device = module.device  # where the module computes; see offload()
        self.offloaded = False
        self.sharded_parameter_ids = sharded_parameter_ids(module)
        # The shared memory this engine's weights live in, when its data-parallel replicas
        # share one copy (`realloc.share_replica_weights`).
        self.shared_weights = None
        # The module computes with another engine's base weights, the same tensors
        # (`realrl.models.lora.base_view`): never shared, moved or offloaded on its own.
        self.shares_base = False
        # Forwards kept for the next train call, and the weights they were computed with.
        self._kept: list[_KeptForward] = []
        self._kept_weights: tuple[int, ...] = ()
        # The most tokens one forward ran since the worker last reset it (memory hints).
        self.largest_forward_tokens = 0
        # fp32 copies of a frozen low-precision module's weights that EMA updates blend into
        # (`ema_master`), by parameter name; made at the first blend.
        self.ema_masters: dict[str, torch.Tensor] = {}
        # `nan_policy` (the worker sets the run's), and the optimizer steps it skipped.
        self.nan_policy = NanPolicy.stop
        self.skipped_steps = 0
        # Optimizer steps that updated the weights: a fused step need not bump a tensor's
        # `_version`, so whoever caches a copy of the weights (`realrl.models.vllm_generation`)
        # reads this count too.
        self.optimizer_steps_taken = 0
        # Writes of the weights from outside: reallocations into this layout and checkpoint
        # loads (the worker counts them). A frozen replica that shares one copy of the weights
        # with its peers (`realrl.workers.realloc.share_replica_weights`) sees its tensors
        # change with no `_version` bump when a peer writes them: only this count tells.
        self.weights_received = 0
        # `gen.backend=vllm`: the vLLM engine colocated with this shard, built by its first
        # generate call (`realrl.interfaces.common.generate_with_backend`).
        self.vllm_generator: Any = None
        # Gradients, optimizer and LR schedule of a trainable engine (None when frozen).
        self.backend: OptimizerBackend | None = None
        if optimizer_config is None:
            module.requires_grad_(False)
        elif backend == OptimizerBackendName.megatron:
            from realrl.backends.megatron_optimizer import MegatronOptimizerBackend

            self.backend = MegatronOptimizerBackend(
                module, parallel, optimizer_config, total_optimizer_steps
            )
        else:
            self.backend = TorchOptimizerBackend(
                module, parallel, optimizer_config, total_optimizer_steps,
                self.sharded_parameter_ids,
            )

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer whose param groups carry the learning rate (None: frozen)."""
        return None if self.backend is None else self.backend.optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR | None:
        return None if self.backend is None else self.backend.lr_scheduler

    @property
    def device(self) -> torch.device:
        return self.module.device

    def offload(self) -> None:
        """Move a frozen model's weights to host memory until `onload`, freeing its GPU memory
        between uses (the offload hook). On a CPU engine there is nothing to free."""
        if self.backend is not None:
            raise RuntimeError("only frozen models are offloaded; this one has an optimizer")
        if self.shares_base:
            raise RuntimeError("this model computes with another role's base weights; "
                               "offloading it would move that role's weights too")
        self.release_generation_memory()
        if self.home_device.type == "cpu" or self.offloaded:
            return
        self.module.to("cpu")
        torch.cuda.empty_cache()
        self.offloaded = True

    def release_generation_memory(self) -> None:
        """Free the captured decode graphs and their KV caches (`realrl.models.cuda_graphs`),
        which otherwise stay on the GPU between `generate` calls: before a train step on the
        same module (a colocated actor) and before an offload. The next `generate` captures
        them again (~50 ms a graph on an H100, one per 32 new tokens)."""
        if getattr(self.module, "decode_graphs", None) is not None:
            release_decode_graphs(self.module)

    def onload(self) -> None:
        """Bring offloaded weights back to the engine's device (no-op when they are there)."""
        if self.offloaded:
            self.module.to(self.home_device)
            self.offloaded = False

    def forward(
        self, packed_input_ids: torch.Tensor, cu_seqlens: torch.Tensor, keep: bool = False
    ) -> torch.Tensor:
        """The module's output without the LM head (see `Forward`), detached.

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
                return self.module(packed_input_ids, cu_seqlens, apply_lm_head=False)
        assert self.backend is not None, "forward(keep=True) on a frozen model"
        weights = self._weights_version()
        if weights != self._kept_weights:
            self._kept, self._kept_weights = [], weights
        self.module.train()
        with torch.enable_grad():
            output = self.module(packed_input_ids, cu_seqlens, apply_lm_head=False)
        self._kept.append(_KeptForward(packed_input_ids, cu_seqlens, output))
        return output.detach()

    @property
    def weight_writes(self) -> int:
        """Grows with every optimizer step and every write from outside (`weights_received`):
        whoever caches a copy of the weights compares it with the count it copied at."""
        return self.optimizer_steps_taken + self.weights_received

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
            return self.module(packed_input_ids, cu_seqlens, apply_lm_head=False)

        return forward

    def train_microbatches(self, microbatches: Sequence[SequenceSample], loss_fn: LossFn) -> dict:
        """One optimizer step over `microbatches`; `loss_fn` returns each one's share of the
        whole-batch loss. Returns the summed stats plus `grad_norm`, `lr` and `forward_reused`
        (the fraction of micro-batches that took a kept forward, see `forward`).

        A low-precision module's gradients are summed in fp32 and the step is taken on its fp32
        masters, then rounded into its weights (`realrl.backends.mixed_precision`)."""
        assert self.backend is not None, "train_microbatches on a frozen model"
        self.release_generation_memory()
        self.module.train()
        self.backend.zero_gradients()
        totals: dict[str, float] = {}
        reused: list[int] = []
        forward = self._take_kept(reused)
        finite_losses = []
        for index, microbatch in enumerate(microbatches):
            loss, stats = loss_fn(forward, microbatch)
            finite_losses.append(torch.isfinite(loss.detach()))
            self.backend.backward(loss, last_microbatch=index == len(microbatches) - 1)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        bad_losses = [index for index, finite in enumerate(torch.stack(finite_losses).tolist())
                      if not finite]
        if bad_losses and self.nan_policy != NanPolicy.skip:
            raise NonFiniteError(
                f"non-finite loss in micro-batch {bad_losses[0] + 1} of {len(microbatches)} "
                f"(non-finite in micro-batches {[index + 1 for index in bad_losses]}); "
                "nan_policy=stop")
        lr = self.optimizer.param_groups[0]["lr"]
        # A non-finite norm never updates the weights, whichever the policy.
        grad_norm = self.backend.step(self.optimizer_config.gradient_clipping,
                                      skip_non_finite=True)
        if math.isfinite(grad_norm):
            self.lr_scheduler.step()
            self.optimizer_steps_taken += 1
        else:  # as in Megatron, a skipped step does not advance the learning-rate schedule
            self._non_finite_gradient_norm(grad_norm, bad_losses, len(microbatches))
        totals["grad_norm"] = float(grad_norm)
        totals["forward_reused"] = len(reused) / max(len(microbatches), 1)
        totals["lr"] = lr
        return totals

    def _non_finite_gradient_norm(self, grad_norm: float, bad_losses: list[int],
                                  num_microbatches: int) -> None:
        """The backend left the weights as they were; `nan_policy=stop` raises, `skip`
        counts the step and warns."""
        where = (f"non-finite losses in micro-batches {[index + 1 for index in bad_losses]} of "
                 f"{num_microbatches}" if bad_losses else
                 f"every loss of the {num_microbatches} micro-batch(es) finite")
        if self.nan_policy != NanPolicy.skip:
            raise NonFiniteError(f"non-finite gradient norm ({grad_norm}) with {where}; "
                                 "nan_policy=stop")
        self.skipped_steps += 1
        logger.warning("non-finite gradient norm (%s) with %s: optimizer step skipped "
                       "(nan_policy=skip)", grad_norm, where)

    def state_for_checkpoint(self) -> dict:
        """The optimizer backend's state (AdamW's, and for a low-precision module its fp32
        master weights: its bf16 weights alone would lose what the masters hold below one bf16
        spacing), the LR schedule, or the fp32 EMA masters of a frozen module. Empty for a
        frozen module without EMA masters."""
        state = {}
        if self.backend is not None:
            state = self.backend.state_dict()
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.ema_masters:
            state["ema_masters"] = dict(self.ema_masters)
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore `state_for_checkpoint`'s state. Saved fp32 masters become the masters (and,
        rounded, the weights); an fp32 module resuming a bf16 run takes them as its weights."""
        if self.backend is not None:
            self.backend.load_state_dict(state)
            if "lr_scheduler" in state:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "ema_masters" in state:
            self._load_ema_masters(state["ema_masters"])

    def weights_written(self) -> None:
        """The module's weights were written outside the optimizer (a checkpoint's weights
        loaded into it): the fp32 masters of a low-precision module take them, exactly, and
        EMA masters are made again from them at the next blend. `load_checkpoint_state` may
        then replace either with saved ones."""
        if self.backend is not None:
            self.backend.weights_written()
        self.ema_masters = {}

    def ema_master(self, name: str) -> torch.Tensor | None:
        """The fp32 copy of frozen low-precision parameter `name` that an EMA update
        (`target = eta * source + (1 - eta) * target`, `realrl.workers.realloc`) blends into
        before rounding into the weight; None for an fp32 or a trained module.

        Why: an EMA step moves a weight by `eta * (source - target)`, far below half a bf16
        spacing for the small etas EMA references use, so blending into the bf16 weight itself
        rounds every step away and the reference never moves. The copy costs 4 bytes per
        parameter of the EMA target's owning layout, and checkpoints keep it."""
        if self.backend is not None or self.module.dtype == torch.float32:
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
