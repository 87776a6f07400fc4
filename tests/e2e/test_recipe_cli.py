"""docs/recipe.md as written: SFT -> reward model -> PPO on it -> scored generation.

The commands are read from the recipe's fenced blocks (`bash recipe`: the built-in chain;
`bash recipe-real-model`: the same with a checkpoint and data files), one command each, in
order, and run as a user would from a fresh clone, in an empty directory (so `runs/...` is
where the recipe says), each with overrides appended that only shrink it: two steps, tiny
batches, short responses (a later `key=value` wins). Each stage must read the model the stage
before it wrote, named by that run directory's `checkpoints/latest/<role>`, and the last one
must leave generated.jsonl with every completion scored.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import QUIET_RUN, REPO_ROOT, RUN_TIMEOUT_S, describe

RECIPE = REPO_ROOT / "docs" / "recipe.md"
EXPERIMENTS = ["sft", "rw", "ppo-rlhf", "gen"]
# Appended to every stage: the fewest steps, samples and processes that still run each MFC.
SMALL = ["total_train_steps=2", "dataset.batch_size=4", "n_devices_per_node=1"]
SMALL_PER_EXPERIMENT = {
    "ppo-rlhf": ["group_size=2", "gen.max_new_tokens=4"],
    "gen": ["total_train_steps=1", "gen.max_new_tokens=4", "n_samples=1"],
}
MODEL_PATH_KEYS = ("model.path", "actor.path", "rm.path")
REAL_MODEL = "/models/Qwen2.5-0.5B-Instruct"


def recipe_commands(marker: str) -> list[list[str]]:
    """The words of each `bash <marker>` block's command, in the order of the document."""
    blocks = re.findall(rf"```bash {marker}\n(.*?)```", RECIPE.read_text(), re.S)
    commands = [shlex.split(block.replace("\\\n", " "), comments=True) for block in blocks]
    assert [words[:3] for words in commands] == [["python", "-m", "realrl.apps.quickstart"]] * 4
    assert [words[3] for words in commands] == EXPERIMENTS
    return commands


def run_dir(overrides: dict[str, str], experiment: str) -> Path:
    return (Path(overrides.get("output_root", "runs")) / overrides.get("experiment_name", experiment)
            / overrides.get("trial_name", "trial0"))


def run_chain(commands: list[list[str]], env: dict[str, str], cwd: Path,
              replace: dict[str, str]) -> Path:
    """Run the stages in `cwd`, values in `replace` swapped (a checkpoint, data files);
    returns the last stage's run directory."""
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                              env.get("PYTHONPATH")]))}
    written: list[Path] = []  # the run directories of the stages so far
    for words in commands:
        experiment = words[3]
        overrides = dict(word.split("=", 1) for word in words[4:])
        inputs = [Path(overrides[key]) for key in MODEL_PATH_KEYS if key in overrides]
        outside = [str(path) for path in inputs if path.parts[0] != "runs"]
        assert outside == ([] if written else outside), f"only the first stage reads {outside}"
        for path in (path for path in inputs if path.parts[0] == "runs"):
            # a model an earlier stage wrote, named by its final-model link
            assert path.parent.name == "latest" and path.parents[2] in written, (path, written)
            assert (cwd / path / "config.json").is_file(), path
        if written:  # every stage but the first reads the one before it
            assert written[-1] in [path.parents[2] for path in inputs], (words, written)
        arguments = [f"{key}={replace.get(value, value)}" for key, value in overrides.items()]
        command = [sys.executable, *words[1:4], *arguments, *QUIET_RUN, *SMALL,
                   *SMALL_PER_EXPERIMENT.get(experiment, [])]
        result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                                timeout=RUN_TIMEOUT_S)
        assert result.returncode == 0, f"{shlex.join(words)}\n{describe(result)}"
        written.append(run_dir(overrides, experiment))
    return cwd / written[-1]


def generated_lines(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "generated.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_builtin_recipe_runs_as_written_each_stage_reading_the_last_ones_model(
    cli_env, tmp_path
):
    last = run_chain(recipe_commands("recipe"), cli_env, tmp_path, replace={})
    lines = generated_lines(last)
    assert len(lines) == 4  # one batch of 4 prompts, one completion each
    for line in lines:
        assert line["query_id"].startswith("eval-")  # the held-out problems
        assert line["rule_rewards"] in (0.0, 1.0) and isinstance(line["model_rewards"], float)


def write_real_model_data(directory: Path) -> dict[str, str]:
    """Files in the formats the recipe's table gives; returns the recipe's path -> this one."""
    questions = [f"What is {a} plus {a + 2}?" for a in range(8)]
    records = {
        "sft": [{"prompt": q, "answer": f"It is {2 * a + 2}."} for a, q in enumerate(questions)],
        "prefs": [{"prompt": q, "pos_answers": [f"It is {2 * a + 2}."],
                   "neg_answers": [f"It is {2 * a + 3}."]} for a, q in enumerate(questions)],
        "chat_prompts": [{"prompt": q} for q in questions[:4]]
        + [{"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": q}]} for q in questions[4:]],
        "chat_eval": [{"prompt": f"What is {a} minus 1?"} for a in range(4)],
    }
    replace = {}
    for name, rows in records.items():
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        replace[f"/data/{name}.jsonl"] = str(path)
    return replace


@pytest.mark.slow
def test_the_real_model_recipe_runs_as_written_on_a_qwen_shaped_checkpoint(
    chat_model, cli_env, tmp_path
):
    commands = recipe_commands("recipe-real-model")
    assert dict(word.split("=", 1) for word in commands[0][4:])["model.path"] == REAL_MODEL
    replace = write_real_model_data(tmp_path) | {REAL_MODEL: str(chat_model)}
    last = run_chain(commands, cli_env, tmp_path, replace)
    lines = generated_lines(last)
    assert [line["prompt"] for line in lines] == [f"What is {a} minus 1?" for a in range(4)]
    assert all(isinstance(line["reward"], float) for line in lines)  # the reward model's score
