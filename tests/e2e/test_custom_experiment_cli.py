"""examples/custom_experiment.py through the real CLI, as its docstring and the README use it.

The example trains on one reward model (`reward.sources=[model]`, `rm.path`) and adds an MFC
(`gold_inf`) that scores every response with a second, held-out one, and promises that its
`gold_scores` are logged, never trained on. A key in `log.per_sample_keys` that the graph does
not have fails before anything runs.
"""

from __future__ import annotations

import json

import pytest
from e2e_helpers import REPO_ROOT, describe, read_metrics, run_cli

EXAMPLE = ["--import", str(REPO_ROOT / "examples" / "custom_experiment.py")]
TINY_PPO = ["dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=6", "total_train_steps=2",
            "n_devices_per_node=2"]
GOLD_STATS = ("mean", "std", "min", "max")


def test_the_example_logs_the_gold_reward_models_scores(tiny_model, cli_env, tmp_path):
    # rm.path and gold_rm.path empty: fresh value heads on the actor's weights (they score 0)
    result = run_cli("ppo-gold-rm", [*EXAMPLE, f"actor.path={tiny_model}",
                                     f"output_root={tmp_path}", *TINY_PPO], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-gold-rm" / "trial0"
    for record in read_metrics(run_dir, custom_mfcs=("gold_inf",)):  # the example's MFC
        assert all(f"batch/gold_scores/{stat}" in record for stat in GOLD_STATS), sorted(record)
        assert record["batch/gold_scores/min"] <= record["batch/gold_scores/mean"]
        assert record["batch/gold_scores/mean"] <= record["batch/gold_scores/max"]
        assert record["reward/task_mean"] == record["rm_inf/reward_mean"]  # the proxy's
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all({"reward", "gold_scores"} <= set(sample) for sample in samples)
    assert " | gold_scores " in result.stdout  # the progress line shows the mean


@pytest.mark.slow
def test_a_gold_model_equal_to_the_proxy_scores_what_the_actor_trains_on(
    tiny_model, cli_env, tmp_path
):
    # A reward model from one `rw` step at a high learning rate: its scores are not all zero.
    rw = run_cli("rw", [f"model.path={tiny_model}", f"output_root={tmp_path}",
                        "dataset.batch_size=4", "total_train_steps=1", "model.optimizer.lr=1e-2"],
                 cli_env)
    assert rw.returncode == 0, describe(rw)
    reward_model = tmp_path / "rw" / "trial0" / "checkpoints" / "step000001" / "default"
    # Best of 3 responses per prompt by the proxy's score; the actor trains on 2. gold_rm.path
    # is empty: the gold model is the proxy.
    result = run_cli("ppo-gold-rm", [*EXAMPLE, f"actor.path={tiny_model}",
                                     f"rm.path={reward_model}", "generation_size=3",
                                     f"output_root={tmp_path}", *TINY_PPO], cli_env)
    assert result.returncode == 0, describe(result)
    metrics = read_metrics(tmp_path / "ppo-gold-rm" / "trial0", custom_mfcs=("gold_inf",))
    for record in metrics:
        assert record["reward/task_mean"] == pytest.approx(record["batch/gold_scores/mean"])
        assert record["reward/task_mean"] != 0.0
        assert record["reward/task_mean"] == pytest.approx(record["rollout/best_of_n_reward"])
        assert record["actor_train/task_reward"] == pytest.approx(record["reward/task_mean"])
    shown = [line.split(" | ")[2] for line in result.stdout.splitlines()
             if line.startswith("[master] step ")]
    assert shown == [f"reward {record['reward/task_mean']:.4g}" for record in metrics]


def test_a_logged_key_the_graph_lacks_fails_at_launch_with_the_valid_keys(
    tiny_model, cli_env, tmp_path
):
    result = run_cli("ppo-gold-rm", [*EXAMPLE, "--dry-run", f"actor.path={tiny_model}",
                                     f"output_root={tmp_path}",
                                     "log.per_sample_keys=[gold_score]"], cli_env)
    assert result.returncode == 2, describe(result)
    assert "`log.per_sample_keys` names `gold_score`" in result.stderr
    assert "did you mean `gold_scores`?" in result.stderr
    assert "rewards" in result.stderr and "packed_input_ids" in result.stderr
    assert "Traceback" not in result.stderr
