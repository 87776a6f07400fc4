"""Role keys that would do nothing are errors that name the fix, not silently accepted: keys of a
role the run has no model for, and training keys of a role that does not train. The keys the
launcher fills itself (a linked role's path and dtype, as a saved config.yaml holds them) are
not the user's and pass."""

from __future__ import annotations

import pytest

import realrl.experiments  # noqa: F401  (registers the built-in experiments)
from realrl.api.config import ConfigError, resolve_config, to_yaml
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan
from realrl.launcher.preflight import resolve_model_paths

GRPO = ["ppo.adv_estimator=grpo", "ppo.disable_value=true", "ppo.kl_ctl=0"]


def _plan(tmp_path, experiment: str, overrides: list[str]):
    config = resolve_config(get_experiment(experiment).config_class,
                            [f"output_root={tmp_path}", *overrides])
    resolve_model_paths(config)
    return build_plan(config)


def _problems(tmp_path, experiment: str, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, experiment, overrides)
    return error.value.problems


def test_a_frozen_role_rejects_its_optimizer_keys(tmp_path):
    problems = _problems(tmp_path, "ppo-math", ["ref.optimizer.lr=0.5",
                                                "ref.gradient_checkpointing=true"])
    assert problems == [
        "`ref.optimizer.lr=0.5`: `ref` does not train in this run (no backward or optimizer "
        "step runs on it), so the key would do nothing; remove it.",
        "`ref.gradient_checkpointing=true`: `ref` does not train in this run (no backward or "
        "optimizer step runs on it), so the key would do nothing; remove it.",
    ]
    dpo = _problems(tmp_path, "dpo", ["ref.optimizer.weight_decay=0.1"])
    assert [p.split(":")[0] for p in dpo] == ["`ref.optimizer.weight_decay=0.1`"]
    gen = _problems(tmp_path, "gen", ["model.optimizer.lr=0.1"])
    assert "`model` does not train" in gen[0]


def test_a_role_without_a_model_names_the_setting_that_adds_one(tmp_path):
    # A reward model path while the rewards stay the rule's: the run would ignore the model.
    (problem,) = _problems(tmp_path, "ppo-math", ["rm.path=/models/my-rm"])
    assert problem.startswith("`rm.path=/models/my-rm`: this run has no `rm` model")
    assert problem.endswith("give the run one: `reward.sources=[model]` (`[rule,model]` to sum "
                            "both).")
    problems = _problems(tmp_path, "ppo-math", [*GRPO, "critic.optimizer.lr=0.01",
                                                "ref.dtype=bfloat16"])
    assert [p.split(":")[0] for p in problems] == ["`critic.optimizer.lr=0.01`",
                                                   "`ref.dtype=bfloat16`"]
    assert "`ppo.disable_value=false`" in problems[0] and "`ppo.kl_ctl` > 0" in problems[1]


def test_keys_the_launcher_filled_pass_and_so_does_a_saved_config(tmp_path):
    # Without a ref, critic or rm, their paths and dtypes are still filled from the actor's.
    plan = _plan(tmp_path, "ppo-math", [*GRPO, "dtype=bfloat16"])
    assert not {"ref", "critic", "rm"} & set(plan.spec.models)
    config = plan.config
    assert config.ref.path == config.actor.path and config.ref.dtype.value == "bfloat16"
    # The run's config.yaml holds those filled values; run again from it, they still pass.
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(config))
    build_plan(resolve_config(type(config), [], config_files=[saved]))
    # The same values set by hand are the same run: nothing to reject.
    _plan(tmp_path, "ppo-math", [*GRPO, f"ref.path={config.actor.path}", "ref.dtype=float32"])
