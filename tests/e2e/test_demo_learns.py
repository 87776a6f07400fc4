"""The main job learns out of the box: ppo-math on the built-in defaults raises the task reward
(the same check as `make demo`, at a smaller scale: fewer steps, so a smaller required rise)."""

import pytest
from e2e_helpers import read_metrics, run_cli


@pytest.mark.slow
def test_ppo_math_defaults_raise_the_task_reward(tmp_path, cli_env):
    result = run_cli(
        "ppo-math",
        [f"output_root={tmp_path}", "wandb.mode=disabled", "tensorboard=false",
         "n_devices_per_node=2", "total_train_steps=150"],
        env=cli_env, timeout_s=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [m["reward/task_mean"] for m in read_metrics(tmp_path / "ppo-math" / "trial0")]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert last - first >= 0.08, (first, last, rewards)
