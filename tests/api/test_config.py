from dataclasses import dataclass
from typing import ClassVar

import pytest

from realrl.api.config import (
    BaseExperimentConfig,
    ConfigError,
    all_keys,
    help_field,
    iter_fields,
    load_resolved_config,
    resolve_config,
    to_yaml,
)
from realrl.api.experiment import OptimizerConfig
from realrl.experiments.ppo_math import PPOMathConfig


@dataclass
class ToyConfig(BaseExperimentConfig):
    optimizer: OptimizerConfig = help_field(OptimizerConfig(), "optimizer")
    layers: list[int] = help_field([1, 2], "layer sizes")

    def build(self):
        raise NotImplementedError


def test_overrides_set_nested_keys_lists_and_enums():
    config = resolve_config(
        ToyConfig, ["optimizer.lr=3e-4", "layers=[4,5,6]", "mode=slurm", "wandb.mode=disabled",
                    "n_devices_per_node=8"]
    )
    assert config.optimizer.lr == pytest.approx(3e-4)
    assert config.layers == [4, 5, 6]
    assert config.mode.value == "slurm" and config.wandb.mode.value == "disabled"
    assert isinstance(config, ToyConfig)


def test_unknown_key_is_named_with_nearest_valid_keys():
    with pytest.raises(ConfigError) as info:
        resolve_config(ToyConfig, ["optimizer.lrr=1"])
    message = str(info.value)
    assert "unknown key `optimizer.lrr`" in message
    assert "`optimizer.lr`" in message


def test_type_error_names_key_value_and_expected_type():
    with pytest.raises(ConfigError) as info:
        resolve_config(ToyConfig, ["seed=abc"])
    assert "`seed='abc'`" in str(info.value) and "expected int" in str(info.value)


def test_bad_enum_value_lists_the_choices():
    with pytest.raises(ConfigError) as info:
        resolve_config(ToyConfig, ["mode=cloud"])
    assert "local | slurm" in str(info.value)


def test_cross_field_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        resolve_config(
            PPOMathConfig,
            [
                "dataset.batch_size=6",
                "ppo.num_minibatches=4",
                "gen.min_new_tokens=99",
                "ppo.disable_value=true",
            ],
        )
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert any("`ppo.num_minibatches=4` must divide `dataset.batch_size=6`" in p for p in problems)
    assert any("gen.min_new_tokens=99" in p for p in problems)
    assert any("try `ppo.adv_estimator=grpo`" in p for p in problems)


def test_clip_ranges_and_adamw_settings_out_of_range_are_refused_before_launch():
    # A negative clip range would clamp every ratio to one side; a ratio band of 0 would zero
    # every micro-batch's policy loss; AdamW's own checks would only fire in the workers.
    with pytest.raises(ConfigError) as info:
        resolve_config(PPOMathConfig, [
            "ppo.eps_clip=-0.1", "ppo.eps_clip_high=0", "ppo.value_eps_clip=-1",
            "ppo.ratio_early_stop=0", "actor.optimizer.weight_decay=-1",
            "actor.optimizer.beta1=-0.1", "critic.optimizer.beta2=1", "critic.optimizer.eps=0",
            "actor.optimizer.min_lr_ratio=2"])
    assert sorted(info.value.problems) == sorted([
        "`ppo.eps_clip=-0.1` must be > 0.",
        "`ppo.eps_clip_high=0.0` must be > 0 (or null: `ppo.eps_clip`).",
        "`ppo.value_eps_clip=-1.0` must be > 0 (or null: off).",
        "`ppo.ratio_early_stop=0.0` must be > 0 (or null: off).",
        "`actor.optimizer.weight_decay=-1.0` must be >= 0.",
        "`actor.optimizer.beta1=-0.1` must be in [0, 1).",
        "`critic.optimizer.beta2=1.0` must be in [0, 1).",
        "`critic.optimizer.eps=0.0` must be > 0 (AdamW's default is 1e-8).",
        "`actor.optimizer.min_lr_ratio=2.0` must be in [0, 1].",
    ])
    resolve_config(PPOMathConfig, ["ppo.value_eps_clip=null", "ppo.eps_clip_high=0.28",
                                   "ppo.ratio_early_stop=0.5", "actor.optimizer.beta1=0"])


def test_yaml_file_is_merged_under_command_line_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 7\noptimizer:\n  lr: 0.5\n  weight_decay: 0.1\n")
    config = resolve_config(ToyConfig, ["optimizer.lr=0.25"], [path])
    assert config.seed == 7 and config.optimizer.weight_decay == 0.1
    assert config.optimizer.lr == 0.25


def test_yaml_file_with_unknown_key_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  learning_rate: 0.5\n")
    with pytest.raises(
        ConfigError, match=r"unknown key `optimizer.learning_rate` \(from .*c.yaml\)"
    ):
        resolve_config(ToyConfig, [], [path])


def test_malformed_override_is_an_error():
    with pytest.raises(ConfigError, match="`seed` is not an override"):
        resolve_config(ToyConfig, ["seed"])


def test_resolved_yaml_round_trips(tmp_path):
    config = resolve_config(PPOMathConfig, ["ppo.eps_clip_high=0.28", "gen.stop_token_ids=[3]"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    assert load_resolved_config(PPOMathConfig, path) == config


def test_all_keys_include_sections_and_leaves():
    keys = all_keys(ToyConfig)
    assert "optimizer" in keys and "optimizer.lr" in keys and "wandb.mode" in keys


@dataclass
class ToyWithSectionDefaults(BaseExperimentConfig):
    key_help: ClassVar[dict[str, str]] = {"slow.lr": "The slow optimizer's rate."}

    fast: OptimizerConfig = help_field(OptimizerConfig(lr=2e-4, beta1=0.5), "fast")
    slow: OptimizerConfig = help_field(OptimizerConfig(), "slow")


def test_iter_fields_shows_a_sections_default_instance_and_the_experiments_key_help():
    fields = {info.key: info for info in iter_fields(ToyWithSectionDefaults)}
    assert (fields["fast.lr"].default, fields["fast.beta1"].default) == (2e-4, 0.5)
    assert fields["fast.beta2"].default == OptimizerConfig().beta2
    assert fields["slow.lr"].default == OptimizerConfig().lr
    assert fields["slow.lr"].help == "The slow optimizer's rate."
    assert fields["fast.lr"].help == "Peak learning rate of AdamW."


def test_key_help_naming_an_unknown_key_is_an_error():
    @dataclass
    class Misspelt(BaseExperimentConfig):
        key_help: ClassVar[dict[str, str]] = {"optimiser.lr": "typo"}
        optimizer: OptimizerConfig = help_field(OptimizerConfig(), "optimizer")

    with pytest.raises(ValueError, match=r"Misspelt.key_help names unknown key\(s\) \['optimiser.lr'\]"):
        list(iter_fields(Misspelt))


def test_run_dir_is_output_root_experiment_trial():
    config = resolve_config(ToyConfig, ["output_root=/x", "experiment_name=e", "trial_name=t"])
    assert str(config.run_dir) == "/x/e/t"


def test_zero_devices_per_node_is_detected_locally_and_rejected_on_slurm():
    config = resolve_config(ToyConfig, ["n_devices_per_node=0"])
    assert config.n_devices_per_node >= 1
    with pytest.raises(ConfigError, match="only works with mode=local"):
        resolve_config(ToyConfig, ["mode=slurm"])
