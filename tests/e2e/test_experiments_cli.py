"""sft, rw, dpo and gen end to end through the real CLI, on the built-in data and on user JSONL.

The user files are written here in the documented formats: `{"prompt", "answer"}` for SFT,
`{"prompt", "pos_answers", "neg_answers"}` for RW and DPO, `{"prompt", "answer"}` prompts for
gen. Training experiments must log every step and leave a Hugging Face checkpoint of the
trained model; gen must write all its completions into one JSONL file, in prompt order. DPO on
the built-in data trains a LoRA actor, whose reference is the actor's base weights (no copy):
its checkpoint is the adapter in PEFT's format.
"""

from __future__ import annotations

import json

import pytest
from e2e_helpers import describe, read_metrics, run_cli

STEPS = 2
BATCH_SIZE = 4


def write_user_data(experiment: str, path) -> None:
    records = []
    for first in range(1, 9):
        prompt, answer = f"{first}+{first + 1}=", str(2 * first + 1)
        if experiment in ("rw", "dpo"):
            records.append(
                {"prompt": prompt, "pos_answers": [answer], "neg_answers": [str(2 * first + 2)]}
            )
        else:
            records.append({"prompt": prompt, "answer": answer})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


# experiment -> (the key of its model path, the checkpointed role, a metric key it must log)
EXPERIMENTS = {
    "sft": ("model.path", "default", "trainDefault/loss"),
    "rw": ("model.path", "default", "trainDefault/loss"),
    "dpo": ("actor.path", "actor", "actor_train/loss"),
    "gen": ("model.path", None, None),
}
CASES = [
    pytest.param(
        experiment,
        source,
        id=f"{experiment}-{source}",
        marks=[pytest.mark.slow] if source == "builtin" else [],
    )
    for experiment in EXPERIMENTS
    for source in ("user_jsonl", "builtin")
]


@pytest.mark.parametrize(("experiment", "source"), CASES)
def test_experiment_runs_end_to_end_through_the_cli(
    experiment, source, tiny_model, cli_env, tmp_path
):
    path_key, trained_role, loss_key = EXPERIMENTS[experiment]
    overrides = [
        f"{path_key}={tiny_model}",
        f"output_root={tmp_path / 'runs'}",
        f"total_train_steps={STEPS}",
        f"dataset.batch_size={BATCH_SIZE}",
    ]
    if source == "user_jsonl":
        data = tmp_path / f"{experiment}.jsonl"
        write_user_data(experiment, data)
        overrides.append(f"dataset.path={data}")
    if experiment == "gen":
        overrides += ["gen.max_new_tokens=6", "n_samples=2"]
    lora = experiment == "dpo" and source == "builtin"
    if lora:
        overrides.append("actor.lora.rank=4")
    result = run_cli(experiment, overrides, cli_env)
    assert result.returncode == 0, describe(result)

    run_dir = tmp_path / "runs" / experiment / "trial0"
    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics] == list(range(1, STEPS + 1))
    assert all(record["timing/step_s"] > 0 for record in metrics)
    if trained_role is not None:
        assert all(loss_key in record for record in metrics), sorted(metrics[0])
        checkpoint = run_dir / "checkpoints" / f"step{STEPS:06d}" / trained_role
        weights = "adapter_config.json" if lora else "config.json"
        assert (checkpoint / weights).is_file() and (checkpoint / "tokenizer.json").is_file()
        assert list(checkpoint.glob("*.safetensors")), sorted(checkpoint.iterdir())
        if lora:
            assert not (checkpoint / "model.safetensors").exists()
            log = (run_dir / "logs" / "worker0.log").read_text()
            assert "ref computes with actor's base weights (no copy of its own)" in log, log
    else:
        prompts = ([json.loads(line)["prompt"] for line in data.read_text().splitlines()]
                   if source == "user_jsonl" else None)
        check_generated_jsonl(run_dir, STEPS * BATCH_SIZE, prompts)


def check_generated_jsonl(run_dir, num_prompts: int, dataset_prompts: list[str] | None) -> None:
    """One file with both completions of every prompt, prompts in the dataset's order (a user
    file of 8 prompts in 2 batches of 4 is one whole pass)."""
    outputs = sorted(path.name for path in run_dir.glob("generated*"))
    assert outputs == ["generated.jsonl"], outputs
    lines = [json.loads(line) for line in (run_dir / "generated.jsonl").read_text().splitlines()]
    assert len(lines) == num_prompts * 2
    for line in lines:
        assert isinstance(line["prompt"], str) and line["prompt"]
        assert isinstance(line["completion"], str)
    query_ids = [line["query_id"] for line in lines]
    assert query_ids[::2] == query_ids[1::2], "a prompt's completions are together"
    assert len(set(query_ids)) == num_prompts
    if dataset_prompts is not None:
        assert [line["prompt"] for line in lines[::2]] == dataset_prompts


def test_gen_by_default_covers_every_prompt_once_with_a_partial_last_batch(
    tiny_model, cli_env, tmp_path
):
    """`total_train_steps=0` (gen's default): 5 prompts in batches of 2 on 2 workers. A last
    batch of 1 prompt cannot be split over 2 data-parallel ranks, so it joins the one before:
    2 steps of 2 and 3 prompts, every prompt once."""
    data = tmp_path / "prompts.jsonl"
    prompts = [f"{first}+{first + 1}=" for first in range(1, 6)]
    data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    result = run_cli("gen", [
        f"model.path={tiny_model}", f"output_root={tmp_path / 'runs'}", f"dataset.path={data}",
        "dataset.batch_size=2", "n_devices_per_node=2", "gen.max_new_tokens=4", "n_samples=2",
    ], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "runs" / "gen" / "trial0"
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2]
    check_generated_jsonl(run_dir, len(prompts), prompts)
