"""`allocation_mode=auto` on CPU workers: a graph that trains two models runs them side by side."""

from __future__ import annotations

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api import config as api_config
from realrl.api.config import resolve_config
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: False)


def _ranks(tmp_path, overrides: list[str]) -> dict[str, tuple[int, ...]]:
    config = resolve_config(get_experiment("ppo-math").config_class,
                            [f"output_root={tmp_path}", *overrides])
    plan = build_plan(config)
    return {name: allocation.mesh.ranks for name, allocation in plan.allocations.items()}


def test_ppo_trains_the_actor_and_the_critic_on_their_own_workers(tmp_path):
    # The actor's train forward runs ahead beside critic_inf (ppo.reuse_forward): the frozen
    # reference is split over every worker.
    assert _ranks(tmp_path, ["n_devices_per_node=2"]) == {
        "actor_gen": (0, 1), "rew_inf": (0, 1), "ref_inf": (0, 1),
        "actor_train": (0,), "critic_inf": (1,), "critic_train": (1,),
    }
    assert _ranks(tmp_path, ["n_devices_per_node=4"]) == {
        "actor_gen": (0, 1, 2, 3), "rew_inf": (0, 1, 2, 3), "ref_inf": (0, 1, 2, 3),
        "actor_train": (0, 1), "critic_inf": (2, 3), "critic_train": (2, 3),
    }


@pytest.mark.parametrize("ppo", [["ppo.reuse_forward=false"], ["ppo.num_minibatches=2"]])
def test_without_forwards_ahead_the_reference_joins_the_actors_side(tmp_path, ppo):
    assert _ranks(tmp_path, ["n_devices_per_node=2", *ppo]) == {
        "actor_gen": (0, 1), "rew_inf": (0, 1),  # generation and the rule reward: every worker
        "ref_inf": (0,), "actor_train": (0,),
        "critic_inf": (1,), "critic_train": (1,),
    }


@pytest.mark.parametrize("overrides", [
    ["n_devices_per_node=2", "ppo.disable_value=true", "ppo.adv_estimator=grpo"],  # one model
    ["n_devices_per_node=3"],  # no even split
    ["n_devices_per_node=1"],
    ["n_devices_per_node=2", "allocation_mode=d2"],  # an explicit layout is kept
])
def test_every_mfc_stays_on_every_worker_otherwise(tmp_path, overrides):
    ranks = _ranks(tmp_path, overrides)
    n_workers = int(overrides[0].split("=")[1])
    assert set(ranks.values()) == {tuple(range(n_workers))}


def test_gpu_machines_keep_the_data_parallel_default(tmp_path, monkeypatch):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: True)
    assert set(_ranks(tmp_path, ["n_devices_per_node=2"]).values()) == {(0, 1)}


@pytest.mark.parametrize(("gpu_request", "side_by_side"), [("none", True), ("gres", False),
                                                           ("gpus", False)])
@pytest.mark.parametrize("launcher_has_gpus", [False, True])
def test_a_slurm_jobs_layout_follows_its_nodes_not_the_launchers_machine(
    tmp_path, monkeypatch, gpu_request, side_by_side, launcher_has_gpus
):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: launcher_has_gpus)
    ranks = _ranks(tmp_path, ["mode=slurm", "n_devices_per_node=2",
                              f"slurm.gpu_request={gpu_request}"])
    assert (ranks["actor_train"] == (0,)) is side_by_side
