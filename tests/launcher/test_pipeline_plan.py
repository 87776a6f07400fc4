"""`pipeline_rollout=true` in the launch plan: the auto split, and the errors that name the fix."""

from __future__ import annotations

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math and sft)
from realrl.api.config import ConfigError, resolve_config
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan, split_allocation_mode


def _plan(tmp_path, experiment: str, overrides: list[str]):
    config_class = get_experiment(experiment).config_class
    config = resolve_config(
        config_class,
        [f"output_root={tmp_path}", "pipeline_rollout=true", *overrides],
    )
    return build_plan(config)


def test_split_puts_train_mfcs_on_the_second_half_of_the_workers():
    assert split_allocation_mode(["actor_train"], 2) == "actor_train:d1@1,*:d1@0"
    assert (
        split_allocation_mode(["actor_train", "critic_train"], 4)
        == "actor_train:d2@2-3,critic_train:d2@2-3,*:d2@0-1"
    )
    # An odd count gives the rollout side the extra worker: generation is the larger half.
    assert split_allocation_mode(["actor_train"], 3) == "actor_train:d1@2,*:d2@0-1"


def test_auto_allocation_separates_rollout_from_training(tmp_path):
    plan = _plan(tmp_path, "ppo-math", ["n_devices_per_node=2"])
    ranks = {name: allocation.mesh.ranks for name, allocation in plan.allocations.items()}
    assert ranks == {
        "actor_gen": (0,), "rew_inf": (0,), "ref_inf": (0,), "critic_inf": (0,),
        "actor_train": (1,), "critic_train": (1,),
    }


def test_shared_ranks_are_an_error_that_suggests_a_split(tmp_path):
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, "ppo-math", ["n_devices_per_node=2", "allocation_mode=d2"])
    message = str(error.value)
    assert "`pipeline_rollout=true`" in message and "rank(s) [0, 1]" in message
    assert "allocation_mode='actor_train:d1@1,critic_train:d1@1,*:d1@0'" in message


def test_one_worker_is_an_error_that_asks_for_two(tmp_path):
    with pytest.raises(ConfigError, match="n_devices_per_node=2 allocation_mode="):
        _plan(tmp_path, "ppo-math", ["n_devices_per_node=1"])


def test_a_graph_without_rollout_mfcs_cannot_pipeline(tmp_path):
    with pytest.raises(ConfigError, match="only train MFCs; set pipeline_rollout=false"):
        _plan(tmp_path, "sft", ["n_devices_per_node=2"])
