"""`ppo.decoupled_loss` through the actor's train step: proximal log-probs, the behaviour weight,
and the mismatch statistics, on a tiny fp32 model (generation log-probs = trainer log-probs)."""

from __future__ import annotations

import math

import pytest
import torch
from interface_helpers import EOS_ID, build_model, make_engine, rollout_batch
from test_ppo_actor import actor_config

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.common import loss_mask_from_prompt_mask, shifted_seqlens
from realrl.interfaces.ppo_actor import PPOActorInterface


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


def test_interpolated_proximal_logprobs_need_the_policy_lag(tokenizer):
    def data_for(engine):
        return _rollout(engine, tokenizer)

    with pytest.raises(ValueError, match="packed_policy_lag"):
        _train(tokenizer, data_for, decoupled_loss=True, prox_logp="interpolate")

    # Lag 0 everywhere: alpha = 0, the behaviour log-probs are the proximal ones, w = 1.
    def lagged(engine):
        data = _rollout(engine, tokenizer)
        shifted = shifted_seqlens(data.seqlens["packed_input_ids"])
        lag = torch.zeros(sum(map(sum, shifted)), dtype=torch.int64)
        data.update_(SequenceSample.from_tensors(
            ids=data.ids, seqlens={"packed_policy_lag": shifted}, data={"packed_policy_lag": lag}
        ))
        return data

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
