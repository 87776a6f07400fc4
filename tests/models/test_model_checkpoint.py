"""Checkpoint loading and saving: sharding, critics, generation_config.json, .bin files, and
every error message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_hf_models import TINY, hf_logits_per_sequence, random_packed_batch, save_hf
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from realrl.models.checkpoint import (
    CheckpointError,
    checkpoint_eos_token_ids,
    load_pretrained,
    save_pretrained,
)
from realrl.models.families import SCORE_HEAD_NAME, VALUE_HEAD_NAME
from realrl.models.generation import generate
from realrl.models.sampling import GenerationConfig as SamplingConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

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
    save_hf(tmp_path / "lm", "llama", pad_token_id=0)
    critic = load_pretrained(tmp_path / "lm", critic=True, dtype=torch.bfloat16)
    with torch.no_grad():
        critic.value_head.weight.normal_()
    save_pretrained(critic, tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["id2label"] == {"0": "LABEL_0"} and config["torch_dtype"] == "bfloat16"
    assert config["pad_token_id"] == 0 and "realrl_critic" not in config
    stored = load_file(tmp_path / "critic" / "model.safetensors")
    assert stored[SCORE_HEAD_NAME].shape == (1, 64)
    assert VALUE_HEAD_NAME not in stored and "lm_head.weight" not in stored
    reloaded = load_pretrained(tmp_path / "critic", dtype=torch.bfloat16)
    assert reloaded.config.is_critic
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96)
    with torch.no_grad():
        assert torch.equal(reloaded(packed, cu_seqlens), critic(packed, cu_seqlens))


def _trained_critic(tmp_path, model_type: str):
    """A realrl critic from a tiny LM (pad id 0) whose head and last layer took a few steps."""
    save_hf(tmp_path / "lm", model_type, pad_token_id=0)
    critic = load_pretrained(tmp_path / "lm", critic=True)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96, seed=3)
    packed = packed.clamp(min=1)  # id 0 is the pad id
    for _ in range(3):
        optimizer.zero_grad()
        (critic(packed, cu_seqlens) - 1.0).square().mean().backward()
        optimizer.step()
    return critic


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_saved_critic_loads_in_transformers_with_its_trained_head(tmp_path, model_type):
    """AutoModelForSequenceClassification finds every weight (no newly initialised head) and
    scores a right-padded batch as realrl scores each packed sequence at its last token."""
    critic = _trained_critic(tmp_path, model_type)
    save_pretrained(critic, tmp_path / "critic")
    hf_model, loading = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "critic", output_loading_info=True
    )
    assert not loading["missing_keys"], loading
    assert not loading["unexpected_keys"], loading
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, 96, seed=4)
    sequences = [sequence.clamp(min=1) for sequence in sequences]
    packed = torch.cat(sequences)
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=0)
    with torch.no_grad():
        realrl_scores = critic(packed, cu_seqlens)[cu_seqlens[1:].long() - 1]  # [num_seqs]
        hf_scores = hf_model.eval()(padded, attention_mask=(padded != 0).long()).logits
    assert hf_scores.shape == (len(LENGTHS), 1)
    assert (hf_scores[:, 0] - realrl_scores).abs().max() <= 1e-5


def test_transformers_sequence_classification_checkpoint_loads_as_a_critic(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(**TINY, num_labels=1, pad_token_id=0)
    hf_model = Qwen2ForSequenceClassification(config).eval()
    hf_model.save_pretrained(tmp_path)
    critic = load_pretrained(tmp_path)  # no critic=True: config.json says what it is
    assert critic.config.is_critic
    sequences, packed, cu_seqlens = random_packed_batch([4, 7], 96, seed=1)
    with torch.no_grad():
        values = critic(packed, cu_seqlens)
        for sequence, last in zip(sequences, cu_seqlens[1:].long() - 1):
            assert (hf_model(sequence[None]).logits[0, 0] - values[last]).abs() <= 1e-5


def test_sequence_classifier_with_several_labels_is_rejected(tmp_path):
    Qwen2ForSequenceClassification(
        Qwen2Config(**TINY, num_labels=3, pad_token_id=0)
    ).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="3 labels is not supported.*num_labels=1"):
        load_pretrained(tmp_path)


def test_older_realrl_critic_checkpoints_still_load(tmp_path):
    """Before critics were saved as sequence classifiers: `value_head.weight` under a
    `*ForCausalLM` config marked `"realrl_critic": true`."""
    save_hf(tmp_path, "qwen2")
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("lm_head.weight", None)
    head = torch.randn(1, 64)
    weights[VALUE_HEAD_NAME] = head
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["realrl_critic"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    critic = load_pretrained(tmp_path)
    assert critic.config.is_critic and torch.equal(critic.value_head.weight, head)


def _first_greedy_token(model, prompt: torch.Tensor) -> int:
    config = SamplingConfig(greedy=True, max_new_tokens=1)
    output = generate(
        model, prompt, torch.tensor([0, len(prompt)], dtype=torch.int32), config, torch.Generator()
    )
    return int(output.packed_input_ids[-1])


def test_generation_config_eos_ids_end_responses_in_realrl_and_in_saved_checkpoints(tmp_path):
    """generation_config.json may list EOS ids config.json lacks (Qwen2.5-Instruct); realrl
    stops at each of them, and a checkpoint it saves makes transformers stop there too."""
    save_hf(tmp_path / "source", "qwen2", eos_token_id=95)
    prompt = torch.tensor([3, 17, 42, 8])
    stop = _first_greedy_token(load_pretrained(tmp_path / "source"), prompt)
    assert stop != 95
    GenerationConfig(
        eos_token_id=[95, stop], pad_token_id=0, do_sample=True, top_k=7
    ).save_pretrained(tmp_path / "source")
    assert checkpoint_eos_token_ids(tmp_path / "source") == [95, stop]
    model = load_pretrained(tmp_path / "source")
    assert model.config.eos_token_ids == [95, stop]
    config = SamplingConfig(greedy=True, max_new_tokens=6)
    output = generate(
        model, prompt, torch.tensor([0, len(prompt)], dtype=torch.int32), config, torch.Generator()
    )
    assert output.response_lens.tolist() == [1] and not output.no_eos.item()

    save_pretrained(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [95, stop] and saved["pad_token_id"] == 0
    assert saved["do_sample"] is True and saved["top_k"] == 7  # carried over as loaded
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["eos_token_id"] == 95
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    generated = hf_model.generate(prompt[None], do_sample=False, max_new_tokens=6)
    assert generated[0, len(prompt) :].tolist() == [stop]


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
        CheckpointError, match=r"config\.json.*'falcon'.*\['llama', 'mistral', 'qwen2', 'qwen3'\]"
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


def test_loading_a_checkpoint_skips_random_init_and_leaves_torch_dynamo_unimported(tmp_path):
    # Initialisers on the meta device would import torch._dynamo (1.5 s of CPU in each worker).
    script = textwrap.dedent(f"""
        import sys, torch
        from realrl.models.checkpoint import load_pretrained
        from realrl.models.transformer import on_meta_device
        initialiser = torch.nn.init.normal_
        model = load_pretrained({str(REPO_ROOT / "realrl" / "assets" / "default-actor-v1")!r})
        with on_meta_device():
            torch.nn.Linear(3, 4)
        assert torch.nn.init.normal_ is initialiser
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo",
              next(model.parameters()).device)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["no", "dynamo", "cpu"]
