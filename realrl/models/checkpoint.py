"""Reading and writing Hugging Face checkpoint directories.

`load_pretrained` reads `config.json` plus `model.safetensors`, a sharded
`model.safetensors.index.json`, or `pytorch_model.bin`, and `generation_config.json` when
present. Every tensor name and shape is checked against the family's layout before any data
is read, and each problem is reported with the file and tensor involved. `save_pretrained`
writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads with
identical outputs, and a `generation_config.json` carrying over the loaded one with every EOS
id realrl stops at, so `generate` in transformers stops where realrl does.

Critic (and reward-model) checkpoints are transformers' `<Family>ForSequenceClassification`
with one label: the backbone under HF names, the value head as `score.weight` [1, hidden], no
`lm_head.weight`, and `pad_token_id` set so that transformers finds each sequence's last
token, where realrl reads the score. `AutoModelForSequenceClassification.from_pretrained`
loads them with the trained head. Older realrl critics (`value_head.weight` and
`"realrl_critic": true`) still load. Loading an LM checkpoint with `critic=True` drops its LM
head and starts a zero-initialised value head.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from realrl.api.errors import UserFacingError
from realrl.models.config import ModelConfig, merged_eos_token_ids
from realrl.models.families import (
    SCORE_HEAD_NAME,
    VALUE_HEAD_NAME,
    from_hf_state_dict,
    get_family,
    hf_tensor_shapes,
    to_hf_state_dict,
)
from realrl.models.transformer import Transformer, on_meta_device

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
GENERATION_CONFIG_FILE = "generation_config.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(UserFacingError, ValueError):
    """A checkpoint directory does not match what realrl can load; the message says where."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: a checkpoint directory needs it") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


def read_generation_config(directory: Path) -> dict | None:
    """generation_config.json of a checkpoint directory, or None where it has none."""
    path = directory / GENERATION_CONFIG_FILE
    return _read_json(path) if path.is_file() else None


def checkpoint_eos_token_ids(path: str | os.PathLike) -> list[int]:
    """Every EOS id a checkpoint declares (config.json's and generation_config.json's), for
    the roles that load a tokenizer without the model (rule-based rewards); [] for a
    directory that holds only a tokenizer."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        return []
    config_eos = _read_json(directory / "config.json").get("eos_token_id")
    return merged_eos_token_ids(config_eos, read_generation_config(directory))


def _tensor_index(directory: Path) -> dict[str, tuple[Path, tuple[int, ...] | None]]:
    """Maps every stored tensor name to (file, shape); shapes of .bin files are read later."""
    index_path = directory / SAFETENSORS_INDEX
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no 'weight_map' object")
        files = sorted({directory / name for name in weight_map.values()})
    elif (directory / SAFETENSORS_FILE).exists():
        files = [directory / SAFETENSORS_FILE]
    elif (directory / TORCH_BIN_FILE).exists():
        return {
            name: (directory / TORCH_BIN_FILE, None)
            for name in _load_bin(directory / TORCH_BIN_FILE)
        }
    else:
        raise CheckpointError(
            f"no weights in {directory}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_BIN_FILE}"
        )
    index = {}
    for file in files:
        if not file.exists():
            raise CheckpointError(f"{file} is listed in {index_path} but does not exist")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    index[name] = (file, tuple(handle.get_slice(name).get_shape()))
        except SafetensorError as error:
            raise CheckpointError(f"{file} is corrupt or truncated: {error}") from None
    return index


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for damaged pickles
        raise CheckpointError(f"{path} could not be read as a torch state dict: {error}") from None


def _check_names_and_shapes(
    index, expected: dict[str, tuple[int, ...]], allow_extra: set[str]
) -> None:
    for name, shape in expected.items():
        if name not in index:
            files = sorted({str(file) for file, _ in index.values()})
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint files {files}")
        file, stored = index[name]
        if stored is not None and stored != shape:
            raise CheckpointError(
                f"tensor {name!r} in {file} has shape {list(stored)}, but config.json implies "
                f"{list(shape)}; the weights and config.json do not belong together"
            )
    for name, (file, _) in index.items():
        if name not in expected and name not in allow_extra and not name.endswith(IGNORED_SUFFIXES):
            raise CheckpointError(
                f"unexpected tensor {name!r} in {file}: it is not part of this architecture "
                "(is config.json from a different model?)"
            )


def _read_tensors(index, names: set[str], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name][0], []).append(name)
    tensors = {}
    for file, file_names in by_file.items():
        if file.suffix == ".bin":
            loaded = _load_bin(file)
            tensors.update({name: loaded[name].to(device, dtype) for name in file_names})
            continue
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in file_names:
                    tensors[name] = handle.get_tensor(name).to(device, dtype)
        except SafetensorError as error:
            raise CheckpointError(f"{file} is corrupt or truncated: {error}") from None
    return tensors


def load_pretrained(
    path: str | os.PathLike,
    *,
    critic: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """Build a `Transformer` from a local HF checkpoint directory (never downloads)."""
    directory = Path(path)
    hf_config = _read_json(directory / "config.json")
    model_type = hf_config.get("model_type")
    try:
        family = get_family(model_type)
        config = family.config_from_hf(hf_config)
    except ValueError as error:
        raise CheckpointError(f"{directory / 'config.json'}: {error}") from None
    stored_critic = config.is_critic
    config = dataclasses.replace(
        config,
        is_critic=critic or stored_critic,
        generation_config=read_generation_config(directory),
    )
    index = _tensor_index(directory)
    expected = hf_tensor_shapes(config)
    if stored_critic:
        # realrl's critics before transformers-loadable ones named the head value_head.weight.
        head_name = VALUE_HEAD_NAME if VALUE_HEAD_NAME in index else SCORE_HEAD_NAME
        expected[head_name] = (1, config.hidden_size)
    allow_extra = {"lm_head.weight"} if (config.tie_word_embeddings or config.is_critic) else set()
    _check_names_and_shapes(index, expected, allow_extra)
    hf_state = _read_tensors(index, set(expected), dtype, device)
    with on_meta_device():
        model = Transformer(config)
    state = from_hf_state_dict(hf_state, config)
    if config.is_critic and VALUE_HEAD_NAME not in state:
        state[VALUE_HEAD_NAME] = torch.zeros(1, config.hidden_size, dtype=dtype, device=device)
        logger.info("%s has no value head; starting a zero-initialised one", directory)
    model.load_state_dict(state, strict=True, assign=True)
    logger.info(
        "loaded %s (%s, %d layers) from %s", model_type, dtype, config.num_hidden_layers, directory
    )
    return model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shard(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    return shards


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    tokenizer=None,
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    """Write config.json, generation_config.json and safetensors (sharded above
    `max_shard_bytes`) in HF layout, and `tokenizer` when given."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in list(directory.glob("model*.safetensors")) + list(
        directory.glob(SAFETENSORS_INDEX)
    ):
        stale.unlink()
    # Clone: fused weights split into views that share storage, which safetensors refuses.
    state = {
        name: t.detach().to("cpu").contiguous().clone()
        for name, t in to_hf_state_dict(model).items()
    }
    shards = _shard(state, max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SAFETENSORS_FILE), metadata=metadata)
    else:
        weight_map = {}
        for number, shard in enumerate(shards, start=1):
            file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file_name), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file_name))
        total_size = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    config = model.config
    if config.is_critic:
        config = dataclasses.replace(config, pad_token_id=_critic_pad_token_id(config, tokenizer))
    hf_config = get_family(config.model_type).config_to_hf(config)
    hf_config["torch_dtype"] = hf_config["dtype"] = _dtype_name(model.dtype)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation_config = generation_config_to_save(config)
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    logger.info(
        "saved %s checkpoint in %d file(s) to %s", model.config.model_type, len(shards), directory
    )


def generation_config_to_save(config: ModelConfig) -> dict:
    """The loaded generation_config.json with `eos_token_id` set to every EOS id realrl stops
    at (config.json's and the loaded file's), and config.json's BOS and pad ids where it had
    none."""
    saved = dict(config.generation_config or {})
    eos = config.eos_token_ids
    if eos:
        saved["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key, value in (
        ("bos_token_id", config.bos_token_id),
        ("pad_token_id", config.pad_token_id),
    ):
        if saved.get(key) is None and value is not None:
            saved[key] = value
    return saved


def _critic_pad_token_id(config: ModelConfig, tokenizer) -> int | None:
    """The pad id a saved critic declares: transformers' sequence classification scores each
    sequence at its last token that is not `pad_token_id` (and refuses batches without one).
    config.json's, else generation_config.json's, else the tokenizer's."""
    candidates = (
        config.pad_token_id,
        (config.generation_config or {}).get("pad_token_id"),
        getattr(tokenizer, "pad_token_id", None),
    )
    pad_token_id = next((token_id for token_id in candidates if token_id is not None), None)
    if pad_token_id is None:
        logger.warning(
            "the critic checkpoint has no pad_token_id (config.json, generation_config.json "
            "and the tokenizer name none): transformers' AutoModelForSequenceClassification "
            "will refuse batches of more than one sequence; set pad_token_id in config.json"
        )
    elif pad_token_id == getattr(tokenizer, "eos_token_id", None):
        logger.warning(
            "the critic checkpoint's pad_token_id=%d is also the tokenizer's EOS: transformers' "
            "sequence classification scores a sequence ending with EOS at the token before it, "
            "realrl at the EOS itself",
            pad_token_id,
        )
    return pad_token_id
