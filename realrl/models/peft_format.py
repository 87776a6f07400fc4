"""LoRA adapters in PEFT's checkpoint format, written and read without PEFT.

A PEFT LoRA directory is `adapter_config.json` plus `adapter_model.safetensors`, whose tensors
are named after the Hugging Face module they adapt:

    realrl                                         PEFT
    layers.{i}.attention.qkv_lora.lora_A.q_proj    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
    layers.{i}.attention.qkv_lora.lora_B.q_proj    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight
    layers.{i}.attention.output_lora.lora_A.o_proj base_model.model.model.layers.{i}.self_attn.o_proj.lora_A.weight
    layers.{i}.mlp.gate_up_lora.lora_A.gate_proj   base_model.model.model.layers.{i}.mlp.gate_proj.lora_A.weight
    value_head.weight (critics)                    base_model.model.score.weight (modules_to_save)

`peft.PeftModel.from_pretrained(<the HF base model>, directory)` loads it; a critic's adapter
goes on `AutoModelForSequenceClassification` (task SEQ_CLS), which takes its trained `score`
head from the file. realrl's adapters compute `W x + (alpha / r) B A x` as PEFT's LoRA layers
do (no rsLoRA, no DoRA, no bias), so both give the same logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from realrl.api.lora import TARGET_MODULES, LoRAConfig
from realrl.models.checkpoint import CheckpointError

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
PEFT_SCORE_NAME = "base_model.model.score.weight"
REALRL_VALUE_HEAD = "value_head.weight"

_REALRL_NAME = re.compile(r"layers\.(\d+)\.(attention|mlp)\.\w+_lora\.lora_([AB])\.(\w+)")
_PEFT_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_LAYER_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "output",
             "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}


def peft_name(name: str) -> str:
    """PEFT's tensor name of a realrl adapter parameter (or a critic's value head)."""
    if name == REALRL_VALUE_HEAD:
        return PEFT_SCORE_NAME
    match = _REALRL_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA adapter parameter")
    layer, owner, factor, component = match.groups()
    owner = "self_attn" if owner == "attention" else "mlp"
    return f"base_model.model.model.layers.{layer}.{owner}.{component}.lora_{factor}.weight"


def realrl_name(name: str) -> str | None:
    """realrl's parameter name of a PEFT tensor name; None for a name realrl cannot hold."""
    if name == PEFT_SCORE_NAME:
        return REALRL_VALUE_HEAD
    match = _PEFT_NAME.fullmatch(name)
    if match is None or match.group(3) not in _LAYER_OF:
        return None
    layer, owner, component, factor = match.groups()
    owner = "attention" if owner == "self_attn" else "mlp"
    return f"layers.{layer}.{owner}.{_LAYER_OF[component]}_lora.lora_{factor}.{component}"


def adapter_config(lora: LoRAConfig, base_model_path: str, critic: bool) -> dict:
    """adapter_config.json for `lora` (the keys PEFT's LoraConfig reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if critic else "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": lora.rank,
        "lora_alpha": lora.resolved_alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [name for name in TARGET_MODULES if name in lora.target_modules],
        "modules_to_save": ["score"] if critic else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(directory: Path, state: dict[str, torch.Tensor], lora: LoRAConfig,
                 base_model_path: str, critic: bool) -> None:
    """Write `state` (full, unsharded adapter parameters under realrl names, and a critic's
    value head) as a PEFT LoRA directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {peft_name(name): tensor.detach().to("cpu").contiguous().clone()
               for name, tensor in state.items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(lora, base_model_path, critic)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_adapter(directory: Path, lora: LoRAConfig, expected: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The adapter parameters of a PEFT LoRA directory under realrl names, checked against
    `lora` (rank, alpha, targets) and `expected` (name -> full shape): a directory written for
    other settings is refused, naming the difference."""
    config_path = directory / ADAPTER_CONFIG_FILE
    try:
        saved = json.loads(config_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path} cannot be read ({error}): a LoRA checkpoint "
                              "directory needs it") from None
    wanted = adapter_config(lora, "", critic=False)
    for key in ("r", "lora_alpha", "target_modules"):
        if saved.get(key) != wanted[key]:
            raise CheckpointError(
                f"{config_path} has {key}={saved.get(key)!r}, and this run's adapter has "
                f"{wanted[key]!r}: resume with the `lora` settings that wrote it")
    tensors = {}
    path = directory / ADAPTER_WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                ours = realrl_name(name)
                if ours is None or ours not in expected:
                    raise CheckpointError(f"unexpected tensor {name!r} in {path}")
                tensors[ours] = handle.get_tensor(name).to(device, dtype)
    except (SafetensorError, FileNotFoundError) as error:
        raise CheckpointError(f"{path} is missing, corrupt or truncated: {error}") from None
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path} lacks {peft_name(name)!r}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(f"{peft_name(name)!r} in {path} has shape "
                                  f"{list(tensors[name].shape)}, expected {list(shape)}")
    return tensors
