"""Is a model directory loadable? Checked in the launcher, in milliseconds, without torch.

A worker that meets a missing `config.json` or a truncated `model.safetensors` fails after
every process has started; `checkpoint_problems` finds both before, reading only the small
files and each safetensors header. A safetensors file is an 8-byte little-endian header
length N, N bytes of JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}`,
offsets relative to the end of the header), then the tensor data; the header is sound when it
parses, each tensor's byte span equals its shape times its dtype's size, and the data ends
exactly at the end of the file (a truncated download or copy ends earlier).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
# A header larger than this is not a safetensors header (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_model_config(directory: Path) -> tuple[dict | None, str | None]:
    """(config.json as a dict, None) or (None, what is wrong with it)."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        return None, f"{config_file} does not exist"
    try:
        loaded = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return None, f"{config_file} is not valid JSON ({error})"
    if not isinstance(loaded, dict):
        return None, f"{config_file} must hold a JSON object"
    return loaded, None


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's header or size (None: sound)."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{file} is {size} bytes long, too short for a safetensors header"
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(size - 8, MAX_HEADER_BYTES):
            return (f"{file} declares a {header_bytes}-byte header but holds {size} bytes: "
                    "truncated, or not a safetensors file")
        raw = handle.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{file} has a damaged header ({error})"
    if not isinstance(header, dict):
        return f"{file} has a damaged header (not a JSON object)"
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            numel = math.prod(entry["shape"])
        except (KeyError, TypeError, ValueError):
            return f"{file} has a damaged header entry for tensor {name!r}"
        # A dtype newer than this table (sub-byte floats) skips the span check.
        expected = numel * DTYPE_BYTES.get(entry.get("dtype"), 0) or end - begin
        if end - begin != expected:
            return (f"{file}: tensor {name!r} spans {end - begin} bytes, its shape and dtype "
                    f"need {expected}")
        data_end = max(data_end, end)
    if 8 + header_bytes + data_end != size:
        return (f"{file} is {size} bytes long, its header declares "
                f"{8 + header_bytes + data_end}: the file is truncated or damaged (copy or "
                "download it again)")
    return None


def weight_files_problem(directory: Path) -> str | None:
    """What keeps the weights of a checkpoint directory from loading (None: they look sound)."""
    index_file = directory / SAFETENSORS_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8")).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
            return f"{index_file} is not a valid index ({error})"
        if not isinstance(weight_map, dict):
            return f"{index_file} has no 'weight_map' object"
        files = sorted({directory / name for name in weight_map.values()})
    elif (directory / SAFETENSORS_FILE).is_file():
        files = [directory / SAFETENSORS_FILE]
    elif (directory / TORCH_BIN_FILE).is_file():
        return None  # a pickle: only torch can check it, and the worker does
    else:
        return (f"{directory} holds no weights: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} "
                f"or {TORCH_BIN_FILE}")
    for file in files:
        if not file.is_file():
            return f"{file} is listed in {index_file} but does not exist"
        problem = safetensors_problem(file)
        if problem is not None:
            return problem
    return None


def checkpoint_problem(path: str, needs_weights: bool) -> str | None:
    """What keeps `path` from loading as a model role (`needs_weights`) or as a rule-based
    role's tokenizer directory; None when it looks loadable."""
    directory = Path(path)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        return f"{directory} {what}"
    if not needs_weights:
        return None
    _, problem = read_model_config(directory)
    return problem or weight_files_problem(directory)
