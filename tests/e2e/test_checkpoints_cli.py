"""What checkpoints cost and hold, through the real CLI.

`checkpoint.keep_last` leaves only the newest complete checkpoints and `checkpoint.weights_only`
leaves out the optimizer state, yet `recover_mode=auto` still resumes from such a run. A
reward model realrl trained loads in transformers' `AutoModelForSequenceClassification` with
its trained head and scores sequences as realrl does.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import describe, read_metrics, run_cli
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from realrl.models.checkpoint import load_pretrained

GRPO = [
    "ppo.disable_value=true",
    "ppo.adv_estimator=grpo",
    "group_size=2",
    "dataset.batch_size=4",
    "gen.max_new_tokens=8",
    "n_devices_per_node=1",
    "save_freq_steps=1",
    "checkpoint.keep_last=2",
    "checkpoint.weights_only=true",
    "recover_mode=auto",
]


@pytest.mark.slow
def test_grpo_keeps_the_newest_weights_only_checkpoints_and_resumes_from_them(
    tiny_model, cli_env, tmp_path
):
    common = [f"actor.path={tiny_model}", f"output_root={tmp_path}", *GRPO]
    first = run_cli("ppo-math", [*common, "total_train_steps=4"], cli_env)
    assert first.returncode == 0, describe(first)
    checkpoints = tmp_path / "ppo-math" / "trial0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step000003", "step000004"]
    assert (checkpoints / "latest").resolve() == (checkpoints / "step000004").resolve()
    actor = checkpoints / "step000004" / "actor"
    assert not list(checkpoints.rglob("optimizer*.pt")), sorted(actor.iterdir())
    assert (actor / "lr_scheduler.pt").is_file() and (actor / "generation_config.json").is_file()

    resumed = run_cli("ppo-math", [*common, "total_train_steps=5"], cli_env)
    assert resumed.returncode == 0, describe(resumed)
    log = (tmp_path / "ppo-math" / "trial0" / "logs" / "master.log").read_text()
    assert "resumed from" in log and "step000004 is weights-only" in log
    assert [record["step"] for record in read_metrics(checkpoints.parent)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step000004", "step000005"]
    assert (checkpoints / "latest").resolve() == (checkpoints / "step000005").resolve()


def test_a_trained_reward_model_loads_in_transformers_with_its_head(tiny_model, cli_env, tmp_path):
    result = run_cli(
        "rw",
        [
            f"model.path={tiny_model}",
            f"output_root={tmp_path}",
            "total_train_steps=2",
            "dataset.batch_size=4",
            "n_devices_per_node=1",
            "model.optimizer.lr=1e-2",
        ],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    checkpoint = tmp_path / "rw" / "trial0" / "checkpoints" / "step000002" / "default"
    hf_model, loading = AutoModelForSequenceClassification.from_pretrained(
        checkpoint, output_loading_info=True
    )
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    assert hf_model.score.weight.abs().sum() > 0  # trained from realrl's zero-initialised head

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = ["1+2=3<eos>", "12+30=42<eos>", "7-9=-2<eos>"]
    sequences = [torch.tensor(tokenizer.encode(text)) for text in texts]
    padded = torch.nn.utils.rnn.pad_sequence(
        sequences, batch_first=True, padding_value=tokenizer.pad_token_id
    )
    critic = load_pretrained(checkpoint)
    cu_seqlens = torch.tensor([0, *torch.tensor([len(s) for s in sequences]).cumsum(0)])
    with torch.no_grad():
        hf_scores = hf_model.eval()(padded, attention_mask=(padded != 0).long()).logits[:, 0]
        realrl_scores = critic(torch.cat(sequences), cu_seqlens.int())[cu_seqlens[1:] - 1]
    assert (hf_scores - realrl_scores).abs().max() <= 1e-5
