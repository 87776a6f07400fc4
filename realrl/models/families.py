"""Model families: how a Hugging Face checkpoint maps onto realrl's `ModelConfig` and weights.

A family is a small record: the HF `model_type` and architecture class name, and two config
translators. Llama, Qwen2, Qwen3 and Mistral share one weight layout, described once by
`weight_rules` below:

    realrl name                              Hugging Face name(s)
    embedding.weight                         model.embed_tokens.weight
    layers.{i}.attention_norm.weight         model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.qkv.{weight,bias}   model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}
                                             (concatenated along the output dimension)
    layers.{i}.attention.{q,k}_norm.weight   model.layers.{i}.self_attn.{q,k}_norm.weight (Qwen3)
    layers.{i}.attention.output.weight       model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.mlp_norm.weight               model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.gate_up.weight            model.layers.{i}.mlp.{gate,up}_proj.weight (concatenated)
    layers.{i}.mlp.down.weight               model.layers.{i}.mlp.down_proj.weight
    final_norm.weight                        model.norm.weight
    lm_head.weight                           lm_head.weight (absent when embeddings are tied)
    value_head.weight                        score.weight (critics and reward models only)

Critics and reward models are saved as transformers' `<Family>ForSequenceClassification` with
one label, so `AutoModelForSequenceClassification` loads them with their trained head. Such
checkpoints, from realrl or elsewhere, load as critics; so does realrl's older critic format
(`value_head.weight` under a `*ForCausalLM` config marked `"realrl_critic": true`).

Families are looked up by `model_type` with `get_family`; a miss lists the supported types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from realrl.models.config import ModelConfig

VALUE_HEAD_NAME = "value_head.weight"  # realrl's parameter; also the head of older realrl critics
SCORE_HEAD_NAME = "score.weight"  # transformers' sequence-classification head, [num_labels, hidden]
LEGACY_CRITIC_CONFIG_KEY = "realrl_critic"  # config.json mark of older realrl critic checkpoints
SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]

    @property
    def critic_architecture(self) -> str:
        """The transformers class critics and reward models are saved as, e.g.
        `Qwen2ForSequenceClassification` for `Qwen2ForCausalLM`."""
        return self.architecture.removesuffix("ForCausalLM") + SEQUENCE_CLASSIFICATION_SUFFIX


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def get_family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}. "
            "Add a Family in realrl/models/families.py to support another architecture."
        )
    return FAMILIES[model_type]


# ---------------------------------------------------------------- config translation


def is_critic_config(hf: dict[str, Any]) -> bool:
    """Whether config.json describes a scalar-score model: a transformers sequence classifier
    (one label) or an older realrl critic."""
    if hf.get(LEGACY_CRITIC_CONFIG_KEY):
        return True
    architectures = hf.get("architectures") or []
    if not any(name.endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for name in architectures):
        return False
    num_labels = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", 1)
    if num_labels != 1:
        raise ValueError(
            f"{architectures[0]} with {num_labels} labels is not supported: realrl critics and "
            "reward models output one scalar score (num_labels=1)"
        )
    return True


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Reads both transformers>=5 `rope_parameters` and older `rope_theta` + `rope_scaling`."""
    parameters = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(parameters.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in parameters and "rope_type" not in parameters:
        parameters["rope_type"] = parameters.pop("type")
    if parameters.get("rope_type", "default") == "default":
        return theta, None
    return theta, parameters


def _llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("Llama checkpoints with attention_bias or mlp_bias are not supported")
    model_type = hf["model_type"]
    rope_theta, rope_scaling = _rope_from_hf(hf)
    sliding_window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        sliding_window = _qwen_sliding_window(hf)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding_window,
        is_critic=is_critic_config(hf),
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def _qwen_sliding_window(hf: dict[str, Any]) -> int | None:
    """Qwen2/Qwen3's window, which transformers applies per layer: with `use_sliding_window`,
    to the layers `layer_types` marks `sliding_attention`, by default those from
    `max_window_layers` (28) on. realrl windows every layer or none."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28)
        else "full_attention" for i in range(layers)]
    windowed = [kind == "sliding_attention" for kind in types]
    if window is None or not any(windowed):
        return None
    if not all(windowed):
        raise ValueError(
            f"{hf['model_type']} with use_sliding_window=true windows {sum(windowed)} of its "
            f"{layers} layers (max_window_layers={hf.get('max_window_layers', 28)}, or "
            "layer_types) and attends in full in the others; realrl windows every layer or none")
    return window


def _llama_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    rope_parameters = {"rope_type": "default", **(config.rope_scaling or {})}
    family = get_family(config.model_type)
    hf = {
        "architectures": [family.critic_architecture if config.is_critic else family.architecture],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        # Both spellings: transformers>=5 reads rope_parameters, older releases the rest.
        "rope_parameters": {**rope_parameters, "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "use_cache": True,
    }
    if config.model_type in ("llama", "qwen3"):
        hf.update(attention_bias=False)
    if config.model_type == "llama":
        hf.update(mlp_bias=False)
    if config.model_type in ("qwen2", "qwen3"):
        windowed = config.sliding_window is not None
        hf.update(use_sliding_window=windowed, max_window_layers=0 if windowed else
                  config.num_hidden_layers,
                  layer_types=[("sliding" if windowed else "full") + "_attention"]
                  * config.num_hidden_layers)
    if config.model_type in ("qwen2", "qwen3", "mistral"):
        hf.update(sliding_window=config.sliding_window)
    if config.is_critic:
        # One label; transformers scores each sequence at its last token that is not pad_token_id.
        hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return hf


for _model_type, _architecture in (
    ("llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("mistral", "MistralForCausalLM"),
):
    register_family(Family(_model_type, _architecture, _llama_config_from_hf, _llama_config_to_hf))


# ---------------------------------------------------------------- weight translation


def _layer_rules(config: ModelConfig, i: int) -> list[tuple[str, list[str], list[int]]]:
    """(realrl name, HF names, split sizes along dim 0) for layer i; sizes [] = no fusion."""
    hf = f"model.layers.{i}."
    ours = f"layers.{i}."
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    qkv_sizes = [q_size, kv_size, kv_size]
    rules = [
        (ours + "attention_norm.weight", [hf + "input_layernorm.weight"], []),
        (
            ours + "attention.qkv.weight",
            [hf + f"self_attn.{p}_proj.weight" for p in "qkv"],
            qkv_sizes,
        ),
        (ours + "attention.output.weight", [hf + "self_attn.o_proj.weight"], []),
        (ours + "mlp_norm.weight", [hf + "post_attention_layernorm.weight"], []),
        (
            ours + "mlp.gate_up.weight",
            [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
            [config.intermediate_size] * 2,
        ),
        (ours + "mlp.down.weight", [hf + "mlp.down_proj.weight"], []),
    ]
    if config.qk_norm:
        rules += [(ours + f"attention.{p}_norm.weight", [hf + f"self_attn.{p}_norm.weight"], [])
                  for p in "qk"]
    if config.qkv_bias:
        rules.append(
            (
                ours + "attention.qkv.bias",
                [hf + f"self_attn.{p}_proj.bias" for p in "qkv"],
                qkv_sizes,
            )
        )
    return rules


def weight_rules(config: ModelConfig) -> list[tuple[str, list[str], list[int]]]:
    """Every (realrl name, HF names, split sizes) of an LM or critic, excluding the critic's head."""
    rules = [("embedding.weight", ["model.embed_tokens.weight"], [])]
    for i in range(config.num_hidden_layers):
        rules.extend(_layer_rules(config, i))
    rules.append(("final_norm.weight", ["model.norm.weight"], []))
    if not config.tie_word_embeddings and not config.is_critic:
        rules.append(("lm_head.weight", ["lm_head.weight"], []))
    return rules


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor an LM checkpoint of this config must contain."""
    hidden, head_dim = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for _, hf_names, sizes in weight_rules(config):
        for index, name in enumerate(hf_names):
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                shapes[name] = (head_dim,)
            elif name.endswith("norm.weight"):
                shapes[name] = (hidden,)
            elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
                shapes[name] = (config.vocab_size, hidden)
            elif name.endswith("o_proj.weight"):
                shapes[name] = (hidden, config.num_attention_heads * head_dim)
            elif name.endswith("down_proj.weight"):
                shapes[name] = (hidden, config.intermediate_size)
            elif name.endswith(".bias"):
                shapes[name] = (sizes[index],)
            else:
                shapes[name] = (sizes[index], hidden)
    return shapes


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (views, no copies where unfused)."""
    config: ModelConfig = model.config
    ours = model.state_dict()
    hf: dict[str, torch.Tensor] = {}
    for our_name, hf_names, sizes in weight_rules(config):
        tensor = ours[our_name]
        pieces = tensor.split(sizes, dim=0) if sizes else [tensor]
        hf.update(zip(hf_names, pieces))
    if config.is_critic:
        hf[SCORE_HEAD_NAME] = ours[VALUE_HEAD_NAME]
    return hf


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """realrl state dict from HF-named tensors; names must be complete (checked by the caller).
    A critic's head is read from `score.weight`, or `value_head.weight` in older realrl critics."""
    ours = {}
    for our_name, hf_names, sizes in weight_rules(config):
        pieces = [hf[name] for name in hf_names]
        ours[our_name] = torch.cat(pieces, dim=0) if sizes else pieces[0]
    head = hf.get(SCORE_HEAD_NAME, hf.get(VALUE_HEAD_NAME)) if config.is_critic else None
    if head is not None:
        ours[VALUE_HEAD_NAME] = head
    return ours
