import pytest
import torch
from interface_helpers import EOS_ID, build_model, make_engine, rollout_batch

from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import PPOHyperparameters
from realrl.interfaces.configs import PPOActorConfig, PPOCriticConfig
from realrl.interfaces.ppo_actor import PPOActorInterface
from realrl.interfaces.ppo_critic import PPOCriticInterface


def _rollout(policy_engine, tokenizer):
    groups = []
    for text in ["1+2=", "40-3=", "7*8="]:
        prompt = tokenizer.encode(text)
        groups.append([(prompt, [6, 7, EOS_ID]), (prompt, [8, 9, 10, 11])])
    return rollout_batch(
        policy_engine, groups, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0], no_eos=[False, True] * 3
    )


def test_critic_inference_gives_one_value_per_token_in_request_order(tokenizer):
    critic = make_engine(build_model(len(tokenizer), critic=True), tokenizer, lr=None)
    data = _rollout(make_engine(build_model(len(tokenizer)), tokenizer, lr=None), tokenizer)
    values = (
        PPOCriticInterface(PPOCriticConfig())
        .inference(critic, data, MicroBatchSpec(max_tokens_per_microbatch=20))
        .data
    )
    assert values.ids == data.ids
    assert values.seqlens["values"] == data.seqlens["packed_input_ids"]
    assert values.dtypes["values"] == torch.float32
    expected = critic.module(data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids"))
    torch.testing.assert_close(values.data["values"], expected.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("value_norm", [False, True])
def test_critic_training_regresses_values_toward_the_returns(tokenizer, value_norm):
    policy = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    critic = make_engine(build_model(len(tokenizer), critic=True), tokenizer, lr=3e-3)
    data = _rollout(policy, tokenizer)
    ppo = PPOHyperparameters(
        adv_estimator="gae",
        kl_ctl=0.0,
        value_norm=value_norm,
        value_norm_type="moving_average",
        num_minibatches=3,
    )
    interface = PPOCriticInterface(PPOCriticConfig(ppo=ppo))
    losses = []
    for _ in range(8):
        data.update_(interface.inference(critic, data, MicroBatchSpec()).data)
        stats = interface.train_step(critic, data, MicroBatchSpec(min_num_microbatches=2)).stats
        losses.append(stats["value_loss"])
    assert losses[-1] < 0.5 * losses[0]
    assert interface.optimizer_steps_per_call() == 3
    if value_norm:
        # Every call folds in the returns of all response tokens: (3 + 4) * 3 groups * 8 calls.
        assert float(interface.state.value_normalizer.count) == 7 * 3 * 8


def test_actor_and_critic_compute_the_same_advantages_from_the_same_rollouts(tokenizer):
    policy = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3)
    critic = make_engine(build_model(len(tokenizer), critic=True), tokenizer, lr=1e-3)
    data = _rollout(policy, tokenizer)
    ppo = PPOHyperparameters(adv_estimator="gae", kl_ctl=0.0, value_norm=True)
    critic_interface = PPOCriticInterface(PPOCriticConfig(ppo=ppo))
    actor = PPOActorInterface(PPOActorConfig(ppo=ppo, group_size=2, generation_size=2))
    data.update_(critic_interface.inference(critic, data, MicroBatchSpec()).data)
    critic_stats = critic_interface.train_step(critic, data, MicroBatchSpec()).stats
    actor_stats = actor.train_step(policy, data, MicroBatchSpec()).stats
    for name in ("advantage", "task_reward", "shaped_reward"):
        assert actor_stats[name] == pytest.approx(critic_stats[name], abs=1e-7)
    actor_mean, _ = actor.state.value_normalizer.mean_std()
    assert float(actor_mean) == float(critic_interface.state.value_normalizer.mean_std()[0])


def test_critic_refuses_to_generate(tokenizer):
    with pytest.raises(NotImplementedError, match="ppo_critic"):
        PPOCriticInterface(PPOCriticConfig()).generate(None, None, MicroBatchSpec())
