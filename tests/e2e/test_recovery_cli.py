"""Checkpoints and recovery through the real CLI: a run resumes on fewer workers with a larger
batch, and `recover_mode=disabled` on an existing run directory moves the old run aside intact.
A killed run that resumes bit-exact is in test_preemption_cli.py, beside the other kills, on
their uninterrupted reference run.
"""

from __future__ import annotations

import pytest
from e2e_helpers import describe, read_metrics, run_cli


@pytest.mark.slow
def test_run_resumes_on_fewer_workers_with_a_larger_batch(tiny_model, cli_env, tmp_path):
    common = [
        f"actor.path={tiny_model}",
        f"output_root={tmp_path}",
        "recover_mode=auto",
        "group_size=2",
        "gen.max_new_tokens=8",
        "ppo.value_norm=true",
        "ppo.adaptive_kl_target=0.01",
    ]
    first = run_cli(
        "ppo-math",
        [
            *common,
            "n_devices_per_node=2",
            "allocation_mode=d2",
            "dataset.batch_size=4",
            "total_train_steps=2",
        ],
        cli_env,
    )
    assert first.returncode == 0, describe(first)
    resumed = run_cli(
        "ppo-math",
        [*common, "n_devices_per_node=1", "dataset.batch_size=6", "total_train_steps=3"],
        cli_env,
    )
    assert resumed.returncode == 0, describe(resumed)
    run_dir = tmp_path / "ppo-math" / "trial0"
    assert "resumed from" in (run_dir / "logs" / "master.log").read_text()
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step000003" / "actor" / "model.safetensors").is_file()


def test_recover_mode_disabled_moves_the_previous_run_aside(tiny_model, cli_env, tmp_path):
    run_dir = tmp_path / "runs" / "sft" / "trial0"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "trainDefault/loss": 1.5}\n')
    (run_dir / "logs" / "master.log").write_text("the previous run's log\n")
    previous_files = {
        path.relative_to(run_dir): path.read_bytes()
        for path in run_dir.rglob("*")
        if path.is_file()
    }

    result = run_cli(
        "sft",
        [
            f"model.path={tiny_model}",
            f"output_root={tmp_path / 'runs'}",
            "total_train_steps=1",
            "dataset.batch_size=4",
            "recover_mode=disabled",
        ],
        cli_env,
    )
    assert result.returncode == 0, describe(result)

    moved = list(run_dir.parent.glob("trial0.old-*"))
    assert len(moved) == 1, sorted(run_dir.parent.iterdir())
    assert {
        path.relative_to(moved[0]): path.read_bytes()
        for path in moved[0].rglob("*")
        if path.is_file()
    } == previous_files
    assert [record["step"] for record in read_metrics(run_dir)] == [1]
    assert "the previous run's log" not in (run_dir / "logs" / "master.log").read_text()
