"""Build a model worker's engine for one model role from its checkpoint directory.

A tensor-parallel layout (tp size > 1) loads the full checkpoint, then keeps this rank's shard
(`realrl.models.tensor_parallel.shard_state_dict`) in a module built with megatron-core's
tensor-parallel layers on the layout's tp group (`realrl.models.megatron_layers`, imported
only then: importing megatron-core costs a process ~3 s). Divisibility of heads, vocabulary and
MLP size by the tp size is checked when the plan is made.

`<role>.compile=true` compiles the blocks of the loaded module (`realrl.models.compiled`) for
its training and inference forwards; tensor-parallel shards stay eager (see there).
`<role>.gradient_checkpointing=true` recomputes each block in the backward
(`Transformer.gradient_checkpointing`), compiled or not, sharded or not.

A trained layout's optimizer backend follows `<role>.optimizer.backend`
(`resolve_optimizer_backend`): auto picks megatron-core's DDP and distributed optimizer on CUDA
workers and the torch backend on CPU ones.

`<role>.lora.rank > 0` freezes the loaded shard and adds LoRA adapters beside its projections
(`realrl.models.lora`), initialised from the run's seed alike on every rank and layout, so
only they (and a critic's value head) get gradients and optimizer state. A role whose spec
names `shares_base_with` (ppo-math's reference of an actor with adapters) loads nothing: its
engine computes with the base weights of that role's shard on the same rank and tp slicing
(`base_donor`), the same tensors, without that role's adapters (`realrl.models.lora.base_view`).
"""

from __future__ import annotations

import logging

import torch

from realrl.api.config import ConfigError
from realrl.api.experiment import ModelKind, ModelSpec, OptimizerBackendName
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.backends.worker_device import worker_device
from realrl.models.checkpoint import load_pretrained
from realrl.models.compiled import enable_compiled_blocks
from realrl.models.lora import add_adapters, base_view
from realrl.models.tensor_parallel import shard_state_dict
from realrl.models.tokenizer import load_tokenizer
from realrl.models.transformer import Transformer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parameter_dtype(spec: ModelSpec) -> torch.dtype:
    """The torch dtype of `spec`'s parameters. `resolve_config` fills every null `<role>.dtype`,
    so a null here is a config that skipped resolution (a programming error)."""
    if spec.config.dtype is None:
        raise ValueError(
            f"model role {spec.role!r} has dtype null: resolve the experiment config with "
            "`realrl.api.config.resolve_config` (or call its `resolve_dtypes()`) before "
            "building the plan"
        )
    return DTYPES[spec.config.dtype.value]


def resolve_optimizer_backend(spec: ModelSpec, device: torch.device) -> OptimizerBackendName:
    """`<role>.optimizer.backend` of a trained role on a worker computing on `device`: auto is
    megatron on CUDA and torch on CPU; megatron on a CPU worker is refused (megatron-core's DDP
    and optimizer allocate on the GPU; a local launch refuses it before starting workers)."""
    problem = spec.megatron_without_cuda(device.type)
    if problem is not None:
        raise ConfigError([problem])
    chosen = spec.config.optimizer.backend
    if chosen != OptimizerBackendName.auto:
        return chosen
    return OptimizerBackendName.megatron if device.type == "cuda" else OptimizerBackendName.torch


def shard_module(
    full: Transformer, parallel: ParallelContext, sequence_parallel: bool = False
) -> Transformer:
    """`full`'s tensor-parallel shard for `parallel.tp_rank`, with layers on `parallel.tp_group`
    (the full module itself when the tp size is 1), sequence parallel if asked."""
    if parallel.tp_size == 1:
        return full
    from realrl.models.megatron_layers import TensorParallelLayerFactory

    config = full.config
    factory = TensorParallelLayerFactory(parallel.tp_group, full.dtype, sequence_parallel)
    with torch.device(full.device):  # megatron allocates (uninitialised) on the default device
        module = Transformer(config, factory).to(full.dtype)  # the norms are made in fp32
    shard = shard_state_dict(full.state_dict(), parallel.tp_rank, parallel.tp_size, config)
    # Copied in, not assigned: the parameters keep megatron's tensor-parallel attributes
    # (`tensor_model_parallel`, `partition_dim`) that `sharded_parameter_ids` reads.
    module.load_state_dict(shard, strict=True)
    module.attention_kernel = full.attention_kernel
    module.share_prefixes = full.share_prefixes
    return module


def base_donor(spec: ModelSpec, parallel: ParallelContext, hosted: dict) -> TorchEngine | None:
    """The engine, among `hosted` (layout -> `HostedModel` of this rank), whose base weights a
    role with `shares_base_with` uses: one of that role's, sliced like `parallel` (the same tp
    size and rank); None if this rank has none (the plan check, `realrl.api.lora`, refuses
    such allocations before a run starts)."""
    for layout, model in sorted(hosted.items()):
        engine = model.engine
        if (layout.role == spec.shares_base_with and engine.parallel.tp_size == parallel.tp_size
                and engine.parallel.tp_rank == parallel.tp_rank):
            return engine
    return None


def load_engine(
    spec: ModelSpec, parallel: ParallelContext, trains: bool, total_optimizer_steps: int,
    seed: int, adapter_seed: int = 0, donor: TorchEngine | None = None,
) -> TorchEngine:
    """Load `spec`'s weights (the launcher has resolved every path), shard them when the layout
    is tensor parallel, and wrap them in an engine with an optimizer when this layout trains
    the role. `seed` seeds sampling: give every tp rank of a replica the same one.
    `adapter_seed` (the run's seed) initialises LoRA adapters; `donor` (`base_donor`) holds
    the base weights of a role with `shares_base_with`."""
    if spec.shares_base_with is not None:
        return _base_view_engine(spec, parallel, donor, adapter_seed, seed)
    device = worker_device()
    backend = resolve_optimizer_backend(spec, device) if trains else OptimizerBackendName.torch
    if trains:
        logger.info("%s trains with the %s optimizer backend", spec.role, backend.value)
    module = load_pretrained(
        spec.config.path,
        critic=spec.kind == ModelKind.critic,
        dtype=parameter_dtype(spec),
        device=device,
    )
    module.share_prefixes = spec.config.share_prefixes
    sequence_parallel = spec.config.sequence_parallel and parallel.tp_size > 1
    if sequence_parallel and device.type != "cuda":
        raise ConfigError([spec.sequence_parallel_without_cuda(device.type)])
    module = shard_module(module, parallel, sequence_parallel)
    lora = spec.config.lora
    if lora.enabled:
        if lora.dropout > 0 and parallel.tp_size > 1:
            raise ConfigError([f"`{spec.config_key('lora.dropout')}={lora.dropout}` with "
                               "tensor parallelism: the tp ranks would drop different inputs; "
                               "set it to 0"])
        add_adapters(module, lora, adapter_seed)
    module.gradient_checkpointing = spec.config.gradient_checkpointing
    if spec.config.compile:
        key = spec.config_key("compile")
        if parallel.tp_size == 1:
            enable_compiled_blocks(module, key)
        else:
            logger.warning(
                "%s=true is ignored: compiled blocks need tensor-parallel size 1, this "
                "layout has %d; the model runs eager",
                key,
                parallel.tp_size,
            )
    tokenizer = load_tokenizer(spec.config.path)
    return TorchEngine(
        module,
        tokenizer,
        parallel,
        optimizer_config=spec.config.optimizer if trains else None,
        total_optimizer_steps=total_optimizer_steps,
        seed=seed,
        backend=backend,
    )


def _base_view_engine(spec: ModelSpec, parallel: ParallelContext, donor: TorchEngine | None,
                      adapter_seed: int, seed: int) -> TorchEngine:
    """A frozen engine on `donor`'s base weights (no copy), with adapters of its own when
    `spec.config.lora` asks for them (an EMA reference)."""
    if donor is None:
        raise ConfigError([
            f"role {spec.role!r} uses the base weights of role {spec.shares_base_with!r}, and "
            f"this rank holds no {spec.shares_base_with!r} layout with tensor-parallel size "
            f"{parallel.tp_size}: give {spec.role!r}'s MFCs the layout of one of "
            f"{spec.shares_base_with!r}'s MFCs in `allocation_mode`"])
    lora = spec.config.lora
    view = base_view(donor.module, lora if lora.enabled else None, adapter_seed)
    view.share_prefixes = spec.config.share_prefixes
    if spec.config.compile and parallel.tp_size == 1 and not lora.enabled:
        enable_compiled_blocks(view, spec.config_key("compile"))
    engine = TorchEngine(view, donor.tokenizer, parallel, seed=seed)
    engine.shares_base = True
    logger.info("%s computes with %s's base weights (no copy of its own)%s", spec.role,
                spec.shares_base_with, ", with an adapter of its own" if lora.enabled else "")
    return engine
