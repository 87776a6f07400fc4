"""Batches too small for their data-parallel ranks or mini-batches are launch errors that name
the MFC and the fix, not a traceback from the workers' first call."""

from __future__ import annotations

import pytest

import realrl.experiments  # noqa: F401  (registers the experiments)
from realrl.api.config import ConfigError, resolve_config
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan


def _plan(tmp_path, experiment: str, overrides: list[str]):
    config_class = get_experiment(experiment).config_class
    return build_plan(resolve_config(config_class, [f"output_root={tmp_path}", *overrides],
                                     defaults={"experiment_name": experiment}))


def test_a_batch_smaller_than_the_data_parallel_ranks_names_each_mfc_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, "rw", ["dataset.batch_size=1", "n_devices_per_node=2"])
    assert error.value.problems == [
        "MFC `trainDefault` gets 1 sample(s) a call (`dataset.batch_size`) but runs data "
        "parallel over 2 ranks (d2t1p1), each of which needs one; raise dataset.batch_size to "
        "at least 2, or give `trainDefault` fewer data-parallel ranks (allocation_mode, "
        "n_devices_per_node)."]
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, "ppo-math", ["dataset.batch_size=1", "n_devices_per_node=2",
                                     "allocation_mode=d2"])
    assert {problem.split("`")[1] for problem in error.value.problems} == {
        "actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"}
    _plan(tmp_path, "rw", ["dataset.batch_size=2", "n_devices_per_node=2"])


def test_mini_batches_need_a_sample_on_every_rank(tmp_path):
    # 4 prompts over 2 ranks: 2 each, so at most 2 strided mini-batches
    keys = ["dataset.batch_size=4", "n_devices_per_node=2", "allocation_mode=d2",
            "ppo.disable_value=true", "ppo.adv_estimator=grpo"]
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, "ppo-math", [*keys, "ppo.num_minibatches=4"])
    assert error.value.problems == [
        "MFC `actor_train`: `ppo.num_minibatches=4` needs a sample of each mini-batch on each "
        "of its 2 data-parallel ranks, but `dataset.batch_size=4` gives a rank 2; set "
        "ppo.num_minibatches to at most 2, or dataset.batch_size to at least 8."]
    _plan(tmp_path, "ppo-math", [*keys, "ppo.num_minibatches=2"])
    _plan(tmp_path, "ppo-math", [*keys[:1], "n_devices_per_node=1", "ppo.num_minibatches=4",
                                 *keys[3:]])
