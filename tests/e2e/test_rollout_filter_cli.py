"""Best-of-n and DAPO dynamic sampling through the real CLI."""

import json

from e2e_helpers import read_metrics, run_cli


def test_dynamic_sampling_stops_with_a_clear_error_when_every_group_agrees(tmp_path, cli_env,
                                                                         tiny_model):
    data = tmp_path / "impossible.jsonl"  # no model answers "banana": every reward is 0
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "banana"}) + "\n"
                            for i in range(40)))
    result = run_cli("ppo-math", [
        f"output_root={tmp_path}", f"actor.path={tiny_model}", f"dataset.path={data}",
        "dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=4", "total_train_steps=2",
        "ppo.disable_value=true", "ppo.adv_estimator=grpo", "ppo.dynamic_sampling=true",
        "ppo.max_generation_rounds=2",
    ], env=cli_env)
    assert result.returncode != 0
    assert "too easy or too hard" in result.stderr
    assert "after 2 generation round(s)" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr  # a message for the user, alone


def test_best_of_n_trains_on_group_size_responses_per_prompt(tmp_path, cli_env, tiny_model):
    result = run_cli("ppo-math", [
        f"output_root={tmp_path}", f"actor.path={tiny_model}", "dataset.batch_size=4",
        "group_size=2", "generation_size=5", "gen.max_new_tokens=4", "total_train_steps=1",
        "ppo.disable_value=true", "ppo.adv_estimator=grpo",
    ], env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = read_metrics(tmp_path / "ppo-math" / "trial0")
    assert metrics["actor_train/num_sequences"] == 4 * 2
    assert "rollout/best_of_n_reward" in metrics
    # 3 of each prompt's 5 responses are thrown away, at least one token each; no prompt is.
    assert metrics["rollout/discarded_groups"] == 0
    assert metrics["rollout/discarded_tokens"] >= 4 * 3


def test_ref_offload_hook_runs_through_the_cli(tmp_path, cli_env, tiny_model):
    result = run_cli("ppo-math", [
        f"output_root={tmp_path}", f"actor.path={tiny_model}", "dataset.batch_size=4",
        "group_size=2", "gen.max_new_tokens=4", "total_train_steps=2", "ref.offload=true",
        "ppo.disable_value=true", "ppo.adv_estimator=grpo",
    ], env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "ppo-math" / "trial0" / "plan.json").read_text())
    ref_inf = next(m for m in plan["mfcs"] if m["name"] == "ref_inf")
    assert ref_inf["post_hooks"] == [{"type": "OffloadHook"}]
