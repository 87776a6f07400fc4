"""`load_engine` applies a role's config to the module it loads."""

from realrl.api.config import resolve_config
from realrl.backends.torch_engine import ParallelContext
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.launcher.defaults import fresh_default_model
from realrl.workers.model_loading import load_engine


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
    import torch

    actor, reference = _load_actor_and_reference(tmp_path, "actor.dtype=bfloat16")
    assert actor.module.dtype == reference.module.dtype == torch.bfloat16
    assert {m.dtype for m in actor.backend.master_weights.masters} == {torch.float32}
    assert reference.backend is None and reference.optimizer is None
