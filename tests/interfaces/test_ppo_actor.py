import dataclasses
import math

import pytest
import torch
from interface_helpers import EOS_ID, build_model, make_engine, prompt_batch, rollout_batch

from realrl.algo.aggregation import LOSS_AGG_MODES
from realrl.algo.layout import packed_shifted_logprobs, segment_sum, shifted_cu_seqlens
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters
from realrl.interfaces.common import loss_mask_from_prompt_mask
from realrl.interfaces.configs import PPOActorConfig
from realrl.interfaces.ppo_actor import PPOActorInterface
from realrl.interfaces.reference import ReferenceInterface


def actor_config(group_size=2, generation_size=None, max_new_tokens=6, **ppo) -> PPOActorConfig:
    ppo.setdefault("adv_estimator", "grpo")
    ppo.setdefault("kl_ctl", 0.0)
    return PPOActorConfig(
        ppo=PPOHyperparameters(**ppo),
        generation=GenerationHyperparameters(max_new_tokens=max_new_tokens),
        group_size=group_size,
        generation_size=generation_size or group_size,
    )


def test_generate_returns_group_size_sequences_per_prompt_in_the_rollout_layout(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    prompts = prompt_batch(tokenizer, ["1+2=", "33*4="], {"answer": ["3", "132"]})
    actor = PPOActorInterface(actor_config(group_size=3, generation_size=5))
    result = actor.generate(engine, prompts, MicroBatchSpec())
    rollout = result.data

    assert rollout.ids == prompts.ids and rollout.metadata["answer"] == ["3", "132"]
    assert [len(lens) for lens in rollout.seqlens["packed_input_ids"]] == [3, 3]
    assert rollout.seqlens["seq_no_eos_mask"] == [[1, 1, 1], [1, 1, 1]]
    assert rollout.dtypes == {
        "packed_input_ids": torch.int64,
        "packed_logprobs": torch.float32,
        "prompt_mask": torch.bool,
        "seq_no_eos_mask": torch.bool,
    }
    lengths = rollout.seqlens_of("packed_input_ids")
    assert rollout.seqlens_of("packed_logprobs") == [n - 1 for n in lengths]
    prompt_tokens = [tokenizer.encode(p) for p in ["1+2=", "33*4="]]
    sequences = rollout.data["packed_input_ids"].split(lengths)
    masks = rollout.data["prompt_mask"].split(lengths)
    no_eos = rollout.data["seq_no_eos_mask"].tolist()
    for index, (tokens, mask) in enumerate(zip(sequences, masks)):
        prompt = prompt_tokens[index // 3]
        assert tokens[: len(prompt)].tolist() == prompt
        assert mask.tolist() == [True] * len(prompt) + [False] * (len(tokens) - len(prompt))
        assert 1 <= len(tokens) - len(prompt) <= 6
        assert no_eos[index] == (tokens[-1].item() != EOS_ID)
    cu_seqlens = rollout.cu_seqlens("packed_input_ids")
    loss_mask = loss_mask_from_prompt_mask(rollout.data["prompt_mask"], cu_seqlens)
    assert torch.all(rollout.data["packed_logprobs"][~loss_mask] == 0)
    assert torch.all(rollout.data["packed_logprobs"][loss_mask] < 0)
    assert result.stats["generated_tokens_per_s"] > 0
    assert 1 <= result.stats["response_length"] <= 6


def test_reference_logprobs_equal_generation_logprobs_for_the_same_model(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    prompts = prompt_batch(tokenizer, ["1+2=", "33*4=", "7-1="])
    rollout = (
        PPOActorInterface(actor_config(group_size=2))
        .generate(engine, prompts, MicroBatchSpec())
        .data
    )
    reference = (
        ReferenceInterface()
        .inference(engine, rollout, MicroBatchSpec(max_tokens_per_microbatch=15))
        .data
    )
    assert reference.ids == rollout.ids
    assert reference.seqlens["packed_ref_logprobs"] == rollout.seqlens["packed_logprobs"]
    loss_mask = loss_mask_from_prompt_mask(
        rollout.data["prompt_mask"], rollout.cu_seqlens("packed_input_ids")
    )
    torch.testing.assert_close(
        reference.data["packed_ref_logprobs"][loss_mask],
        rollout.data["packed_logprobs"][loss_mask],
        atol=1e-5,
        rtol=1e-5,
    )


def test_first_ppo_step_has_ratio_one_and_the_hand_computed_loss(tokenizer):
    # One prompt, two responses with rewards 1 and 0, GRPO without whitening:
    # mean 0.5, unbiased std sqrt(0.5) = 0.70711, so A = +-0.5 / 0.70711 = +-0.70711.
    # The ratio is 1 on the first step, so the token-mean loss is -sum(A) / tokens
    # = -(3 * 0.70711 - 2 * 0.70711) / 5 = -0.141421.
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-2)
    prompt = tokenizer.encode("1+2=")
    data = rollout_batch(engine, [[(prompt, [6, 7, EOS_ID]), (prompt, [8, EOS_ID])]], [1.0, 0.0])
    actor = PPOActorInterface(actor_config(adv_norm=False))
    stats = actor.train_step(engine, data, MicroBatchSpec()).stats
    assert stats["importance_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["policy_loss"] == pytest.approx(-0.141421, abs=1e-5)
    assert stats["task_reward"] == pytest.approx(0.5)
    assert stats["clip_fraction"] == 0.0


def test_ppo_step_moves_logprobs_in_the_direction_of_the_advantages(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-2)
    prompt = tokenizer.encode("1+2=")
    data = rollout_batch(engine, [[(prompt, [6, 7, EOS_ID]), (prompt, [8, 9, EOS_ID])]], [1.0, 0.0])
    actor = PPOActorInterface(actor_config())
    before = _response_logprob_sums(engine, data)
    for _ in range(3):
        actor.train_step(engine, data, MicroBatchSpec())
    after = _response_logprob_sums(engine, data)
    assert after[0] > before[0] + 0.1  # the rewarded response became more likely
    assert after[1] < before[1] - 0.1  # the unrewarded one less likely


def _response_logprob_sums(engine, data: SequenceSample) -> torch.Tensor:
    ids, cu_seqlens = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        logprobs = packed_shifted_logprobs(engine.module(ids, cu_seqlens), ids, cu_seqlens)
    mask = loss_mask_from_prompt_mask(data.data["prompt_mask"], cu_seqlens)
    return segment_sum(logprobs * mask, shifted_cu_seqlens(cu_seqlens))


def _four_sample_rollout(engine, tokenizer):
    groups, rewards = [], []
    for index, text in enumerate(["1+2=", "40-3=", "7*8=", "9="]):
        prompt = tokenizer.encode(text)
        groups.append([(prompt, [5 + index, 9, EOS_ID]), (prompt, [12, 13 + index, 14, 15])])
        rewards += [float(index % 2), 1.0 - 0.5 * index]
    return rollout_batch(engine, groups, rewards, no_eos=[False, True] * 4)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_one_and_four_microbatches_give_the_same_parameters(tokenizer, mode):
    reference_engine = make_engine(build_model(len(tokenizer), seed=1), tokenizer, lr=None)
    config = actor_config(
        adv_estimator="rloo",
        kl_ctl=0.05,
        entropy_coef=0.01,
        loss_agg_mode=mode,
        num_epochs=2,
        eps_clip_high=0.3,
        dual_clip=3.0,
    )
    parameters = []
    for spec in (MicroBatchSpec(), MicroBatchSpec(min_num_microbatches=4)):
        engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3, adam_eps=1e-4)
        data = _four_sample_rollout(engine, tokenizer)
        data.update_(ReferenceInterface().inference(reference_engine, data, spec).data)
        stats = PPOActorInterface(config).train_step(engine, data, spec).stats
        parameters.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
        assert stats["optimizer_steps"] == 2.0 and stats["kl_to_ref"] != 0.0
    torch.testing.assert_close(parameters[0], parameters[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_other_policy_losses_train_the_same_over_micro_batches_and_unlike_ppo(tokenizer, loss):
    # Two epochs: the second sees ratios != 1, which GSPO clips per sequence and CISPO
    # truncates per token (tight ranges, so that both act).
    reference_engine = make_engine(build_model(len(tokenizer), seed=1), tokenizer, lr=None)
    parameters, clip = {}, {}
    for name, spec in ((loss, MicroBatchSpec()), (loss, MicroBatchSpec(min_num_microbatches=4)),
                       ("ppo", MicroBatchSpec())):
        config = actor_config(adv_estimator="grpo", kl_ctl=0.05, num_epochs=2,
                              loss_agg_mode="seq-mean-token-mean", policy_loss=name,
                              eps_clip=3e-4, eps_clip_high=4e-4)
        engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3, adam_eps=1e-4)
        data = _four_sample_rollout(engine, tokenizer)
        data.update_(ReferenceInterface().inference(reference_engine, data, spec).data)
        stats = PPOActorInterface(config).train_step(engine, data, spec).stats
        key = f"{name}/{spec.min_num_microbatches}"
        parameters[key] = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        clip[key] = stats["clip_fraction"]
    torch.testing.assert_close(parameters[f"{loss}/1"], parameters[f"{loss}/4"], atol=1e-6,
                               rtol=0)
    assert clip[f"{loss}/1"] == pytest.approx(clip[f"{loss}/4"]) and clip[f"{loss}/1"] > 0
    assert not torch.allclose(parameters[f"{loss}/1"], parameters["ppo/1"], atol=1e-6, rtol=0)


def test_kl_loss_mode_adds_the_kl_term_and_adaptive_kl_moves_the_coefficient(tokenizer):
    reference_engine = make_engine(build_model(len(tokenizer), seed=1), tokenizer, lr=None)
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-2)
    data = _four_sample_rollout(engine, tokenizer)
    data.update_(ReferenceInterface().inference(reference_engine, data, MicroBatchSpec()).data)
    config = actor_config(
        kl_ctl=0.1,
        use_kl_loss=True,
        kl_estimator="k3",
        adaptive_kl_target=1e-6,
        adaptive_kl_horizon=10,
    )
    actor = PPOActorInterface(config)
    first = actor.train_step(engine, data, MicroBatchSpec()).stats
    second = actor.train_step(engine, data, MicroBatchSpec()).stats
    assert first["kl_loss_term"] > 0  # k3 is positive where the models differ
    assert first["loss"] == pytest.approx(
        first["policy_loss"] + 0.1 * first["kl_loss_term"], rel=1e-4, abs=1e-6
    )
    # KL far above target: beta grows by the clipped error 0.2 * num_sequences / horizon.
    assert second["kl_coef"] == pytest.approx(0.1 * (1 + 0.2 * 8 / 10))


def test_train_step_names_missing_keys(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer)
    data = _four_sample_rollout(engine, tokenizer).select(["packed_input_ids", "prompt_mask"])
    with pytest.raises(KeyError, match="packed_logprobs"):
        PPOActorInterface(actor_config()).train_step(engine, data, MicroBatchSpec())


def test_optimizer_steps_per_call_is_epochs_times_minibatches():
    config = actor_config(num_epochs=3, num_minibatches=2)
    assert PPOActorInterface(config).optimizer_steps_per_call() == 6
    with pytest.raises(ValueError, match="generation_size"):
        PPOActorInterface(dataclasses.replace(config, generation_size=1, group_size=2))
    assert math.isfinite(config.ppo.eps_clip)
