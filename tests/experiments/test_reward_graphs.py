"""The reward part of the PPO-family graphs (`reward.sources`), and ppo-rlhf.

One source writes `rewards` itself; several are summed by `reward_sum` on the weightless
`reward` role; the reward model is role `rm` with its own MFC and allocation; ReMax scores its
greedy baseline with copies of the same MFCs.
"""

import pytest

from realrl.api.config import ConfigError, iter_fields, resolve_config
from realrl.api.experiment import DatasetKind, ModelKind
from realrl.api.reward_config import RewardSource
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.experiments.ppo_rlhf import PPORLHFConfig
from realrl.interfaces.configs import RewardSumConfig

URL = "reward.remote.url=http://127.0.0.1:8000/score"


def spec(*overrides, config_class=PPOMathConfig):
    return resolve_config(config_class, list(overrides)).build()


def test_a_reward_model_source_is_role_rm_whose_mfc_writes_the_rewards():
    built = spec("reward.sources=[model]", "rm.path=/models/rw")
    graph = built.graph()
    assert "rew_inf" not in graph.mfcs and "reward" not in built.models
    rm_inf = graph.mfcs["rm_inf"]
    assert (rm_inf.model_role, rm_inf.interface, rm_inf.output_keys) == (
        "rm", "model_reward", ("rewards",))
    assert graph.producers["rewards"] == "rm_inf"
    assert built.models["rm"].kind == ModelKind.critic and not built.models["rm"].trainable
    assert built.models["rm"].config.path == "/models/rw"
    assert not any("rm.path" in note for note in built.notes)


def test_dry_run_notes_that_a_reward_model_from_the_actor_scores_zero():
    notes = spec("reward.sources=[model]").notes  # rm.path empty: the actor's, a fresh head
    assert any(note.startswith("rm.path is actor.path (or empty)") for note in notes), notes


def test_rm_offload_frees_the_reward_models_memory_after_each_call():
    from realrl.api.dfg import OffloadHook

    graph = spec("reward.sources=[model]", "rm.offload=true").graph()
    assert graph.mfcs["rm_inf"].post_hooks == [OffloadHook()]
    assert spec("reward.sources=[model]").graph().mfcs["rm_inf"].post_hooks == []


def test_several_sources_are_summed_with_their_weights_by_reward_sum():
    built = spec("reward.sources=[rule,model,remote]", URL, "reward.rule.weight=0.5",
                 "reward.model.weight=2")
    graph = built.graph()
    assert {graph.producers[key] for key in ("rule_rewards", "model_rewards", "remote_rewards")
            } == {"rew_inf", "rm_inf", "remote_inf"}
    reward_sum = graph.mfcs["reward_sum"]
    assert reward_sum.model_role == "reward" and graph.producers["rewards"] == "reward_sum"
    assert reward_sum.interface_config == RewardSumConfig(
        {"rule": 0.5, "model": 2.0, "remote": 1.0})
    assert graph.mfcs["remote_inf"].model_role == "reward"
    assert graph.parents["actor_train"] == ["actor_gen", "critic_inf", "ref_inf", "reward_sum"]


def test_one_source_with_a_weight_other_than_one_goes_through_reward_sum():
    graph = spec("reward.rule.weight=2").graph()
    assert graph.producers["rule_rewards"] == "rew_inf"
    assert graph.producers["rewards"] == "reward_sum"


def test_the_default_rule_reward_keeps_the_six_mfc_graph():
    graph = spec().graph()
    assert graph.producers["rewards"] == "rew_inf" and "reward_sum" not in graph.mfcs


def test_best_of_n_filters_after_the_mfc_that_writes_the_rewards():
    assert spec("generation_size=16").rollout_filter.after_mfc == "rew_inf"
    summed = spec("generation_size=16", "reward.sources=[rule,model]")
    assert summed.rollout_filter.after_mfc == "reward_sum"


def test_remax_scores_its_greedy_baseline_with_the_same_sources():
    graph = spec("ppo.adv_estimator=remax", "ppo.disable_value=true",
                 "reward.sources=[rule,model]").graph()
    assert graph.producers["baseline_rewards"] == "reward_sum_greedy"
    assert graph.mfcs["rm_inf_greedy"].input_keys == ("greedy_input_ids",)
    assert graph.mfcs["rm_inf_greedy"].input_key_remap == {"greedy_input_ids": "packed_input_ids"}
    assert graph.mfcs["reward_sum_greedy"].input_keys == ("greedy_rule_rewards",
                                                          "greedy_model_rewards")


def test_the_reward_model_gets_its_own_allocation():
    from realrl.launcher.plan import build_plan

    config = resolve_config(PPOMathConfig, [
        "reward.sources=[model]", "n_devices_per_node=2",
        "allocation_mode=rm_inf:d1@1,actor_train:d1@0,*:d2"])
    plan = build_plan(config)
    assert plan.allocations["rm_inf"].mesh.ranks == (1,)
    assert [worker.roles for worker in plan.workers] == [
        ["actor", "critic", "ref"], ["actor", "critic", "ref", "rm"]]


@pytest.mark.parametrize(("overrides", "problem"), [
    (["reward.sources=[]"], "`reward.sources=[]` selects no reward"),
    (["reward.sources=[remote]"], "`reward.remote.url=''` must be an http:// or https:// URL"),
    (["reward.sources=[remote]", URL, "reward.remote.timeout_s=0"],
     "`reward.remote.timeout_s=0.0` must be > 0"),
    (["reward.sources=[remote]", URL, "reward.remote.max_retries=-1"],
     "`reward.remote.max_retries=-1` must be >= 0"),
    (["reward.sources=[model]", "reward.model.normalize=fixed", "reward.model.scale=0"],
     "`reward.model.scale=0.0` must be > 0 with `reward.model.normalize=fixed`"),
    (["reward.sources=[remote]", URL, "reward.remote.token_env=sk-abc.123"],
     "`reward.remote.token_env='sk-abc.123'` must be the NAME of an environment variable"),
    (["reward.sources=[rule,rule]"], "`reward.sources` names ['rule'] more than once"),
    (["reward.sources=[model]", "rm_inf.min_num_microbatches=0"],
     "`rm_inf.min_num_microbatches=0` must be >= 1"),
])
def test_reward_settings_are_checked_at_launch(overrides, problem):
    with pytest.raises(ConfigError) as error:
        resolve_config(PPOMathConfig, overrides)
    assert problem in str(error.value)


def test_ppo_rlhf_trains_on_a_reward_model_from_chat_records():
    built = spec(config_class=PPORLHFConfig)
    assert built.dataset_kind == DatasetKind.chat
    assert built.graph().producers["rewards"] == "rm_inf"
    assert resolve_config(PPORLHFConfig, []).reward.sources == [RewardSource.model]


def test_ppo_rlhf_has_every_algorithm_key_of_ppo_math():
    def keys(config_class):
        return {info.key: (info.type_name, info.default) for info in iter_fields(config_class)
                if info.key.split(".")[0] in ("ppo", "gen", "actor", "critic", "ref", "rm")}

    assert keys(PPORLHFConfig) == keys(PPOMathConfig)


def test_gen_scores_its_completions_with_the_same_sources_and_reads_chat_records():
    from realrl.experiments.gen import GenerationExperimentConfig

    plain = spec(config_class=GenerationExperimentConfig)
    assert set(plain.graph().mfcs) == {"genDefault"} and set(plain.models) == {"default"}
    assert plain.dataset_kind == DatasetKind.chat  # {"prompt"} or {"messages"}, no answer needed
    scored = spec("reward.sources=[rule,model]", "rm.path=/models/rw",
                  config_class=GenerationExperimentConfig)
    graph = scored.graph()
    assert set(graph.mfcs) == {"genDefault", "rew_inf", "rm_inf", "reward_sum"}
    assert graph.parents["rm_inf"] == ["genDefault"]
    assert {graph.producers[key] for key in ("rule_rewards", "model_rewards", "rewards")} == {
        "rew_inf", "rm_inf", "reward_sum"}
    assert scored.models["rm"].config.path == "/models/rw" and "reward" in scored.models
    with pytest.raises(ConfigError, match=r"`reward.sources` has model but `rm.path` is empty"):
        spec("reward.sources=[model]", config_class=GenerationExperimentConfig)


@pytest.mark.parametrize("value", [None, ""])
def test_a_remote_token_variable_missing_at_launch_is_refused_before_any_process_starts(
    monkeypatch, value
):
    from realrl.launcher.preflight import remote_token_problems

    monkeypatch.delenv("REWARD_TOKEN_FOR_TEST", raising=False)
    if value is not None:
        monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", value)
    config = resolve_config(PPOMathConfig, ["reward.sources=[rule,remote]", URL,
                                            "reward.remote.token_env=REWARD_TOKEN_FOR_TEST"])
    state = "not set" if value is None else "empty"
    assert remote_token_problems(config) == [
        f"`reward.remote.token_env=REWARD_TOKEN_FOR_TEST`, but $REWARD_TOKEN_FOR_TEST is {state} "
        "here: export REWARD_TOKEN_FOR_TEST=<the reward service's token> before starting the "
        "run, or set reward.remote.token_env= (empty) for a service without authentication"]
    monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", "t0ken")
    assert remote_token_problems(config) == []
    # No remote source: nothing would send the token, and the key is refused as unread.
    with pytest.raises(ConfigError, match=r"`reward.remote.token_env=UNSET_VARIABLE` does "
                       r"nothing with `reward.sources=\[rule\]`; add remote to reward.sources"):
        resolve_config(PPOMathConfig, ["reward.remote.token_env=UNSET_VARIABLE"])
