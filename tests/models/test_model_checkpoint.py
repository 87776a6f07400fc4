"""Checkpoint loading and saving: sharding, critics, .bin files, and every error message."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_hf_models import hf_logits_per_sequence, random_packed_batch, save_hf
from transformers import AutoModelForCausalLM

from realrl.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from realrl.models.families import VALUE_HEAD_NAME

LENGTHS = [5, 11, 2]


def test_sharded_transformers_checkpoint_loads_with_identical_logits(tmp_path):
    hf_model = save_hf(tmp_path / "plain", "llama")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = load_pretrained(tmp_path / "sharded")
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        assert (
            model(packed, cu_seqlens) - hf_logits_per_sequence(hf_model, sequences)
        ).abs().max() <= 1e-5


def test_save_pretrained_shards_and_both_libraries_reload_it(tmp_path):
    save_hf(tmp_path / "source", "qwen2")
    model = load_pretrained(tmp_path / "source")
    save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "out" / "model.safetensors").exists()
    reloaded = load_pretrained(tmp_path / "out")
    hf_reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(packed, cu_seqlens), model(packed, cu_seqlens))
        assert (
            model(packed, cu_seqlens) - hf_logits_per_sequence(hf_reloaded, sequences)
        ).abs().max() <= 1e-5


def test_pytorch_bin_checkpoint_loads(tmp_path):
    hf_model = save_hf(tmp_path / "st", "mistral")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(hf_model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    model = load_pretrained(tmp_path / "bin")
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        assert (
            model(packed, cu_seqlens) - hf_logits_per_sequence(hf_model, sequences)
        ).abs().max() <= 1e-5


def test_critic_from_lm_checkpoint_starts_with_zero_values_and_keeps_the_backbone(tmp_path):
    save_hf(tmp_path, "qwen2")
    critic = load_pretrained(tmp_path, critic=True)
    lm = load_pretrained(tmp_path)
    assert critic.lm_head is None and critic.value_head is not None
    assert torch.equal(critic.layers[0].attention.qkv.weight, lm.layers[0].attention.qkv.weight)
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96)
    values = critic(packed, cu_seqlens)
    assert values.shape == (sum(LENGTHS),) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))


def test_critic_checkpoint_round_trips_its_value_head(tmp_path):
    save_hf(tmp_path / "lm", "llama")
    critic = load_pretrained(tmp_path / "lm", critic=True, dtype=torch.bfloat16)
    with torch.no_grad():
        critic.value_head.weight.normal_()
    save_pretrained(critic, tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["realrl_critic"] is True and config["torch_dtype"] == "bfloat16"
    stored = load_file(tmp_path / "critic" / "model.safetensors")
    assert VALUE_HEAD_NAME in stored and "lm_head.weight" not in stored
    reloaded = load_pretrained(tmp_path / "critic", dtype=torch.bfloat16)
    assert reloaded.config.is_critic
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96)
    with torch.no_grad():
        assert torch.equal(reloaded(packed, cu_seqlens), critic(packed, cu_seqlens))


def _rewrite_weights(directory, edit) -> None:
    weights = load_file(directory / "model.safetensors")
    edit(weights)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_architecture_error_names_config_and_supported_types(tmp_path):
    save_hf(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "falcon"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"config\.json.*'falcon'.*\['llama', 'mistral', 'qwen2'\]"
    ):
        load_pretrained(tmp_path)


def test_missing_config_error_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_pretrained(tmp_path)


def test_missing_weights_error_lists_the_expected_files(tmp_path):
    save_hf(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights in .*model\.safetensors"):
        load_pretrained(tmp_path)


def test_missing_tensor_error_names_tensor_and_file(tmp_path):
    save_hf(tmp_path, "llama")
    _rewrite_weights(tmp_path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing.*model\.safetensors",
    ):
        load_pretrained(tmp_path)


def test_shape_mismatch_error_names_tensor_file_and_both_shapes(tmp_path):
    save_hf(tmp_path, "qwen2")

    def shrink(weights):
        weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _rewrite_weights(tmp_path, shrink)
    with pytest.raises(
        CheckpointError,
        match=r"k_proj\.weight' in .*model\.safetensors has shape \[16, 64\].*\[32, 64\]",
    ):
        load_pretrained(tmp_path)


def test_unexpected_tensor_error_names_tensor_and_file(tmp_path):
    save_hf(tmp_path, "llama")
    _rewrite_weights(tmp_path, lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(
        CheckpointError,
        match=r"unexpected tensor 'model\.layers\.0\.extra\.weight' in .*model\.safetensors",
    ):
        load_pretrained(tmp_path)


def test_truncated_safetensors_error_names_the_file(tmp_path):
    save_hf(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_pretrained(tmp_path)


def test_corrupt_safetensors_header_error_names_the_file(tmp_path):
    save_hf(tmp_path, "llama")
    (tmp_path / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"
    )
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_pretrained(tmp_path)


def test_shard_listed_in_index_but_absent_is_reported(tmp_path):
    hf_model = save_hf(tmp_path / "plain", "llama")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(
        CheckpointError, match=rf"{shard.name} is listed in .*index\.json but does not exist"
    ):
        load_pretrained(tmp_path / "sharded")
