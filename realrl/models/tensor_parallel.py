"""Tensor parallelism's weight layout: realrl-named state dicts of the full model <-> shards.

The layers themselves are megatron-core's (`realrl.models.megatron_layers`, imported only by a
process that builds a tensor-parallel model). This module, plain torch, knows how those layers
split each weight, so that checkpoints (`realrl.workers.checkpointing`) and parameter
reallocation (`realrl.workers.realloc`) can convert between the full model and its shards
without importing megatron-core:

- column-parallel weights and biases (`attention.qkv`, `mlp.gate_up`) and the
  vocabulary-parallel embedding and LM head are split along dim 0 (megatron's
  `partition_dim=0`), row-parallel weights (`attention.output`, `mlp.down`) along dim 1;
- everything else (norms, a critic's value head) is replicated;
- LoRA adapters (`realrl.models.lora`) split like their layer: beside a column-parallel layer
  B along dim 0 (each component's B alone, unfused) and A replicated, beside a row-parallel
  one A along dim 1 and B replicated.

Fused weights are split per component, so rank r holds [its q heads; its k heads; its v heads]
and [its gate rows; its up rows]: to megatron's layers a fused weight is one matrix, and the
model splits the rank's output into its own heads (`Attention.project`, `MLP.forward`).
"""

from __future__ import annotations

import torch

from realrl.models.config import ModelConfig


def _split_rule(name: str, config: ModelConfig) -> tuple[int, list[int]] | None:
    """(split dimension, fused component sizes) of a realrl weight, or None if replicated."""
    head_dim = config.head_dim
    if "_lora.lora_" in name:
        return _adapter_split_rule(name)
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


def _adapter_split_rule(name: str) -> tuple[int, list[int]] | None:
    """A LoRA factor's split: B beside column-parallel layers, A beside row-parallel ones."""
    if (".qkv_lora.lora_B." in name) or (".gate_up_lora.lora_B." in name):
        return 0, []
    if (".output_lora.lora_A." in name) or (".down_lora.lora_A." in name):
        return 1, []
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
