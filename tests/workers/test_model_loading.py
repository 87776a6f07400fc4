"""`load_engine` applies a role's config to the module it loads."""

import pytest
import torch

from realrl.api.config import resolve_config
from realrl.api.experiment import OptimizerBackendName
from realrl.backends.torch_engine import ParallelContext
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.launcher.defaults import fresh_default_model
from realrl.workers.model_loading import load_engine, resolve_optimizer_backend


def _load_actor_and_reference(tmp_path, override: str):
    """The actor (trainable) and reference (frozen) engines of a PPO config with `override`."""
    model_path = fresh_default_model(tmp_path / "model")
    config = resolve_config(
        PPOMathConfig,
        [f"actor.path={model_path}", f"ref.path={model_path}", override, "ppo.kl_ctl=0.1"],
    )
    models = config.build().models
    actor = load_engine(models["actor"], ParallelContext(), True, 1, seed=0)
    reference = load_engine(models["ref"], ParallelContext(), False, 1, seed=0)
    return actor, reference


def test_role_compile_key_reaches_the_loaded_module_of_that_role_only(tmp_path):
    actor, reference = _load_actor_and_reference(tmp_path, "actor.compile=true")
    assert actor.module.compiled_blocks is not None
    assert actor.module.compiled_blocks.key == "actor.compile"  # named in compile errors
    assert reference.module.compiled_blocks is None


def test_single_model_experiments_name_their_compile_key_model(tmp_path):
    from realrl.experiments.sft import SFTExperimentConfig

    model_path = fresh_default_model(tmp_path / "model")
    config = resolve_config(SFTExperimentConfig, [f"model.path={model_path}", "model.compile=true"])
    engine = load_engine(config.build().models["default"], ParallelContext(), True, 1, seed=0)
    assert engine.module.compiled_blocks.key == "model.compile"


def test_role_share_prefixes_key_reaches_the_loaded_module_of_that_role_only(tmp_path):
    actor, reference = _load_actor_and_reference(tmp_path, "ref.share_prefixes=false")
    assert actor.module.share_prefixes  # on by default
    assert not reference.module.share_prefixes


def test_actor_dtype_loads_the_reference_in_it_too_and_masters_for_the_actor_only(tmp_path):
    actor, reference = _load_actor_and_reference(tmp_path, "actor.dtype=bfloat16")
    assert actor.module.dtype == reference.module.dtype == torch.bfloat16
    assert {m.dtype for m in actor.backend.master_weights.masters} == {torch.float32}
    assert reference.backend is None and reference.optimizer is None


def test_role_gradient_checkpointing_key_reaches_the_loaded_module_of_that_role_only(tmp_path):
    actor, reference = _load_actor_and_reference(tmp_path, "actor.gradient_checkpointing=true")
    assert actor.module.gradient_checkpointing
    assert not reference.module.gradient_checkpointing


def test_optimizer_backend_auto_is_torch_on_cpu_and_megatron_on_cuda(tmp_path):
    actor, _ = _load_actor_and_reference(tmp_path, "actor.optimizer.backend=auto")
    assert type(actor.backend).__name__ == "TorchOptimizerBackend"
    spec = resolve_config(PPOMathConfig, []).build().models["actor"]
    assert spec.config.optimizer.backend == OptimizerBackendName.auto  # the default
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_optimizer_backend(spec, cuda) == OptimizerBackendName.megatron
    assert resolve_optimizer_backend(spec, cpu) == OptimizerBackendName.torch
    chosen = resolve_config(PPOMathConfig, ["actor.optimizer.backend=torch"]).build()
    assert resolve_optimizer_backend(chosen.models["actor"], cuda) == OptimizerBackendName.torch


def test_optimizer_backend_megatron_on_a_cpu_worker_is_refused_naming_key_and_fix(tmp_path):
    with pytest.raises(ValueError) as refused:
        _load_actor_and_reference(tmp_path, "actor.optimizer.backend=megatron")
    message = str(refused.value)
    assert "`actor.optimizer.backend=megatron` needs CUDA workers" in message
    assert "`actor.optimizer.backend=auto`" in message and "compute on cpu" in message
