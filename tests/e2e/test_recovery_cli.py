"""Checkpoints and recovery through the real CLI.

A ppo-math run killed after its step-2 checkpoint and restarted with `recover_mode=auto` must
end with exactly the weights of an uninterrupted run with the same seed: weights, optimizer and
LR schedule, sampling RNG, data position and the PPO interfaces' own state (adaptive KL
coefficient, value normaliser) all come back. `recover_mode=disabled` on an existing run
directory moves the old run aside intact.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from e2e_helpers import (
    RECOVERABLE_PPO,
    checkpoint_weights,
    describe,
    kill_leftovers,
    processes_mentioning,
    read_metrics,
    run_cli,
    start_cli,
    wait_until,
    without_timing,
)

TOTAL_STEPS = 4
FOUR_STEPS = [*RECOVERABLE_PPO, f"total_train_steps={TOTAL_STEPS}", "save_freq_steps=1"]


def final_weights(run_dir, role: str) -> dict[str, torch.Tensor]:
    return checkpoint_weights(run_dir, TOTAL_STEPS, role)


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_run(
    tiny_model, cli_env, tmp_path
):
    common = [f"actor.path={tiny_model}", *FOUR_STEPS]
    straight = run_cli("ppo-math", [*common, f"output_root={tmp_path / 'straight'}"], cli_env)
    assert straight.returncode == 0, describe(straight)

    output_root = tmp_path / "interrupted"
    run_dir = output_root / "ppo-math" / "trial0"
    resumable = [*common, f"output_root={output_root}", "recover_mode=auto"]
    launcher = start_cli("ppo-math", resumable, cli_env, tmp_path / "first_attempt")
    try:
        step2 = run_dir / "checkpoints" / "step000002"
        wait_until(step2.is_dir, 300, "the step-2 checkpoint", launcher)
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher dies; its children must follow
        launcher.wait()
        assert not (run_dir / "checkpoints" / f"step{TOTAL_STEPS:06d}").exists(), (
            "the run finished before it could be interrupted"
        )
        wait_until(
            lambda: not processes_mentioning(str(run_dir)),
            10,
            "the killed launcher's children to exit",
        )
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(str(run_dir))

    resumed = run_cli("ppo-math", resumable, cli_env)
    assert resumed.returncode == 0, describe(resumed)
    assert "resumed from" in (run_dir / "logs" / "master.log").read_text()

    straight_dir = tmp_path / "straight" / "ppo-math" / "trial0"
    for role in ("actor", "critic", "ref"):
        expected, actual = final_weights(straight_dir, role), final_weights(run_dir, role)
        assert expected.keys() == actual.keys()
        differing = [name for name in expected if not torch.equal(expected[name], actual[name])]
        assert not differing, f"{role}: {len(differing)} tensors differ, e.g. {differing[:3]}"

    straight_metrics, resumed_metrics = read_metrics(straight_dir), read_metrics(run_dir)
    assert [record["step"] for record in resumed_metrics] == list(range(1, TOTAL_STEPS + 1))
    assert [without_timing(r) for r in resumed_metrics] == [
        without_timing(r) for r in straight_metrics
    ]


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
