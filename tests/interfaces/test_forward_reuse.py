"""A train call that takes the forward run ahead of it (`TorchEngine.forward(keep=True)`):
PPO's critic_inf forward and actor_train's forward sent early give the same update as the
plain order, run the model once instead of twice, and fall back to a fresh forward whenever
the kept one no longer applies."""

import dataclasses

import pytest
import torch
from interface_helpers import EOS_ID, build_model, make_engine, rollout_batch

from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import PPOHyperparameters
from realrl.interfaces.configs import PPOActorConfig, PPOCriticConfig
from realrl.interfaces.ppo_actor import PPOActorInterface
from realrl.interfaces.ppo_critic import PPOCriticInterface


def _rollout(engine, tokenizer, texts=("1+2=", "40-3=", "7*8=")):
    groups, rewards = [], []
    for index, text in enumerate(texts):
        prompt = tokenizer.encode(text)
        groups.append([(prompt, [6 + index, 7, EOS_ID]), (prompt, [8, 9 + index, 10, 11])])
        rewards += [float(index % 2), 0.5 * index]
    return rollout_batch(engine, groups, rewards, no_eos=[False, True] * len(texts))


def _ppo(**overrides) -> PPOHyperparameters:
    return PPOHyperparameters(**{"adv_estimator": "gae", "kl_ctl": 0.0} | overrides)


def _counting(engine) -> list[int]:
    """Counts the model's forwards on `engine`."""
    calls = [0]
    engine.module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _parameters(engine) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])


def _critic_step(tokenizer, ppo, spec=None, between=None):
    """critic_inf then critic_train on a fresh critic: (parameters, values, forwards run)."""
    spec = spec or MicroBatchSpec()
    policy = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    critic = make_engine(build_model(len(tokenizer), critic=True), tokenizer, lr=1e-2)
    data = _rollout(policy, tokenizer)
    calls = _counting(critic)
    interface = PPOCriticInterface(PPOCriticConfig(ppo=ppo))
    data.update_(interface.inference(critic, data, spec).data)
    if between is not None:
        between(critic)
    stats = interface.train_step(critic, data, spec).stats
    assert stats["forward_reused"] == (1.0 if calls[0] == 1 else 0.0)
    return _parameters(critic), data.data["values"], calls[0]


def test_critic_train_takes_the_forward_of_critic_inf_and_updates_identically(tokenizer):
    reused, reused_values, reused_calls = _critic_step(tokenizer, _ppo())
    plain, plain_values, plain_calls = _critic_step(tokenizer, _ppo(reuse_forward=False))
    assert (reused_calls, plain_calls) == (1, 2)
    assert torch.equal(reused_values, plain_values)
    assert torch.equal(reused, plain)


@pytest.mark.parametrize(
    "ppo, spec",
    [
        (_ppo(num_minibatches=3), MicroBatchSpec()),  # later mini-batches see new weights
        (_ppo(num_epochs=2), MicroBatchSpec()),
        (_ppo(), MicroBatchSpec(min_num_microbatches=2)),  # would hold both micro-batches
    ],
)
def test_nothing_is_kept_when_the_train_call_could_not_use_it(tokenizer, ppo, spec):
    _, _, calls = _critic_step(tokenizer, ppo, spec)
    microbatches, steps = spec.min_num_microbatches, ppo.num_epochs * ppo.num_minibatches
    assert calls == microbatches + steps * microbatches


def test_weights_changed_after_the_forward_make_the_train_call_run_its_own(tokenizer):
    def overwrite(critic):  # e.g. a reallocation or a checkpoint load in between
        with torch.no_grad():
            critic.module.final_norm.weight.mul_(1.5)

    reused, _, calls = _critic_step(tokenizer, _ppo(), between=overwrite)
    plain, _, _ = _critic_step(tokenizer, _ppo(reuse_forward=False), between=overwrite)
    assert calls == 2
    assert torch.equal(reused, plain)


def test_a_train_call_in_between_drops_the_kept_forward(tokenizer):
    def train_on_other_data(critic):
        policy = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
        data = _rollout(policy, tokenizer, texts=("5-5=", "6+1="))
        interface = PPOCriticInterface(PPOCriticConfig(ppo=_ppo(reuse_forward=False)))
        data.update_(interface.inference(critic, data, MicroBatchSpec()).data)
        interface.train_step(critic, data, MicroBatchSpec())

    reused, _, calls = _critic_step(tokenizer, _ppo(), between=train_on_other_data)
    plain, _, _ = _critic_step(tokenizer, _ppo(reuse_forward=False), between=train_on_other_data)
    assert calls == 1 + 2 + 1
    assert torch.equal(reused, plain)


def test_actor_train_forward_sent_ahead_gives_the_same_update(tokenizer):
    results = []
    for reuse in (True, False):
        engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-2)
        data = _rollout(engine, tokenizer)
        calls = _counting(engine)
        ppo = _ppo(adv_estimator="grpo", reuse_forward=reuse, entropy_coef=0.01)
        config = PPOActorConfig(ppo=ppo, group_size=2, generation_size=2)
        interface = PPOActorInterface(config)
        ahead = data.select(("packed_input_ids",))
        assert interface.train_forward(engine, ahead, MicroBatchSpec()).data is None
        stats = interface.train_step(engine, data, MicroBatchSpec()).stats
        assert stats.pop("forward_reused") == float(reuse)
        results.append((_parameters(engine), calls[0], stats))
    (reused, reused_calls, reused_stats), (plain, plain_calls, plain_stats) = results
    assert (reused_calls, plain_calls) == (1, 1)  # the same forward, run earlier
    assert torch.equal(reused, plain)
    assert reused_stats == plain_stats


def test_a_kept_forward_is_used_once_and_only_for_its_own_input(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-2)
    data = _rollout(engine, tokenizer)
    ids, cu_seqlens = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    calls = _counting(engine)
    engine.forward(ids, cu_seqlens, keep=True)
    other = dataclasses.replace(data, data=dict(data.data, packed_input_ids=ids.flip(0)))

    def loss_fn(forward, part):
        return forward(part.data["packed_input_ids"], cu_seqlens).square().mean(), {}

    engine.train_microbatches([other], loss_fn)  # different tokens: a fresh forward
    assert calls[0] == 2
    engine.train_microbatches([data], loss_fn)  # dropped by the call before, and stale
    assert calls[0] == 3
    with pytest.raises(AssertionError, match="frozen"):
        make_engine(build_model(len(tokenizer)), tokenizer, lr=None).forward(
            ids, cu_seqlens, keep=True
        )
