"""examples/custom_experiment.py through the real CLI, as its docstring and the README use it.

The example adds a reward-model MFC (`rm_inf`) to ppo-math and promises that its `rm_scores`
are logged; with `reward_source=model` the actor trains on them, and the reward a user sees is
that one. A key in `log.per_sample_keys` that the graph does not have fails before anything runs.
"""

from __future__ import annotations

import json

import pytest
from e2e_helpers import REPO_ROOT, describe, read_metrics, run_cli

EXAMPLE = ["--import", str(REPO_ROOT / "examples" / "custom_experiment.py")]
TINY_PPO = ["dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=6", "total_train_steps=2",
            "n_devices_per_node=2"]
RM_STATS = ("mean", "std", "min", "max")


def test_the_example_logs_the_reward_models_scores(tiny_model, cli_env, tmp_path):
    # rm.path empty: a fresh value head on the actor's weights (it scores, having learned nothing)
    result = run_cli("ppo-math-rm", [*EXAMPLE, f"actor.path={tiny_model}",
                                     f"output_root={tmp_path}", *TINY_PPO], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math-rm" / "trial0"
    for record in read_metrics(run_dir):
        assert all(f"batch/rm_scores/{stat}" in record for stat in RM_STATS), sorted(record)
        assert record["batch/rm_scores/min"] <= record["batch/rm_scores/mean"]
        assert record["batch/rm_scores/mean"] <= record["batch/rm_scores/max"]
        assert record["reward/task_mean"] == record["rew_inf/task_mean"]  # reward_source=rule
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all({"reward", "rm_scores"} <= set(sample) for sample in samples)
    assert " | rm_scores " in result.stdout  # the progress line shows the mean


@pytest.mark.slow
def test_training_on_the_reward_model_shows_its_score_as_the_reward(tiny_model, cli_env, tmp_path):
    # A reward model from one `rw` step at a high learning rate: its scores are not all zero.
    rw = run_cli("rw", [f"model.path={tiny_model}", f"output_root={tmp_path}",
                        "dataset.batch_size=4", "total_train_steps=1", "model.optimizer.lr=1e-2"],
                 cli_env)
    assert rw.returncode == 0, describe(rw)
    reward_model = tmp_path / "rw" / "trial0" / "checkpoints" / "step000001" / "default"
    # Best of 3 responses per prompt by the reward model's score; the actor trains on 2.
    result = run_cli("ppo-math-rm", [*EXAMPLE, f"actor.path={tiny_model}", f"rm.path={reward_model}",
                                     "reward_source=model", "generation_size=3",
                                     f"output_root={tmp_path}", *TINY_PPO], cli_env)
    assert result.returncode == 0, describe(result)
    metrics = read_metrics(tmp_path / "ppo-math-rm" / "trial0")
    for record in metrics:
        assert record["reward/task_mean"] == record["batch/rm_scores/mean"] != 0.0
        assert record["reward/task_mean"] == pytest.approx(record["rollout/best_of_n_reward"])
        assert record["actor_train/task_reward"] == pytest.approx(record["reward/task_mean"])
        assert "rew_inf/task_mean" in record  # the verifiable reward is still reported
    shown = [line.split(" | ")[2] for line in result.stdout.splitlines()
             if line.startswith("[master] step ")]
    assert shown == [f"reward {record['reward/task_mean']:.4g}" for record in metrics]


def test_a_logged_key_the_graph_lacks_fails_at_launch_with_the_valid_keys(
    tiny_model, cli_env, tmp_path
):
    result = run_cli("ppo-math-rm", [*EXAMPLE, "--dry-run", f"actor.path={tiny_model}",
                                     f"output_root={tmp_path}",
                                     "log.per_sample_keys=[rm_score]"], cli_env)
    assert result.returncode == 2, describe(result)
    assert "`log.per_sample_keys` names `rm_score`" in result.stderr
    assert "did you mean `rm_scores`?" in result.stderr
    assert "rewards" in result.stderr and "packed_input_ids" in result.stderr
    assert "Traceback" not in result.stderr
