"""LoRA adapters of the packed transformer (Hu et al. 2021), sharded like their base layers.

An adapted projection computes `W x + scaling * B A dropout(x)`, scaling = alpha / rank, with
one factor pair per Hugging Face projection (PEFT's parametrisation): realrl's fused `qkv`
gets A [rank, hidden] and B [q | k | v size, rank] for each of q_proj, k_proj and v_proj it
targets, `gate_up` one pair each for gate_proj and up_proj. A fused layer runs its pairs as
one matmul with the stacked A's and one with the block-diagonal B's (zero blocks for the
components not targeted). The adapters are the optional modules `Attention.qkv_lora`,
`Attention.output_lora`, `MLP.gate_up_lora` and `MLP.down_lora`; their parameters are named

    layers.{i}.attention.qkv_lora.lora_A.q_proj     [rank, hidden]
    layers.{i}.attention.qkv_lora.lora_B.q_proj     [heads * head_dim, rank]
    layers.{i}.mlp.down_lora.lora_A.down_proj       [rank, intermediate] ...

and every other name stays the base model's, so checkpoints, reallocation and the HF
conversion treat the base as before.

Tensor parallelism (Shoeybi et al. 2019) splits an adapter where its layer splits: beside a
column-parallel layer (`qkv`, `gate_up`: outputs split) A is replicated and B split along its
output rows, per component as the fused weight is; the rank-sized activation `A x` goes
through an identity whose backward all-reduces over the tp group, so every rank gets the
whole gradient of A and of the layer's input. Beside a row-parallel layer (`output`, `down`:
inputs split) A is split along its input columns and B replicated; the partial `A x_r` of
each rank is all-reduced (rank values per token) before B, and its backward is the identity.
Replicated factors thus get identical gradients on every tp rank, and split ones are marked
`tensor_model_parallel` like megatron's split weights, so the optimizer backends' gradient
norm counts each once. Sequence parallelism is refused (`realrl.api.lora`).

Initialisation is PEFT's (A Kaiming-uniform, B zero), drawn from a generator seeded by the
run's seed and the parameter's name, for the whole factor before it is split: every rank,
replica and layout of a role starts from the same adapter, whatever its layout.
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from realrl.api.lora import LoRAConfig
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer

# realrl's name piece of every adapter (`layers.{i}.attention.qkv_lora.lora_A.q_proj`).
ADAPTER_MARK = "_lora."


@dataclass(frozen=True)
class AdaptedLayer:
    """Where an adapter sits: `owner` (attention or mlp) . `layer`, its HF components with
    their full output sizes, its full input size, and how tensor parallelism splits it."""

    owner: str
    layer: str
    components: tuple[tuple[str, int], ...]
    in_features: int
    split: str  # "column" (outputs split) or "row" (inputs split)

    @property
    def attribute(self) -> str:
        return f"{self.layer}_lora"


def adapted_layers(config: ModelConfig) -> tuple[AdaptedLayer, ...]:
    """The four projections of a block that can carry adapters, with full sizes."""
    head_dim, hidden = config.head_dim, config.hidden_size
    query, key_value = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    intermediate = config.intermediate_size
    return (
        AdaptedLayer("attention", "qkv",
                     (("q_proj", query), ("k_proj", key_value), ("v_proj", key_value)),
                     hidden, "column"),
        AdaptedLayer("attention", "output", (("o_proj", hidden),), query, "row"),
        AdaptedLayer("mlp", "gate_up", (("gate_proj", intermediate), ("up_proj", intermediate)),
                     hidden, "column"),
        AdaptedLayer("mlp", "down", (("down_proj", hidden),), intermediate, "row"),
    )


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the tp group (each rank's B
    slice contributed part of it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce forward (each rank's A slice saw its slice of the input); identity backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class LoRAAdapter(nn.Module):
    """The adapter of one (fused) projection: `forward(x)` is the delta its layer's output gets.

    `components`: (HF name, this rank's output rows) of every component of the layer, in the
    fused weight's order; `targeted`: the names that have factors. `in_features`: this rank's
    input width. `split`/`group`: how tensor parallelism splits the layer (group None: one
    device)."""

    def __init__(self, components: list[tuple[str, int]], targeted: list[str],
                 in_features: int, rank: int, scaling: float, dropout: float, split: str,
                 group: dist.ProcessGroup | None, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.components = list(components)
        self.targeted = [name for name, _ in components if name in targeted]
        self.scaling = scaling
        self.dropout = dropout
        self.split = split
        self.group = group
        sizes = dict(components)
        self.lora_A = nn.ParameterDict({
            name: nn.Parameter(torch.zeros(rank, in_features, dtype=dtype, device=device))
            for name in self.targeted})
        self.lora_B = nn.ParameterDict({
            name: nn.Parameter(torch.zeros(sizes[name], rank, dtype=dtype, device=device))
            for name in self.targeted})

    def stacked_a(self) -> torch.Tensor:
        """[targeted * rank, in]: every targeted component's A, stacked."""
        factors = [self.lora_A[name] for name in self.targeted]
        return factors[0] if len(factors) == 1 else torch.cat(factors)

    def block_b(self) -> torch.Tensor:
        """[out, targeted * rank]: each component's B in its rows and its A's columns, zero
        rows for the components not targeted."""
        if len(self.components) == 1:
            return self.lora_B[self.targeted[0]]
        reference = self.lora_B[self.targeted[0]]
        blocks = [self.lora_B[name] if name in self.lora_B
                  else reference.new_zeros(size, 0) for name, size in self.components]
        return torch.block_diag(*blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in] (this rank's input) -> the output's delta [..., out]."""
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            hidden = F.dropout(hidden, self.dropout, training=True)
        low_rank = F.linear(hidden, self.stacked_a()) * self.scaling  # [..., targeted * rank]
        if self.group is not None and self.split == "column":
            low_rank = _CopyToGroup.apply(low_rank, self.group)
        elif self.group is not None:
            low_rank = _SumOverGroup.apply(low_rank, self.group)
        return F.linear(low_rank, self.block_b())

    def features_first(self, hidden: torch.Tensor) -> torch.Tensor:
        """The delta for features-first activations [in, rows] -> [out, rows] (the CPU
        decode step; one device, no dropout)."""
        return torch.mm(self.block_b(), torch.mm(self.stacked_a(), hidden) * self.scaling)


def add_adapters(model: Transformer, lora: LoRAConfig, seed: int) -> Transformer:
    """Freeze `model` (a full model or one tp rank's shard) and give it `lora`'s adapters,
    initialised from `seed` (equal on every rank and layout); a critic's value head stays
    trainable. Returns `model`."""
    factory = model.layer_factory
    group = factory.process_group if factory.tp_size > 1 else None
    tp_size = factory.tp_size
    tp_rank = dist.get_rank(group) if group is not None else 0
    model.requires_grad_(False)
    for index, block in enumerate(model.layers):
        for layer in adapted_layers(model.config):
            targeted = [name for name, _ in layer.components if name in lora.target_modules]
            if not targeted:
                continue
            column = layer.split == "column"
            components = [(name, size // tp_size if column else size)
                          for name, size in layer.components]
            adapter = LoRAAdapter(
                components, targeted, layer.in_features if column else layer.in_features // tp_size,
                lora.rank, lora.scaling, lora.dropout, layer.split, group, model.dtype,
                model.device)
            _initialise(adapter, f"layers.{index}.{layer.owner}.{layer.attribute}", seed,
                        layer.in_features, tp_rank, tp_size)
            if tp_size > 1:
                _mark_split(adapter)
            setattr(getattr(block, layer.owner), layer.attribute, adapter)
    if model.value_head is not None:  # a critic's head is new: it trains beside the adapters
        model.value_head.requires_grad_(True)
    model.lora_config = lora
    return model


@torch.no_grad()
def _initialise(adapter: LoRAAdapter, prefix: str, seed: int, in_features: int,
                tp_rank: int, tp_size: int) -> None:
    """PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (`kaiming_uniform_(a=sqrt(5))`), drawn
    whole from a generator seeded by `seed` and the name, then this rank's columns; B = 0."""
    if adapter.lora_A and next(iter(adapter.lora_A.values())).is_meta:
        return
    bound = 1.0 / math.sqrt(in_features)
    for name, factor in adapter.lora_A.items():
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{prefix}.{name}".encode()))
        full = torch.empty(factor.shape[0], in_features).uniform_(-bound, bound,
                                                                   generator=generator)
        if adapter.split == "row":
            full = full.chunk(tp_size, dim=1)[tp_rank]
        factor.copy_(full)


def _mark_split(adapter: LoRAAdapter) -> None:
    """Mark the split factors as megatron marks its split weights (`tensor_model_parallel`,
    `partition_dim`), for the gradient norm and the tp-aware optimizer backends."""
    split = adapter.lora_B if adapter.split == "column" else adapter.lora_A
    for factor in split.values():
        factor.tensor_model_parallel = True
        factor.partition_dim = 0 if adapter.split == "column" else 1
        factor.partition_stride = 1


def has_adapters(model: Transformer) -> bool:
    return getattr(model, "lora_config", None) is not None


def is_adapter_parameter(name: str) -> bool:
    return ADAPTER_MARK in name


def trained_parameter_names(model: Transformer) -> list[str]:
    """The parameters of an adapted model that change in a run: the adapters, and a critic's
    value head. Reallocation and checkpoints move only these."""
    return [name for name, _ in model.named_parameters()
            if is_adapter_parameter(name) or name == "value_head.weight"]


def base_view(donor: Transformer, lora: LoRAConfig | None, seed: int) -> Transformer:
    """A model computing with `donor`'s base weights, the same tensors (no copy), without
    `donor`'s adapters: with `lora` enabled it gets adapters of its own (an EMA reference's),
    else it is the base model itself. The view's own settings (compiled blocks, prefix
    sharing, the thread hook) start unset; nothing the view sets reaches `donor`."""
    view = _shallow_clone(donor)
    view.layers = nn.ModuleList(_view_block(block) for block in donor.layers)
    view.compiled_blocks = None
    view.between_layers = None
    view.lora_config = None
    if lora is not None and lora.enabled:
        add_adapters(view, lora, seed)
    else:
        view.requires_grad_(False)
    return view


def _shallow_clone(module: nn.Module) -> nn.Module:
    """A new module object holding the same children, parameters and buffers."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def _view_block(block: nn.Module) -> nn.Module:
    view = _shallow_clone(block)
    for owner in ("attention", "mlp"):
        owner_view = _shallow_clone(getattr(block, owner))
        for attribute in ("qkv_lora", "output_lora", "gate_up_lora", "down_lora"):
            if getattr(owner_view, attribute, None) is not None:
                setattr(owner_view, attribute, None)
        setattr(view, owner, owner_view)
    return view


def merged_state_dict(full: dict[str, torch.Tensor], config: ModelConfig,
                      lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """The base weights with every adapter merged in (W + scaling * B A per component), from
    a full (unsharded) realrl-named state dict holding both; adapters dropped."""
    merged = {name: tensor for name, tensor in full.items() if not is_adapter_parameter(name)}
    for index in range(config.num_hidden_layers):
        for layer in adapted_layers(config):
            prefix = f"layers.{index}.{layer.owner}"
            weight_name = f"{prefix}.{layer.layer}.weight"
            pieces = list(merged[weight_name].split([size for _, size in layer.components]))
            for position, (name, _) in enumerate(layer.components):
                factor_a = full.get(f"{prefix}.{layer.attribute}.lora_A.{name}")
                if factor_a is None:
                    continue
                factor_b = full[f"{prefix}.{layer.attribute}.lora_B.{name}"]
                delta = lora.scaling * (factor_b.float() @ factor_a.float())
                pieces[position] = (pieces[position].float() + delta).to(pieces[position].dtype)
            merged[weight_name] = torch.cat(pieces)
    return merged
