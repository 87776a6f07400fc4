"""The launcher's model-directory check reads safetensors headers as the format defines them:
files written by `safetensors` pass, damaged ones are named with what is wrong."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from realrl.launcher.checkpoint_files import checkpoint_problem, safetensors_problem


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(7, dtype=torch.bfloat16),
               "c": torch.arange(4)}, str(path), metadata={"format": "pt"})
    return path


def _model_dir(tmp_path, weights):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return tmp_path


def test_a_file_written_by_safetensors_is_sound(weights, tmp_path):
    assert safetensors_problem(weights) is None
    assert checkpoint_problem(str(_model_dir(tmp_path, weights)), needs_weights=True) is None


def test_a_truncated_or_extended_file_is_named_with_both_sizes(weights):
    size = weights.stat().st_size
    os.truncate(weights, size - 1)
    assert f"is {size - 1} bytes long, its header declares {size}" in safetensors_problem(weights)
    with open(weights, "ab") as handle:
        handle.write(b"\0\0")
    assert f"is {size + 1} bytes long" in safetensors_problem(weights)


def test_a_header_longer_than_the_file_or_not_json_is_damaged(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    assert "declares a 1000000-byte header but holds 10 bytes" in safetensors_problem(path)
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    assert "damaged header" in safetensors_problem(path)
    path.write_bytes(b"abc")
    assert "too short" in safetensors_problem(path)


def test_a_tensor_whose_span_does_not_fit_its_shape_is_named(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(20))
    assert "tensor 'w' spans 20 bytes, its shape and dtype need 24" in safetensors_problem(path)


def test_a_directory_without_config_or_weights_or_with_a_missing_shard(tmp_path, weights):
    assert "does not exist" in checkpoint_problem(str(tmp_path / "nope"), needs_weights=True)
    assert "config.json does not exist" in checkpoint_problem(str(tmp_path), needs_weights=True)
    directory = _model_dir(tmp_path, weights)
    (directory / "config.json").write_text("{not json")
    assert "is not valid JSON" in checkpoint_problem(str(directory), needs_weights=True)
    (directory / "config.json").write_text("{}")
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    problem = checkpoint_problem(str(directory), needs_weights=True)
    assert "model-00002.safetensors is listed in" in problem
    os.remove(directory / "model.safetensors.index.json")
    os.remove(weights)
    assert "holds no weights" in checkpoint_problem(str(directory), needs_weights=True)
    assert checkpoint_problem(str(directory), needs_weights=False) is None  # a tokenizer's dir
