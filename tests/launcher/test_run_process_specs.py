"""The thread shares and OpenMP settings the local launcher gives its processes."""

from __future__ import annotations

import os

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api import environment
from realrl.api.config import resolve_config, usable_cores
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan
from realrl.launcher.run import openmp_environment, process_specs
from realrl.workers.core_share import CoreShareSpec


def _specs(tmp_path, n_workers: int, extra: tuple[str, ...] | list[str] = ()):
    config_class = get_experiment("ppo-math").config_class
    config = resolve_config(
        config_class,
        [
            f"output_root={tmp_path}",
            f"n_devices_per_node={n_workers}",
            "ppo.kl_ctl=0",
            "ppo.disable_value=true",
            "actor.path=/nonexistent-model",
            "ppo.adv_estimator=grpo",
            *extra,
        ],
    )
    return process_specs(config, build_plan(config), port=12345)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
def test_usable_cores_follow_the_cpu_affinity_not_the_host_count():
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_workers_share_the_usable_cores_and_the_master_gets_one_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    specs = _specs(tmp_path, n_workers=2)
    threads = {spec.name: spec.num_threads for spec in specs}
    assert threads == {"master": 1, "worker0": 2, "worker1": 2}


def test_processes_sleep_at_openmp_barriers_unless_the_user_chose_a_policy(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert all(spec.env["OMP_WAIT_POLICY"] == "PASSIVE" for spec in _specs(tmp_path, 1))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert openmp_environment() == {}
    assert all("OMP_WAIT_POLICY" not in spec.env for spec in _specs(tmp_path, 1))


def test_each_worker_gets_its_own_slot_in_the_machine_core_share(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    specs = {spec.name: spec for spec in _specs(tmp_path, n_workers=2)}
    assert environment.CORE_SHARE not in specs["master"].env
    shares = [CoreShareSpec.from_env(specs[f"worker{rank}"].env[environment.CORE_SHARE])
              for rank in (0, 1)]
    assert [(share.slot, share.slots, share.threads) for share in shares] == [(0, 2, 1), (1, 2, 1)]
    assert shares[0].path == shares[1].path
    assert shares[0].path.parent == specs["master"].log_path.parent.parent


def test_share_idle_cores_false_keeps_the_even_split(tmp_path):
    specs = _specs(tmp_path, n_workers=2, extra=["share_idle_cores=false"])
    assert all(environment.CORE_SHARE not in spec.env for spec in specs)
