"""Megatron-style tensor parallelism for the packed transformer, on any torch.distributed group.

Every layer takes an explicit `process_group`; nothing reads global state, so several
tensor-parallel groups can live in one world (one per model role and allocation).

- Column-parallel linear: weight rows (output features) split across ranks; the input is
  replicated, so its gradient is all-reduced in backward (the "f" operator of Megatron-LM,
  Shoeybi et al. 2019, section 3).
- Row-parallel linear: weight columns (input features) split; the partial outputs are
  all-reduced in forward (the "g" operator), gradients pass through unchanged.
- Vocab-parallel embedding: each rank holds a contiguous slice of the vocabulary, looks up
  the ids it owns, and the rows are summed across ranks.
- The LM head is column-parallel over the vocabulary with the logits gathered back, so a
  tensor-parallel model returns the same [total_tokens, vocab] logits as a single device.

`shard_state_dict` / `unshard_state_dicts` convert realrl-named state dicts (as returned by
`Transformer.state_dict()`) between the full model and its tensor-parallel shards. Fused
weights are split per component, so rank r holds [its q heads; its k heads; its v heads]
and [its gate rows; its up rows].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from realrl.models.config import ModelConfig
from realrl.models.layers import LinearKind


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, tensor, process_group):
        ctx.process_group = process_group
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.process_group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, tensor, process_group):
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, group=process_group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice in backward."""

    @staticmethod
    def forward(ctx, tensor, process_group):
        ctx.process_group = process_group
        size = dist.get_world_size(process_group)
        pieces = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(pieces, tensor.contiguous(), group=process_group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.process_group)
        rank = dist.get_rank(ctx.process_group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def _local_size(size: int, process_group, what: str) -> int:
    world = dist.get_world_size(process_group)
    if size % world != 0:
        raise ValueError(f"{what}={size} is not divisible by tensor-parallel size {world}")
    return size // world


class ColumnParallelLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        process_group,
        gather_output: bool = False,
    ):
        super().__init__()
        self.process_group = process_group
        self.gather_output = gather_output
        local_out = _local_size(out_features, process_group, "out_features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.zeros(local_out)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = _CopyToParallel.apply(hidden, self.process_group)
        out = F.linear(hidden, self.weight, self.bias)
        return _GatherLastDim.apply(out, self.process_group) if self.gather_output else out


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, process_group):
        super().__init__()
        self.process_group = process_group
        local_in = _local_size(in_features, process_group, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromParallel.apply(F.linear(hidden, self.weight), self.process_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, process_group):
        super().__init__()
        self.process_group = process_group
        local_vocab = _local_size(num_embeddings, process_group, "vocab_size")
        self.vocab_start = dist.get_rank(process_group) * local_vocab
        self.weight = nn.Parameter(torch.empty(local_vocab, embedding_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        rows = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromParallel.apply(rows, self.process_group)

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits through the (tied) embedding matrix."""
        hidden = _CopyToParallel.apply(hidden, self.process_group)
        return _GatherLastDim.apply(F.linear(hidden, self.weight), self.process_group)


class TensorParallelLayerFactory:
    """`LayerFactory` making tensor-parallel layers on `process_group`."""

    def __init__(self, process_group) -> None:
        self.process_group = process_group
        self.tp_size = dist.get_world_size(process_group)

    def linear(
        self, in_features: int, out_features: int, bias: bool, kind: LinearKind
    ) -> nn.Module:
        if kind == "column":
            return ColumnParallelLinear(in_features, out_features, bias, self.process_group)
        if kind == "row":
            return RowParallelLinear(in_features, out_features, bias, self.process_group)
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        return VocabParallelEmbedding(num_embeddings, embedding_dim, self.process_group)

    def lm_head(self, in_features: int, vocab_size: int) -> nn.Module:
        return ColumnParallelLinear(
            in_features, vocab_size, False, self.process_group, gather_output=True
        )


def _split_rule(name: str, config: ModelConfig) -> tuple[int, list[int]] | None:
    """(split dimension, fused component sizes) of a realrl weight, or None if replicated."""
    head_dim = config.head_dim
    if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
        kv = config.num_key_value_heads * head_dim
        return 0, [config.num_attention_heads * head_dim, kv, kv]
    if name.endswith("mlp.gate_up.weight"):
        return 0, [config.intermediate_size] * 2
    if name.endswith(("attention.output.weight", "mlp.down.weight")):
        return 1, []
    if name in ("embedding.weight", "lm_head.weight"):
        return 0, []
    return None


def shard_state_dict(
    full_sd: dict[str, torch.Tensor], tp_rank: int, tp_size: int, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """This rank's slice of a full realrl-named state dict."""
    shard = {}
    for name, tensor in full_sd.items():
        rule = _split_rule(name, config)
        if rule is None:
            shard[name] = tensor
            continue
        dim, sizes = rule
        components = tensor.split(sizes, dim) if sizes else [tensor]
        shard[name] = torch.cat([c.chunk(tp_size, dim)[tp_rank] for c in components], dim).clone()
    return shard


def unshard_state_dicts(
    shard_sds: list[dict[str, torch.Tensor]], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """The full state dict from every rank's shard, in rank order (inverse of shard_state_dict)."""
    tp_size = len(shard_sds)
    full = {}
    for name, tensor in shard_sds[0].items():
        rule = _split_rule(name, config)
        if rule is None:
            full[name] = tensor
            continue
        dim, sizes = rule
        local_sizes = [size // tp_size for size in sizes]
        per_rank = [
            shard[name].split(local_sizes, dim) if sizes else [shard[name]] for shard in shard_sds
        ]
        full[name] = torch.cat([torch.cat(parts, dim) for parts in zip(*per_rank)], dim)
    return full
