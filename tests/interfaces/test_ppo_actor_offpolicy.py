"""`ppo.decoupled_loss` through the actor's train step: proximal log-probs, the behaviour weight,
and the mismatch statistics, on a tiny fp32 model (generation log-probs = trainer log-probs)."""

from __future__ import annotations

import math

import pytest
import torch
from interface_helpers import EOS_ID, build_model, make_engine, rollout_batch
from test_ppo_actor import actor_config

from realrl.algo.offpolicy import interpolated_proximal_logprobs
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.common import loss_mask_from_prompt_mask, shifted_seqlens
from realrl.interfaces.ppo_actor import PPOActorInterface
from realrl.interfaces.ppo_batch import policy_lag


def _rollout(engine, tokenizer):
    """Four prompts, two responses each (2 + 2 + 3 + 2 + ... response tokens)."""
    groups, rewards = [], []
    for index, text in enumerate(["1+2=", "40-3=", "7*8=", "9="]):
        prompt = tokenizer.encode(text)
        groups.append([(prompt, [5 + index, 9, EOS_ID]), (prompt, [12, 13 + index, EOS_ID])])
        rewards += [float(index % 2), 1.0 - 0.5 * index]
    return rollout_batch(engine, groups, rewards)


def _train(tokenizer, data_for, **ppo):
    """One train call on a fresh model; returns its stats and the trained parameters."""
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3, adam_eps=1e-4)
    data = data_for(engine)
    stats = PPOActorInterface(actor_config(adv_estimator="rloo", **ppo)).train_step(
        engine, data, MicroBatchSpec()
    ).stats
    return stats, torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])


def _first_response_token_mask(data) -> torch.Tensor:
    """Shifted mask of each sequence's first response token."""
    cu_seqlens = data.cu_seqlens("packed_input_ids")
    loss_mask = loss_mask_from_prompt_mask(data.data["prompt_mask"], cu_seqlens)
    first = torch.zeros_like(loss_mask)
    offset = 0
    for length in [n - 1 for n in data.seqlens_of("packed_input_ids")]:
        first[offset + int(loss_mask[offset : offset + length].int().argmax())] = True
        offset += length
    return first


def test_synchronous_fp32_decoupled_loss_updates_like_standard_ppo(tokenizer):
    # Same weights, same kernels: pi_prox = pi_behav up to rounding, so w = 1 and u = pi/pi_prox
    # has the gradient of PPO's ratio pi/pi_behav at 1: the same update.
    def data_for(engine):
        return _rollout(engine, tokenizer)

    standard, standard_params = _train(tokenizer, data_for)
    decoupled, decoupled_params = _train(tokenizer, data_for, decoupled_loss=True)
    torch.testing.assert_close(decoupled_params, standard_params, atol=1e-6, rtol=0)
    assert decoupled["behav_logp_abs_diff"] < 1e-5
    assert decoupled["behav_imp_weight"] == pytest.approx(1.0, abs=1e-5)
    assert decoupled["behav_capped_fraction"] == 0.0
    assert "behav_imp_weight" not in standard


@pytest.mark.parametrize("mode", ["mask", "clamp"])
def test_injected_behaviour_mismatch_is_measured_and_capped(tokenizer, mode):
    # The generation reports each sequence's first response token ln 8 less likely than the
    # trainer computes: w = 8 > cap 5 on 8 of the 8 * 3 = 24 response tokens (1/3), 1 elsewhere.
    # mean |delta log p| = ln 8 / 3; applied weight mean = (16 + 8 * w_capped) / 24 with
    # w_capped = 0 (mask) or 5 (clamp).
    def data_for(engine):
        data = _rollout(engine, tokenizer)
        first = _first_response_token_mask(data)
        data.data["packed_logprobs"] = data.data["packed_logprobs"] - math.log(8) * first
        return data

    stats, _ = _train(tokenizer, data_for, decoupled_loss=True, behav_imp_weight_mode=mode)
    assert stats["behav_logp_abs_diff"] == pytest.approx(math.log(8) / 3, abs=1e-5)
    assert stats["behav_capped_fraction"] == pytest.approx(1 / 3)
    capped = 0.0 if mode == "mask" else 5.0
    assert stats["behav_imp_weight"] == pytest.approx((16 + 8 * capped) / 24, abs=1e-5)


def test_several_optimizer_steps_take_proximal_logprobs_from_one_forward_before_the_update(
    tokenizer,
):
    # With two mini-batches the second trains on updated weights; its proximal log-probs must
    # still be those of the weights before the call (an extra forward), whose mismatch with the
    # generation's is rounding only.
    def data_for(engine):
        return _rollout(engine, tokenizer)

    stats, _ = _train(tokenizer, data_for, decoupled_loss=True, num_minibatches=2)
    assert stats["optimizer_steps"] == 2.0
    assert stats["behav_logp_abs_diff"] < 1e-5


def _with_versions(data, versions: torch.Tensor, trainer_version: int):
    """`data` with `packed_weight_versions` (shifted, -1 where the next token is a prompt token,
    `versions` on the response tokens) and the trainer's version, as an async batch has them."""
    shifted = shifted_seqlens(data.seqlens["packed_input_ids"])
    loss_mask = loss_mask_from_prompt_mask(data.data["prompt_mask"],
                                           data.cu_seqlens("packed_input_ids"))
    packed = torch.full(loss_mask.shape, -1, dtype=torch.int64)
    packed[loss_mask] = versions
    data.update_(SequenceSample.from_tensors(
        ids=data.ids, seqlens={"packed_weight_versions": shifted},
        data={"packed_weight_versions": packed},
        metadata={"trainer_version": [trainer_version] * data.bs},
    ))
    return data


def test_interpolated_proximal_logprobs_need_the_policy_lag(tokenizer):
    def data_for(engine):
        return _rollout(engine, tokenizer)

    with pytest.raises(ValueError, match="rollout.mode=async"):
        _train(tokenizer, data_for, decoupled_loss=True, prox_logp="interpolate")

    # Lag 0 everywhere (every token by the trainer's version 3): alpha = 0, the behaviour
    # log-probs are the proximal ones, w = 1.
    def lagged(engine):
        data = _rollout(engine, tokenizer)
        tokens = int(data.data["prompt_mask"].logical_not().sum())
        return _with_versions(data, torch.full((tokens,), 3), trainer_version=3)

    stats, params = _train(tokenizer, lagged, decoupled_loss=True, prox_logp="interpolate")
    _, standard_params = _train(tokenizer, lagged)
    assert stats["behav_imp_weight"] == 1.0 and stats["behav_logp_abs_diff"] == 0.0
    torch.testing.assert_close(params, standard_params, atol=1e-6, rtol=0)


def test_bf16_generation_against_fp32_training_is_measured_and_truncated(tokenizer):
    # The behaviour log-probs come from a bf16 copy of the trainer's fp32 model (a generation
    # engine in low precision): a real mismatch of ~1e-2 per token. With cap 1 and clamp, the
    # tokens where the trainer finds them likelier than the generator (w > 1) are truncated.
    def data_for(engine):
        bf16_model = build_model(len(tokenizer))
        bf16_model.load_state_dict(engine.module.state_dict())
        bf16_engine = make_engine(bf16_model.to(torch.bfloat16), tokenizer, lr=None)
        data = _rollout(bf16_engine, tokenizer)
        data.data["packed_logprobs"] = data.data["packed_logprobs"].float()
        return data

    stats, _ = _train(tokenizer, data_for, decoupled_loss=True, behav_imp_weight_mode="clamp",
                      behav_imp_weight_cap=1.0)
    assert 1e-4 < stats["behav_logp_abs_diff"] < 0.2
    assert 0.0 < stats["behav_capped_fraction"] < 1.0
    assert stats["behav_imp_weight"] < 1.0  # every weight <= 1 and some below


def test_interpolation_takes_each_tokens_own_version():
    # One group of two sequences: 2 prompt + 3 response tokens, 2 prompt + 2 response tokens;
    # shifted entry i predicts token i + 1, so each sequence's first entry predicts a prompt
    # token (-1). New weights reached both mid-way: versions 5, 5, 6 and 3, 6.
    data = SequenceSample.from_tensors(
        ids=["group"], seqlens={"packed_weight_versions": [[4, 3]]},
        data={"packed_weight_versions": torch.tensor([-1, 5, 5, 6, -1, 3, 6])},
        metadata={"trainer_version": [7]},
    )
    lag = policy_lag(data)  # 7 - version, 0 on prompt entries
    assert lag.tolist() == [0, 2, 2, 1, 0, 4, 1]
    # alpha = (lag - 1) / lag: [0, 1/2, 1/2, 0, 0, 3/4, 0]; behaviour -1, current -3:
    # prox = -1 + alpha * (-3 - -1) = -1 - 2 * alpha.
    proximal = interpolated_proximal_logprobs(torch.full((7,), -1.0), torch.full((7,), -3.0), lag)
    torch.testing.assert_close(proximal, torch.tensor([-1.0, -2.0, -2.0, -1.0, -1.0, -2.5, -1.0]))
