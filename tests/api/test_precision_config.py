"""One run-wide `dtype` with per-role overrides, resolved when the config is resolved."""

from __future__ import annotations

import pytest

from realrl.api.config import ConfigError, DType, load_resolved_config, resolve_config, to_yaml
from realrl.api.registry import get_experiment
from realrl.experiments.dpo import DPOExperimentConfig
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.experiments.sft import SFTExperimentConfig


def dtypes(config, roles=("actor", "critic", "ref")) -> dict[str, str]:
    return {role: getattr(config, role).dtype.value for role in roles}


def test_defaults_resolve_every_role_to_float32():
    config = resolve_config(PPOMathConfig)
    assert config.dtype == DType.float32
    assert dtypes(config) == {"actor": "float32", "critic": "float32", "ref": "float32"}


def test_actor_dtype_alone_puts_the_roles_initialised_from_it_in_that_dtype():
    config = resolve_config(PPOMathConfig, ["actor.dtype=bfloat16"])
    assert dtypes(config) == {"actor": "bfloat16", "critic": "bfloat16", "ref": "bfloat16"}
    assert config.dtype == DType.float32  # the run-wide key itself is unchanged


def test_run_wide_dtype_with_a_per_role_override():
    config = resolve_config(PPOMathConfig, ["dtype=bfloat16", "critic.dtype=float32"])
    assert dtypes(config) == {"actor": "bfloat16", "critic": "float32", "ref": "bfloat16"}
    # A linked role set explicitly keeps its own dtype whatever its source's.
    config = resolve_config(PPOMathConfig, ["actor.dtype=bfloat16", "ref.dtype=float32"])
    assert dtypes(config) == {"actor": "bfloat16", "critic": "bfloat16", "ref": "float32"}


def test_dpo_reference_follows_the_actor_and_single_model_experiments_the_run_wide_key():
    dpo = resolve_config(DPOExperimentConfig, ["actor.dtype=bfloat16"])
    assert dtypes(dpo, ("actor", "ref")) == {"actor": "bfloat16", "ref": "bfloat16"}
    sft = resolve_config(SFTExperimentConfig, ["dtype=bfloat16"])
    assert sft.model.dtype == DType.bfloat16


def test_every_built_in_experiment_resolves_every_role_dtype():
    for name in ("ppo-math", "sft", "rw", "dpo", "gen"):
        config = resolve_config(get_experiment(name).config_class, ["dtype=bfloat16"])
        spec = config.build()
        for role, model in spec.models.items():
            if model.config is not None:
                assert model.config.dtype == DType.bfloat16, (name, role)


def test_resolved_yaml_holds_concrete_dtypes_and_reloads(tmp_path):
    config = resolve_config(PPOMathConfig, ["actor.dtype=bfloat16"])
    text = to_yaml(config)
    assert "dtype: null" not in text
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert dtypes(load_resolved_config(PPOMathConfig, path))["ref"] == "bfloat16"


def test_float16_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError) as info:
        resolve_config(PPOMathConfig, ["ref.dtype=float16"])
    message = str(info.value)
    assert "`ref.dtype='float16'`" in message
    assert "float32 | bfloat16 | None" in message
