"""ppo-agent through the real CLI: two steps of tool-using episodes on the built-in
multiplication task, their metrics logged, and a bad episode name refused before launch."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import describe, read_metrics, run_cli

SMALL_AGENT = [
    "dataset.batch_size=2",
    "group_size=2",
    "gen.max_new_tokens=8",
    "total_train_steps=2",
    "n_devices_per_node=1",
]


def test_ppo_agent_trains_on_episodes_and_logs_tool_use(tiny_model, cli_env, tmp_path):
    result = run_cli(
        "ppo-agent", [f"actor.path={tiny_model}", f"output_root={tmp_path}", *SMALL_AGENT],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-agent" / "trial0"
    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics] == [1, 2]
    for record in metrics:
        for name in ("tool_call_fraction", "tool_calls_per_episode", "turns_per_episode",
                     "episodes_per_round"):
            assert f"actor_gen/{name}" in record, sorted(record)
        assert 0.0 <= record["actor_gen/tool_call_fraction"] <= 1.0
        assert record["actor_gen/turns_per_episode"] >= 1.0
        assert "actor_train/task_reward" in record
    log = (run_dir / "logs" / "master.log").read_text()
    assert "built-in multiplication data (train split)" in log


def test_an_unknown_episode_is_refused_before_anything_starts(tiny_model, cli_env, tmp_path):
    result = run_cli(
        "ppo-agent", [f"actor.path={tiny_model}", f"output_root={tmp_path}",
                      "episode.name=no_such_episode", *SMALL_AGENT], cli_env,
    )
    assert result.returncode != 0
    assert "`episode.name=no_such_episode` is not a registered episode" in result.stderr, (
        describe(result))
    assert "tool_arithmetic" in result.stderr


@pytest.mark.slow  # ~35 s on a loaded 2-core machine
def test_ppo_agent_runs_episodes_through_a_chat_template(chat_model, cli_env, tmp_path):
    result = run_cli(
        "ppo-agent", [f"actor.path={chat_model}", f"output_root={tmp_path}",
                      *SMALL_AGENT[:-2], "total_train_steps=1", "n_devices_per_node=1"],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-agent" / "trial0"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)
    assert "actor_gen/tool_call_fraction" in read_metrics(run_dir)[0]


def test_ppo_agent_runs_episodes_in_asynchronous_rollouts(tiny_model, cli_env, tmp_path):
    # Generation runs ahead of training under the staleness bound; every rollout is still made
    # of episodes (the tool metrics come from the episode path only).
    result = run_cli(
        "ppo-agent", [f"actor.path={tiny_model}", f"output_root={tmp_path}", *SMALL_AGENT[:-1],
                      "n_devices_per_node=2", "rollout.mode=async"], cli_env,
    )
    assert result.returncode == 0, describe(result)
    metrics = read_metrics(tmp_path / "ppo-agent" / "trial0")
    assert [record["step"] for record in metrics] == [1, 2]
    assert all("actor_gen/turns_per_episode" in record for record in metrics), metrics
