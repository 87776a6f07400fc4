"""The decoupled PPO objective through the real CLI, with `pipeline_rollout=true`."""

from __future__ import annotations

import pytest
from e2e_helpers import describe, read_metrics, run_cli


def test_pipelined_rollout_with_the_decoupled_loss_logs_the_behaviour_mismatch(
    tiny_model, cli_env, tmp_path
):
    """Step 1's rollout comes from the weights that train on it (lag 0): in fp32 the behaviour
    and proximal log-probs agree up to rounding, so the weight is 1. Later rollouts are one
    train step old (lag 1): the proximal log-probs (the trainer's weights before its update)
    differ from the generation's by that step."""
    result = run_cli(
        "ppo-math",
        [
            f"actor.path={tiny_model}", f"output_root={tmp_path}", "dataset.batch_size=4",
            "group_size=2", "gen.max_new_tokens=8", "total_train_steps=3",
            "n_devices_per_node=2", "ppo.disable_value=true", "ppo.adv_estimator=grpo",
            "pipeline_rollout=true", "ppo.decoupled_loss=true", "ppo.behav_imp_weight_mode=clamp",
        ],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    metrics = read_metrics(tmp_path / "ppo-math" / "trial0")
    assert [record["actor_train/policy_lag"] for record in metrics] == [0, 1, 1]
    first, *lagged = metrics
    assert first["actor_train/behav_logp_abs_diff"] < 1e-4
    assert first["actor_train/behav_imp_weight"] == pytest.approx(1.0, abs=1e-4)
    for record in lagged:
        assert record["actor_train/behav_logp_abs_diff"] > 10 * first[
            "actor_train/behav_logp_abs_diff"
        ]
        assert 0.0 <= record["actor_train/behav_capped_fraction"] <= 1.0
