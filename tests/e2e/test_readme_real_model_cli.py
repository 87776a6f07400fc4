"""The README's real-model command, as written, at CPU size (issue 21: it must train as written).

The command is read from README.md; only the keys that set the scale (paths, worker count and
layout, batch, group and response sizes) are replaced. The checkpoint is the `chat_model`
fixture, shaped like Qwen2.5-Instruct: a chat template and two EOS ids in
generation_config.json. What the README promises must hold: prompts reach the model as chat
turns, the reference runs in the actor's bf16, a 1e-6 learning rate moves the fp32 master
weights, and the saved checkpoint stops where realrl stops.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch
import yaml
from e2e_helpers import REPO_ROOT, describe, read_metrics, run_cli
from safetensors.torch import load_file

# The README's keys that set the scale, and their CPU-sized values (same layout shape:
# generation data parallel everywhere, training tensor parallel).
SCALE = {
    "n_devices_per_node": "2",
    "allocation_mode": "actor_gen:d2,actor_train:d1t2,*:d2",
    "group_size": "2",
    "dataset.batch_size": "2",
    "gen.max_new_tokens": "8",
}


def readme_overrides() -> dict[str, str]:
    text = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"## A real model\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no '## A real model' command"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    assert words[:4] == ["python", "-m", "realrl.apps.quickstart", "ppo-math"], words[:4]
    return dict(word.split("=", 1) for word in words[4:])


@pytest.mark.slow
def test_readme_real_model_command_trains_as_written(chat_model, cli_env, tmp_path):
    overrides = readme_overrides()
    assert set(SCALE) <= set(overrides), "the README's command lost a key this test scales"
    data = tmp_path / "gsm8k_train.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": f"What is {a}+{a + 1}? Put the answer in \\boxed{{}}.",
                    "answer": str(2 * a + 1)}) + "\n" for a in range(1, 5)))
    overrides |= SCALE | {"actor.path": str(chat_model), "dataset.path": str(data)}
    # A random model earns no reward, so every GRPO advantage is 0 and so is the policy
    # gradient; an entropy bonus gives the 1e-6 learning rate something to move.
    extra = [f"output_root={tmp_path}", "total_train_steps=2", "save_freq_steps=1",
             "ppo.entropy_coef=0.01"]
    result = run_cli("ppo-math", [f"{k}={v}" for k, v in overrides.items()] + extra, cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["actor"]["dtype"] == config["ref"]["dtype"] == "bfloat16"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<|im_start|>user\n" in s["prompt"] for s in samples), samples[0]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("actor_train/kl_to_ref" in m for m in metrics)

    # lr=1e-6 moved the fp32 masters between the two checkpoints; the bf16 weights are them
    # rounded.
    first, last = (run_dir / "checkpoints" / f"step{s:06d}" / "actor" for s in (1, 2))
    masters = [torch.load(d / "optimizer.tp0of2.pt", weights_only=False)["master_weights"]
               for d in (first, last)]
    moved = sum(int((a != b).sum()) for a, b in zip(*masters))
    assert moved > 0.5 * sum(m.numel() for m in masters[0])
    generation = json.loads((last / "generation_config.json").read_text())
    tokens = json.loads((chat_model / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tokens}
    assert sorted(generation["eos_token_id"]) == sorted([ids["<|im_end|>"], ids["<|endoftext|>"]])
    weights = load_file(str(last / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
