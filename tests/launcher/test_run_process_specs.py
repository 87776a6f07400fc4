"""The thread shares and OpenMP settings the local launcher gives its processes, and the command
it prints to resume a run stopped with a checkpoint."""

from __future__ import annotations

import os

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api import environment
from realrl.api.config import resolve_config, usable_cores
from realrl.api.registry import get_experiment
from realrl.launcher.local import openmp_environment, process_specs
from realrl.launcher.plan import build_plan
from realrl.launcher.prepare import resume_command
from realrl.workers.core_share import CoreShareSpec


def _config(tmp_path, n_workers: int, extra: tuple[str, ...] | list[str] = ()):
    config_class = get_experiment("ppo-math").config_class
    return resolve_config(
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


def _specs(tmp_path, n_workers: int, core_share=None):
    config = _config(tmp_path, n_workers)
    return process_specs(config, build_plan(config), port=12345, core_share=core_share)


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
    specs = {spec.name: spec for spec in _specs(tmp_path, 2, core_share=tmp_path / "cores")}
    assert environment.CORE_SHARE not in specs["master"].env
    # The master removes the file once the workers have mapped it.
    assert specs["master"].env[environment.CORE_SHARE_FILE] == str(tmp_path / "cores")
    shares = [CoreShareSpec.from_env(specs[f"worker{rank}"].env[environment.CORE_SHARE])
              for rank in (0, 1)]
    assert [(share.slot, share.slots, share.threads) for share in shares] == [(0, 2, 1), (1, 2, 1)]
    assert {share.path for share in shares} == {tmp_path / "cores"}
    assert all(environment.CORE_SHARE not in spec.env for spec in _specs(tmp_path, 2))


def test_the_launcher_removes_the_core_share_file_and_makes_none_when_off(tmp_path, monkeypatch):
    from realrl.launcher import local, run

    made: list = []

    class Stopped(Exception):
        pass

    def supervisor_that_stops(specs, **options):  # the run ends before any process starts
        made.extend(CoreShareSpec.from_env(spec.env[environment.CORE_SHARE]).path
                    for spec in specs if environment.CORE_SHARE in spec.env)
        raise Stopped

    monkeypatch.setattr(local, "ProcessSupervisor", supervisor_that_stops)
    for extra, expected in (([], 1), (["share_idle_cores=false"], 0)):
        made.clear()
        # The launcher's checks run first: a real (the built-in) model, workers on any machine.
        config = _config(tmp_path / str(expected), 2,
                         ["actor.path=''", "allow_oversubscribe=true", *extra])
        with pytest.raises(Stopped):
            run.run_experiment(config)
        assert len(set(made)) == expected
        assert not any(path.exists() for path in made)


@pytest.mark.parametrize(("setting", "gpus", "forked"),
                         [(None, False, True), ("0", False, False), (None, True, False)])
def test_cpu_workers_are_forked_from_the_fork_server_unless_switched_off(
    tmp_path, monkeypatch, setting, gpus, forked
):
    from realrl.api import config as api_config
    from realrl.launcher import local, run
    from realrl.launcher.forkserver import ENTRY_MODULES

    class Stopped(Exception):
        pass

    preloads = []

    def supervisor_that_stops(specs, preload=()):
        preloads.append(preload)
        raise Stopped

    monkeypatch.setattr(local, "ProcessSupervisor", supervisor_that_stops)
    if setting is None:
        monkeypatch.delenv(environment.FORK_SERVER, raising=False)
    else:
        monkeypatch.setenv(environment.FORK_SERVER, setting)
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: gpus)
    config = _config(tmp_path, 2, ["actor.path=''", "allow_oversubscribe=true"])
    with pytest.raises(Stopped):
        run.run_experiment(config)
    assert preloads == [ENTRY_MODULES if forked else ()]


def test_the_resume_command_is_the_typed_one_with_recover_mode_auto():
    typed = ["/usr/bin/python3", "-m", "realrl.apps.quickstart", "ppo-math", "recover_mode=disabled",
             "actor.path=/models/my model", "++recover_mode=resume", "seed=3"]
    assert resume_command(typed) == ("/usr/bin/python3 -m realrl.apps.quickstart ppo-math "
                                     "'actor.path=/models/my model' seed=3 recover_mode=auto")
