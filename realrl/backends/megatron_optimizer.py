"""The megatron-core optimizer backend (`<role>.optimizer.backend=megatron`; `auto` on CUDA).

A trained role's module is wrapped in megatron-core's `DistributedDataParallel` and stepped by
its `DistributedOptimizer` (Rajbhandari et al. 2020, ZeRO stage 1 and 2):

- gradients accumulate, over micro-batches, into one contiguous fp32 buffer
  (`grad_reduce_in_fp32`: a bf16 gradient is added to its fp32 main gradient and freed as soon
  as the backward produces it); during the last micro-batch's backward each bucket of the
  buffer is reduce-scattered over the data-parallel group as soon as its gradients are done
  (`overlap_grad_reduce`), so data-parallel rank r ends up with the sums of its 1/d of the
  buffer only;
- the fp32 master weights and AdamW moments exist for that 1/d only; the global gradient norm
  is the sum of every rank's squared shard norms over the layout (each tensor-parallel
  replicated parameter counted on tp rank 0 only), clipping scales the shard, AdamW steps it,
  and the updated weights, rounded to the module's dtype, are all-gathered over the
  data-parallel group into the parameters themselves (their storage is megatron's parameter
  buffer: reallocation, EMA and checkpoints read the live, complete weights).

Per parameter, in bytes, with d data-parallel ranks: bf16 weights 2 + fp32 gradient buffer 4 +
(fp32 master 4 + AdamW moments 8) / d; fp32 weights 4 + 4 + 8 / d (the masters are the weights).
The torch backend holds 18 (bf16) or 16 (fp32) on every rank.

Process groups come from the role's own layout (`ParallelContext`), never from megatron's
`parallel_state` globals: realrl's layouts differ per MFC and a process hosts several. Every
group megatron asks for is passed explicitly (pipeline, expert and context parallelism are
size 1, a group of this rank alone), so megatron never creates a group itself.
`get_megatron_optimizer` is not used: its parameter grouping calls `all_gather_object` over
the *whole world* (megatron-core 0.16.1 and 0.17.1), which deadlocks a worker whose peers
build other roles at that moment; the `DistributedOptimizer` is built here from the same
parts, with one parameter group in which AdamW decays every parameter, as the torch backend
does (megatron's default exempts biases and norms).

megatron-core's DDP and optimizer allocate on `torch.cuda.current_device()` and check
`Tensor.type()` for CUDA types, so realrl runs this backend on CUDA workers only
(`realrl.workers.model_loading.resolve_optimizer_backend`); its tests run the same code on CPU
ranks under a test-only shim (`tests/megatron_cpu_shim.py`). Importing megatron-core
costs a process ~3 s, so only a process that builds this backend imports this module.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings

import torch
import torch.distributed as dist

from realrl.api.experiment import OptimizerConfig
from realrl.backends.optimizer_backend import make_lr_scheduler, sum_sequence_parallel_gradients

warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed", UserWarning)
# 0.17 warns at every TransformerConfig about a CUDA-graph default realrl does not use.
warnings.filterwarnings("ignore", "full scope is deprecated", UserWarning)
# At INFO, DDP logs its whole config and every parameter of every bucket, per model.
logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)

from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

# Parameters per gradient bucket; None: megatron's default, max(4e7, 1e6 x data-parallel size)
# (large enough for NCCL to run at bandwidth). Tests set a small one to get several buckets.
BUCKET_PARAMETERS: int | None = None


@functools.cache
def own_rank_group() -> dist.ProcessGroup:
    """A process group of this rank alone, for the parallel dimensions realrl does not use
    (pipeline, expert, context). Only this rank takes part in making it."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def process_group_collection(parallel) -> ProcessGroupCollection:
    """Every group megatron's DDP and optimizer read, from the layout's own groups."""
    own = own_rank_group()
    data = parallel.dp_group if parallel.dp_size > 1 else own
    tensor = parallel.tp_group if parallel.tp_size > 1 else own
    return ProcessGroupCollection(
        tp=tensor, pp=own, mp=tensor, cp=own, tp_cp=tensor, dp=data, dp_cp=data,
        ep=own, expt_dp=own, tp_ep_pp=tensor, intra_dist_opt=_layout_group(parallel, own),
    )


def _layout_group(parallel, own: dist.ProcessGroup) -> dist.ProcessGroup:
    """All ranks of the layout: the gradient norm sums squared shard norms over it."""
    if parallel.dp_size > 1 and parallel.tp_size > 1:
        if parallel.layout_group is None:
            raise ValueError(
                "a data- and tensor-parallel layout trained by the megatron backend needs "
                "ParallelContext.layout_group (every rank of the layout)"
            )
        return parallel.layout_group
    if parallel.dp_size > 1:
        return parallel.dp_group
    return parallel.tp_group if parallel.tp_size > 1 else own


class MegatronOptimizerBackend:
    """megatron-core DDP + DistributedOptimizer over one layout's groups
    (`realrl.backends.optimizer_backend.OptimizerBackend`)."""

    shards_over_data_parallel = True

    def __init__(self, module: torch.nn.Module, parallel, config: OptimizerConfig,
                 total_optimizer_steps: int) -> None:
        self.module = module
        self.parallel = parallel
        groups = process_group_collection(parallel)
        dtype = next(module.parameters()).dtype
        self.ddp = DistributedDataParallel(
            _transformer_config(module, parallel.tp_size, dtype),
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=True,
                use_distributed_optimizer=True,
                bucket_size=BUCKET_PARAMETERS,
            ),
            module,
            pg_collection=groups,
        )
        trainable = [p for p in module.parameters() if p.requires_grad]
        device = trainable[0].device
        adam = torch.optim.AdamW(
            [_parameter_group(trainable, config)],
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=device.type in ("cpu", "cuda"),
        )
        self.distributed = DistributedOptimizer(
            adam,
            MegatronOptimizerConfig(
                optimizer="adam", lr=config.lr, weight_decay=config.weight_decay,
                adam_beta1=config.beta1, adam_beta2=config.beta2, adam_eps=config.eps,
                bf16=dtype == torch.bfloat16, params_dtype=dtype,
                use_distributed_optimizer=True, clip_grad=math.inf,
            ),
            None,  # no loss scaling: bf16 has fp32's exponent range
            None,
            model_chunks=[self.ddp],
            per_model_buffers={0: self.ddp.buffers},
            data_parallel_group=groups.dp,
            data_parallel_group_gloo=None,
            data_parallel_group_idx=parallel.tp_rank,
            distributed_optimizer_instance_id=0,
        )
        # What `get_megatron_optimizer` sets: the norm's group and the group whose rank 0
        # counts replicated parameters.
        self.distributed.grad_stats_parallel_group = groups.intra_dist_opt
        self.distributed.tp_group = groups.tp
        # After DistributedOptimizer replaced the groups' parameters by this rank's shards.
        self.optimizer = adam
        self.lr_scheduler = make_lr_scheduler(adam, total_optimizer_steps, config)

    def zero_gradients(self) -> None:
        self.ddp.zero_grad_buffer()
        self.distributed.zero_grad()

    def backward(self, loss: torch.Tensor, last_microbatch: bool) -> None:
        """Micro-batches before the last only accumulate (`no_sync`); the last one's backward
        starts each bucket's reduce-scatter as soon as the bucket is complete."""
        if last_microbatch:
            loss.backward()
            return
        with self.ddp.no_sync():
            loss.backward()

    def step(self, max_norm: float, skip_non_finite: bool = False) -> float:
        """`DistributedOptimizer.step()` in its three parts, so that a non-finite norm can
        stop before the update (`skip_non_finite`)."""
        self.ddp.finish_grad_sync()
        # Sequence-parallel norms: summed over tp after the data-parallel reduce-scatter, as
        # megatron's `finalize_model_grads` does (tp peers own the same buffer ranges, so this
        # rank's range ends up summed over both; the rest of the buffer is not read).
        sum_sequence_parallel_gradients(
            [(p, p.main_grad) for p in self.module.parameters() if p.requires_grad],
            self.parallel,
        )
        if self.distributed.prepare_grads():  # only a loss scaler (fp16) finds infs here
            raise RuntimeError("megatron's DistributedOptimizer skipped the step")
        # inf: megatron still measures the norm, and max_norm / norm is never below 1.
        grad_norm = float(self.distributed.clip_grad_norm(max_norm if max_norm > 0 else math.inf))
        if skip_non_finite and not math.isfinite(grad_norm):
            return grad_norm
        self.distributed.step_with_ready_grads()
        return grad_norm

    def _layout(self) -> dict:
        parallel = self.parallel
        return {
            "backend": "megatron",
            "data_parallel": (parallel.dp_rank, parallel.dp_size),
            "tensor_parallel": (parallel.tp_rank, parallel.tp_size),
            "shard_numels": [p.numel() for p in self.optimizer.param_groups[0]["params"]],
        }

    def master_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master shards of the low-precision parameters (none in fp32: the
        masters of fp32 parameters are views of the parameters themselves)."""
        return [m for group in self.distributed.shard_fp32_from_float16_groups for m in group]

    def state_dict(self) -> dict:
        """AdamW's state and the fp32 masters, of this rank's shard only."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": [m.detach() for m in self.master_shards()],
            "layout": self._layout(),
        }

    def load_state_dict(self, state: dict) -> None:
        saved, expected = state.get("layout"), self._layout()
        if saved != expected:
            raise ValueError(
                f"this optimizer state was written by {_describe(saved)}, and this rank is "
                f"{_describe(expected)}: the distributed optimizer's shards follow the layout; "
                "resume with the allocation and `<role>.optimizer.backend` that wrote the "
                "checkpoint, or start a new run from its Hugging Face weights "
                "(`<role>.path=<checkpoint>/<role>`)"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        masters = self.master_shards()
        if masters:  # the weights, loaded from the checkpoint's HF files, are these rounded
            with torch.no_grad():
                device = masters[0].device
                torch._foreach_copy_(masters, [m.to(device) for m in state["master_weights"]])

    def weights_written(self) -> None:
        """This rank's master shards take the module's weights."""
        self.distributed.reload_model_params()


def _describe(layout: dict | None) -> str:
    if layout is None or layout.get("backend") != "megatron":
        return "another optimizer backend (torch)"
    (dp_rank, dp_size), (tp_rank, tp_size) = layout["data_parallel"], layout["tensor_parallel"]
    return (f"data-parallel rank {dp_rank} of {dp_size}, tensor-parallel rank {tp_rank} of "
            f"{tp_size}, shards of {sum(layout['shard_numels'])} values")


def _parameter_group(parameters: list[torch.nn.Parameter], config: OptimizerConfig) -> dict:
    """One AdamW group with the keys megatron's optimizer reads from the groups it makes."""
    return {
        "params": parameters, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
        "is_decoupled_lr": False, "max_lr": config.lr, "min_lr": config.lr * config.min_lr_ratio,
        "default_config": True,
    }


def _transformer_config(module: torch.nn.Module, tp_size: int,
                        dtype: torch.dtype) -> TransformerConfig:
    """What megatron's DDP reads of a model config. `calculate_per_token_loss=True`: gradients
    are summed over data-parallel ranks, not averaged (realrl's losses carry whole-batch
    denominators)."""
    config = module.config
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        tensor_model_parallel_size=tp_size,
        calculate_per_token_loss=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
