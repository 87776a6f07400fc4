"""`<role>.sequence_parallel=true` is checked before anything starts: it needs GPU workers
(megatron-core's sequence-parallel layers allocate on the GPU) and an MFC of the role with
tensor parallelism; a worker that computes on the CPU refuses it too. Layouts of the role with
tp = 1 run without it (megatron-core turns it off there too)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api import config as api_config
from realrl.api.config import ConfigError, resolve_config
from realrl.api.registry import get_experiment
from realrl.backends.torch_engine import ParallelContext
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.launcher.defaults import fresh_default_model
from realrl.launcher.plan import build_plan
from realrl.workers.model_loading import load_engine


def _plan(tmp_path, overrides: list[str]):
    config = resolve_config(get_experiment("ppo-math").config_class,
                            [f"output_root={tmp_path}", "n_devices_per_node=2", *overrides])
    return build_plan(config)


def test_gpu_workers_with_a_tensor_parallel_train_layout_accept_it(tmp_path, monkeypatch):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: True)
    plan = _plan(tmp_path, ["actor.sequence_parallel=true", "critic.sequence_parallel=true",
                            "allocation_mode=actor_train:d1t2,critic_train:d1t2,*:d2"])
    assert plan.allocations["actor_train"].strategy.tensor == 2


def test_a_role_without_any_tensor_parallel_layout_is_refused_with_a_layout_to_use(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: True)
    with pytest.raises(ConfigError) as refused:
        _plan(tmp_path, ["actor.sequence_parallel=true", "allocation_mode=d2"])
    message = str(refused.value)
    assert "`actor.sequence_parallel=true` splits tokens over tensor-parallel ranks" in message
    assert "'actor_train:d1t2,*:d2'" in message and "`actor.sequence_parallel=false`" in message


def test_cpu_workers_are_refused_naming_the_key_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: False)
    with pytest.raises(ConfigError) as refused:
        _plan(tmp_path, ["actor.sequence_parallel=true", "allocation_mode=actor_train:d1t2,*:d2"])
    message = str(refused.value)
    assert "`actor.sequence_parallel=true` needs CUDA workers" in message
    assert "compute on cpu: set `actor.sequence_parallel=false`" in message


def test_cli_dry_run_on_this_cpu_machine_refuses_it_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "realrl.apps.quickstart", "ppo-math", "--dry-run",
         f"output_root={tmp_path}", "actor.sequence_parallel=true"],
        capture_output=True, text=True, timeout=120,
    )
    if api_config.may_have_gpus():
        pytest.skip("this machine may have GPUs: the plan is for GPU workers")
    assert result.returncode == 2, result.stderr
    assert "`actor.sequence_parallel=true` needs CUDA workers" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_cpu_worker_refuses_it_for_a_tensor_parallel_layout_and_ignores_it_at_t1(tmp_path):
    model_path = fresh_default_model(tmp_path / "model")
    config = resolve_config(PPOMathConfig, [f"actor.path={model_path}",
                                            "actor.sequence_parallel=true"])
    actor = config.build().models["actor"]
    with pytest.raises(ConfigError, match="`actor.sequence_parallel=true` needs CUDA workers"):
        load_engine(actor, ParallelContext(tp_rank=0, tp_size=2), True, 1, seed=0)
    engine = load_engine(actor, ParallelContext(), True, 1, seed=0)
    assert not engine.module.sequence_parallel
