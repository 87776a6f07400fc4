"""NaN and inf through the real CLI (issue 26 item 4): `nan_policy=stop|skip`.

The non-finite values come from real components: a tiny model with one weight set to inf
(its final norm's first entry), so every hidden state, loss and reward-model score it
computes is NaN. As the policy is trained on (sft) it gives a NaN loss and gradient norm; as
the reward model of ppo-math (`reward.sources=[model]`) it gives NaN rewards, on which PPO
then trains.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from e2e_helpers import assert_traceback_only_in_logs, describe, read_metrics, run_cli
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def inf_model(tiny_model, tmp_path_factory):
    """The tiny model with `model.norm.weight[0] = inf`."""
    directory = tmp_path_factory.mktemp("inf_model") / "model"
    shutil.copytree(tiny_model, directory)
    weights = load_file(directory / "model.safetensors")
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


SFT = ["total_train_steps=2", "dataset.batch_size=4"]


def test_stop_names_the_step_mfc_role_and_micro_batch(inf_model, cli_env, tmp_path):
    result = run_cli("sft", [*SFT, f"model.path={inf_model}", "n_devices_per_node=1",
                             f"output_root={tmp_path}"], cli_env)  # nan_policy=stop: default
    assert result.returncode != 0, describe(result)
    # The launcher's report ends with the one message, naming the worker, step, MFC and role.
    assert ("stopping the run: worker 0: NonFiniteError: step 1, MFC trainDefault, role default, "
            "rank 0: non-finite loss in micro-batch 1 of 1") in result.stderr, describe(result)
    assert "nan_policy=stop" in result.stderr
    logs = tmp_path / "sft" / "trial0" / "logs"
    assert_traceback_only_in_logs(result, [logs / "master.log", logs / "worker0.log"])
    assert not (tmp_path / "sft" / "trial0" / "checkpoints").exists()


def test_skip_keeps_the_weights_on_every_rank_and_counts_the_steps(inf_model, cli_env, tmp_path):
    result = run_cli("sft", [*SFT, f"model.path={inf_model}", "n_devices_per_node=2",
                             "nan_policy=skip", f"output_root={tmp_path}"], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "sft" / "trial0"
    assert [record["trainDefault/skipped_steps"] for record in read_metrics(run_dir)] == [1, 1]
    for rank in (0, 1):  # both data-parallel ranks skipped, on the all-reduced norm
        log = (run_dir / "logs" / f"worker{rank}.log").read_text()
        assert log.count("optimizer step skipped (nan_policy=skip)") == 2, log[-2000:]
    saved = load_file(run_dir / "checkpoints" / "step000002" / "default" / "model.safetensors")
    initial = load_file(inf_model / "model.safetensors")
    assert all(torch.equal(saved[name], initial[name]) for name in initial if name in saved)


PPO_RM = ["reward.sources=[model]", "dataset.batch_size=4", "group_size=2",
          "gen.max_new_tokens=6", "total_train_steps=1", "n_devices_per_node=2"]


def test_a_nan_reward_stops_where_it_appears(tiny_model, inf_model, cli_env, tmp_path):
    result = run_cli("ppo-math", [*PPO_RM, f"actor.path={tiny_model}", f"rm.path={inf_model}",
                                  f"output_root={tmp_path}"], cli_env)
    assert result.returncode != 0, describe(result)
    output = result.stderr + result.stdout
    assert "NonFiniteError: step 1, MFC rm_inf, role rm, rank" in output, describe(result)
    assert "output `rewards` holds" in output and "nan_policy=stop" in output


@pytest.mark.slow
def test_a_nan_reward_under_skip_skips_the_steps_that_train_on_it(
    tiny_model, inf_model, cli_env, tmp_path
):
    result = run_cli("ppo-math", [*PPO_RM, f"actor.path={tiny_model}", f"rm.path={inf_model}",
                                  "nan_policy=skip", f"output_root={tmp_path}"], cli_env)
    assert result.returncode == 0, describe(result)
    (record,) = read_metrics(tmp_path / "ppo-math" / "trial0")
    assert record["actor_train/skipped_steps"] == 1 and record["critic_train/skipped_steps"] == 1
