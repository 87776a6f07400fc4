"""`rollout.mode=async` in the launch plan: the auto split, and the errors that name the fix."""

from __future__ import annotations

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api.config import ConfigError, resolve_config
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan


def _plan(tmp_path, overrides: list[str]):
    config_class = get_experiment("ppo-math").config_class
    config = resolve_config(config_class,
                            [f"output_root={tmp_path}", "rollout.mode=async", *overrides])
    return build_plan(config)


def test_auto_allocation_puts_generation_and_training_on_different_workers(tmp_path):
    plan = _plan(tmp_path, ["n_devices_per_node=2", "ppo.disable_value=true",
                            "ppo.adv_estimator=grpo"])
    ranks = {name: allocation.mesh.ranks for name, allocation in plan.allocations.items()}
    assert ranks == {"actor_gen": (0,), "rew_inf": (0,), "ref_inf": (0,), "actor_train": (1,)}


def test_shared_ranks_name_the_async_setting_and_its_fix(tmp_path):
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, ["n_devices_per_node=2", "allocation_mode=d2"])
    message = str(error.value)
    assert "`rollout.mode=async` overlaps the rollout MFCs" in message
    assert "rank(s) [0, 1]" in message


def test_requests_must_divide_the_batch_and_cover_the_data_parallel_ranks(tmp_path):
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, ["n_devices_per_node=4", "dataset.batch_size=6",
                         "rollout.groups_per_request=4"])
    assert "`rollout.groups_per_request=4` must divide `dataset.batch_size=6`" in str(error.value)
    with pytest.raises(ConfigError, match="data-parallel size 2"):
        _plan(tmp_path, ["n_devices_per_node=4", "dataset.batch_size=6",
                         "rollout.groups_per_request=1"])
    _plan(tmp_path, ["n_devices_per_node=4", "dataset.batch_size=6"])  # 0: 2 groups, dp 2


def test_the_graph_carries_token_versions_and_the_settings_that_need_them_are_checked(tmp_path):
    # Async: actor_gen writes each token's weight version; the interpolated proximal log-probs
    # read it in actor_train.
    plan = _plan(tmp_path, ["n_devices_per_node=2", "ppo.disable_value=true",
                            "ppo.adv_estimator=grpo", "ppo.decoupled_loss=true",
                            "ppo.prox_logp=interpolate"])
    mfcs = plan.graph.mfcs
    assert "packed_weight_versions" in mfcs["actor_gen"].output_keys
    assert "packed_weight_versions" in mfcs["actor_train"].input_keys
    config_class = get_experiment("ppo-math").config_class
    with pytest.raises(ConfigError, match="only `rollout.mode=async` records"):
        build_plan(resolve_config(config_class, [
            f"output_root={tmp_path}", "ppo.decoupled_loss=true", "ppo.prox_logp=interpolate"]))
    # Dynamic sampling drops groups: only finished-first assembly can fill batches then.
    with pytest.raises(ConfigError, match="set `rollout.assembly=finished_first`"):
        _plan(tmp_path, ["n_devices_per_node=2", "ppo.dynamic_sampling=true"])
    _plan(tmp_path, ["n_devices_per_node=2", "ppo.dynamic_sampling=true",
                     "rollout.assembly=finished_first"])
