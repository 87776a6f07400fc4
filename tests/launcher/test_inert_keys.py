"""Keys that would do nothing are errors that name the fix, not silently accepted: keys of a role
the run has no model for or of an MFC its graph leaves out, training keys of a role that does
not train, and keys the other settings leave unread (`inert_keys`). The keys the launcher fills
itself (a linked role's path and dtype, as a saved config.yaml holds them) are not the user's
and pass."""

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
    assert problem.endswith("give the run one: `model` in `reward.sources`.")
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


def test_an_mfc_outside_the_graph_rejects_its_keys(tmp_path):
    problems = _problems(tmp_path, "ppo-math", [*GRPO, "critic_inf.max_tokens_per_microbatch=64",
                                                "rm_inf.min_num_microbatches=2"])
    assert problems == [
        "`rm_inf.min_num_microbatches=2`: this run's graph has no MFC `rm_inf`, so the key would "
        "do nothing; remove it, or give the run one: `model` in `reward.sources`.",
        "`critic_inf.max_tokens_per_microbatch=64`: this run's graph has no MFC `critic_inf`, so "
        "the key would do nothing; remove it, or give the run one: `ppo.disable_value=false`.",
    ]


def _config_problems(tmp_path, experiment: str, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as error:
        resolve_config(get_experiment(experiment).config_class,
                       [f"output_root={tmp_path}", *overrides])
    return error.value.problems


def test_keys_the_other_settings_leave_unread_are_errors(tmp_path):
    problems = _config_problems(tmp_path, "ppo-math", [
        "rollout.max_head_offpolicyness=4", *GRPO, "ppo.lam=0.9", "ppo.value_norm=true",
        "ppo.kl_estimator=k3", "ppo.behav_imp_weight_mode=clamp", "reward.model.clip=5",
        "gen.vllm_gpu_memory_utilization=0.5"])
    assert sorted(problems) == sorted([
        "`rollout.max_head_offpolicyness=4` does nothing with `rollout.mode=sync` (only "
        "asynchronous rollouts read it); set rollout.mode=async, or remove the key.",
        "`gen.vllm_gpu_memory_utilization=0.5` does nothing with `gen.backend=realrl`; set "
        "gen.backend=vllm, or remove the key.",
        "`ppo.value_norm=true` does nothing with `ppo.disable_value=true` (no critic); set "
        "ppo.disable_value=false, or remove the key.",
        "`ppo.kl_estimator=k3` does nothing with `ppo.kl_ctl=0` (no KL term, no reference "
        "model); set ppo.kl_ctl > 0, or remove the key.",
        "`ppo.lam=0.9` does nothing with `ppo.adv_estimator=grpo` (only gae reads it); set "
        "ppo.adv_estimator=gae, or remove the key.",
        "`ppo.behav_imp_weight_mode=clamp` does nothing with `ppo.decoupled_loss=false`; set "
        "ppo.decoupled_loss=true, or remove the key.",
        "`reward.model.clip=5.0` does nothing with `reward.sources=[rule]`; add model to "
        "reward.sources, or remove the key.",
    ])
    # Adapter keys of a role without an adapter; with one they count.
    (problem,) = _config_problems(tmp_path, "sft", ["model.lora.alpha=32"])
    assert problem == ("`model.lora.alpha=32.0` does nothing with `model.lora.rank=0` (no "
                       "adapter); set model.lora.rank > 0, or remove the key.")
    resolve_config(get_experiment("sft").config_class, ["model.lora.rank=8", "model.lora.alpha=32"])
    # The built-in data's keys with a dataset file.
    (problem,) = _config_problems(tmp_path, "sft", ["dataset.path=/data/sft.jsonl",
                                                    "dataset.builtin_train_size=64"])
    assert problem.startswith("`dataset.builtin_train_size=64` does nothing with `dataset.path` "
                              "set (the built-in data is not read); empty dataset.path")
    # gen scores nothing by default: every reward source's keys wait for reward.sources.
    (problem,) = _config_problems(tmp_path, "gen", ["reward.rule.math_timeout_s=9"])
    assert "with `reward.sources=[]`; add rule to reward.sources" in problem
    # A reward model's fixed normalisation with another normalisation.
    (problem,) = _config_problems(tmp_path, "ppo-math", ["reward.sources=[model]",
                                                         "rm.path=/models/rm",
                                                         "reward.model.normalize=running",
                                                         "reward.model.offset=0.5"])
    assert problem == ("`reward.model.offset=0.5` does nothing with `reward.model.normalize="
                       "running`; set reward.model.normalize=fixed, or remove the key.")


def test_the_settings_that_read_those_keys_accept_them(tmp_path):
    config_class = get_experiment("ppo-math").config_class
    resolve_config(config_class, [
        f"output_root={tmp_path}", "rollout.mode=async", "rollout.max_head_offpolicyness=4",
        "ppo.lam=0.9", "ppo.value_norm=true", "ppo.value_norm_beta=0.9", "ppo.kl_estimator=k3",
        "ppo.adaptive_kl_target=0.1", "ppo.adaptive_kl_horizon=100", "ppo.decoupled_loss=true",
        "ppo.behav_imp_weight_mode=clamp", "reward.sources=[rule,model]", "reward.model.clip=5",
        "reward.model.normalize=fixed", "reward.model.offset=0.5", "reward.model.scale=2",
        "rm.path=/models/rm"])
    # A bad value is named once, by the check of its value, not again as unread.
    (problem,) = _config_problems(tmp_path, "ppo-math", ["ppo.behav_imp_weight_mode=truncate"])
    assert "is unknown" in problem
