import pytest

from realrl.algo.advantages import ADVANTAGE_ESTIMATORS
from realrl.api import rl_config
from realrl.api.config import ConfigError, resolve_config
from realrl.api.dfg import ParamReallocHook
from realrl.api.registry import get_experiment
from realrl.experiments.dpo import DPOExperimentConfig
from realrl.experiments.ppo_math import PPOMathConfig

SIX_MFCS = {"actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"}


def ppo_graph(*overrides):
    config = resolve_config(PPOMathConfig, list(overrides))
    return config.build().graph()


def test_ppo_math_has_six_mfcs_in_three_levels():
    graph = ppo_graph()
    assert set(graph.mfcs) == SIX_MFCS
    assert graph.levels == [["actor_gen"], ["critic_inf", "ref_inf", "rew_inf"],
                            ["actor_train", "critic_train"]]
    assert graph.parents["actor_train"] == ["actor_gen", "critic_inf", "ref_inf", "rew_inf"]


def test_ppo_math_without_value_drops_critic_mfcs():
    graph = ppo_graph("ppo.disable_value=true", "ppo.adv_estimator=grpo")
    assert set(graph.mfcs) == SIX_MFCS - {"critic_inf", "critic_train"}
    assert "values" not in graph.mfcs["actor_train"].input_keys


def test_ppo_math_with_zero_kl_drops_reference():
    graph = ppo_graph("ppo.kl_ctl=0")
    assert "ref_inf" not in graph.mfcs
    assert "packed_ref_logprobs" not in graph.mfcs["actor_train"].input_keys


@pytest.mark.parametrize(("overrides", "ahead"), [
    ((), True),
    (("ppo.kl_ctl=0",), True),  # the critic's calls are still there to run beside
    (("ppo.disable_value=true", "ppo.adv_estimator=grpo", "ppo.kl_ctl=0"), False),  # nothing
    (("ppo.reuse_forward=false",), False),
    (("ppo.num_minibatches=2",), False),  # the second mini-batch needs a fresh forward
    (("ppo.num_epochs=2",), False),
])
def test_actor_train_sends_its_forward_ahead_when_it_can_use_it(overrides, ahead):
    forward_keys = ppo_graph(*overrides).mfcs["actor_train"].forward_keys
    assert forward_keys == (("packed_input_ids",) if ahead else ())


def test_ref_ema_eta_adds_post_hook_on_actor_train():
    graph = ppo_graph("ref_ema_eta=0.5")
    assert graph.mfcs["actor_train"].post_hooks == [ParamReallocHook("actor", "ref", 0.5)]


@pytest.mark.parametrize("name,mfcs", [("sft", {"trainDefault"}), ("rw", {"trainDefault"}),
                                       ("dpo", {"ref_inf", "actor_train"}),
                                       ("gen", {"genDefault"})])
def test_other_experiments_build_valid_graphs(name, mfcs):
    entry = get_experiment(name)
    config = resolve_config(entry.config_class, [], defaults={"experiment_name": name})
    assert set(config.build().graph().mfcs) == mfcs


def test_remax_adds_a_greedy_rollout_and_its_reward_as_the_baseline():
    graph = ppo_graph("ppo.adv_estimator=remax", "ppo.disable_value=true")
    assert {"actor_gen_greedy", "rew_inf_greedy"} <= set(graph.mfcs)
    assert graph.producers["baseline_rewards"] == "rew_inf_greedy"
    assert graph.parents["rew_inf_greedy"] == ["actor_gen_greedy"]
    assert "baseline_rewards" in graph.mfcs["actor_train"].input_keys
    assert graph.mfcs["actor_gen_greedy"].interface_config.generation.greedy


def test_ppo_agent_is_ppo_maths_grpo_graph_with_episodes_in_actor_gen():
    entry = get_experiment("ppo-agent")
    config = resolve_config(entry.config_class, [], defaults={"experiment_name": "ppo-agent"})
    assert config.validate() == []
    graph = config.build().graph()
    assert set(graph.mfcs) == {"actor_gen", "rew_inf", "actor_train"}
    assert graph.mfcs["actor_gen"].interface_config.episode.name == "tool_arithmetic"


@pytest.mark.parametrize("overrides,problem", [
    (["episode.name=no_such_episode"], "`episode.name=no_such_episode` is not a registered"),
    (["episode.module=no/such/file.py"], "`episode.module=no/such/file.py` cannot be imported"),
    (["episode.tools=[calc,shell]"], "names unknown tools ['shell']"),
    (["ppo.overlong_buffer_len=4"], "`ppo.overlong_buffer_len=4`: length shaping"),
])
def test_ppo_agent_refuses_what_episodes_cannot_run(overrides, problem):
    entry = get_experiment("ppo-agent")
    with pytest.raises(ConfigError) as caught:
        resolve_config(entry.config_class, overrides, defaults={"experiment_name": "ppo-agent"})
    assert any(problem in text for text in caught.value.problems), caught.value.problems


def test_dpo_with_a_lora_actor_takes_the_actors_base_as_its_reference():
    models = resolve_config(DPOExperimentConfig, ["actor.path=/m", "actor.lora.rank=4"]).build().models
    assert models["ref"].shares_base_with == "actor"
    for other in (["actor.path=/m"], ["actor.path=/m", "actor.lora.rank=4", "ref.path=/other"],
                  ["actor.path=/m", "actor.lora.rank=4", "ref.dtype=bfloat16"]):
        assert resolve_config(DPOExperimentConfig, other).build().models["ref"].shares_base_with is None, other
    with pytest.raises(ConfigError) as error:
        resolve_config(DPOExperimentConfig, ["actor.path=/m", "actor.lora.rank=4", "ref.lora.rank=2",
                             "ref.offload=true"])
    assert "`ref.lora.rank=2`: the reference does not train" in str(error.value)
    assert "`ref.offload=true` with `actor.lora.rank` > 0" in str(error.value)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_one_response_per_prompt_is_refused_by_the_group_baseline_estimators(estimator):
    entry = get_experiment("ppo-math")
    with pytest.raises(ConfigError) as caught:
        resolve_config(entry.config_class, ["group_size=1", f"ppo.adv_estimator={estimator}",
                                            "ppo.disable_value=true"],
                       defaults={"experiment_name": "ppo-math"})
    assert any(f"`group_size=1` with `ppo.adv_estimator={estimator}`" in text
               and "set group_size to 2 or more" in text for text in caught.value.problems)


@pytest.mark.parametrize("overrides", [["ppo.adv_estimator=gae"],
                                       ["ppo.adv_estimator=reinforce_plus_plus",
                                        "ppo.disable_value=true"],
                                       ["ppo.adv_estimator=remax", "ppo.disable_value=true"]])
def test_one_response_per_prompt_trains_with_an_estimator_without_a_group_baseline(overrides):
    entry = get_experiment("ppo-math")
    config = resolve_config(entry.config_class, ["group_size=1", *overrides],
                            defaults={"experiment_name": "ppo-math"})
    assert config.validate() == []
    with pytest.raises(ConfigError, match="ppo.dynamic_sampling=true` with `group_size=1`"):
        resolve_config(entry.config_class, ["group_size=1", "ppo.dynamic_sampling=true",
                                            *overrides], defaults={"experiment_name": "ppo-math"})


def test_the_config_names_the_registrys_group_baseline_estimators():
    # realrl.api.rl_config holds the names without importing torch (the launcher reads them)
    assert rl_config.ADVANTAGE_ESTIMATORS == tuple(ADVANTAGE_ESTIMATORS)
    assert set(rl_config.GROUP_ESTIMATORS) == {
        name for name, estimator in ADVANTAGE_ESTIMATORS.items() if estimator.needs_groups}


def test_gspo_refuses_token_ratio_bounds_and_notes_ranges_unlike_its_papers(tmp_path):
    entry = get_experiment("ppo-math")
    with pytest.raises(ConfigError) as caught:
        resolve_config(entry.config_class, ["ppo.policy_loss=gspo", "ppo.dual_clip=3",
                                            "ppo.ratio_early_stop=0.5"],
                       defaults={"experiment_name": "ppo-math"})
    assert caught.value.problems == [
        f"`ppo.{key}` bounds the clipped surrogate of token ratios, which "
        "`ppo.policy_loss=gspo` does not use; set it to null."
        for key in ("dual_clip=3.0", "ratio_early_stop=0.5")]
    with pytest.raises(ConfigError, match="`ppo.policy_loss=gpso` is unknown; choose one of "
                                          "ppo, gspo, cispo"):
        resolve_config(entry.config_class, ["ppo.policy_loss=gpso"],
                       defaults={"experiment_name": "ppo-math"})
    paper = ["ppo.policy_loss=gspo", "ppo.eps_clip=3e-4", "ppo.eps_clip_high=4e-4",
             "ppo.loss_agg_mode=seq-mean-token-mean"]
    for overrides, noted in ((paper, False), (["ppo.policy_loss=gspo"], True)):
        config = resolve_config(entry.config_class, overrides,
                                defaults={"experiment_name": "ppo-math"})
        notes = config.build().notes
        assert any("GSPO's paper clips" in note for note in notes) == noted, notes
