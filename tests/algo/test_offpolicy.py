"""The decoupled PPO objective and the rollout correction against hand-computed values.

Layout of every case: two sequences of 3 tokens, ``cu_seqlens = [0, 3, 6]``, so 4 shifted
entries: sequence 0 owns entries 0 and 1, sequence 1 entries 2 and 3. Log-probs are built from
logarithms of round ratios, so each weight is a number one can check by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from realrl.algo.losses import ppo_policy_loss
from realrl.algo.offpolicy import (
    BEHAVIOUR_WEIGHT_LEVELS,
    BEHAVIOUR_WEIGHT_MODES,
    PROXIMAL_LOGPROB_METHODS,
    behaviour_importance_weights,
    interpolated_proximal_logprobs,
)
from realrl.api import rl_config

CU_SEQLENS = torch.tensor([0, 3, 6])
LN = math.log


def _logprobs(base: list[float], log_ratios: list[float]) -> torch.Tensor:
    return torch.tensor(base) + torch.tensor(log_ratios)


# behaviour, proximal and current log-probs: pi_prox / pi_behav = [2, 0.5, 8, 1] and
# u = pi_theta / pi_prox = [1.5, 0.5, 1, 1]; entry 3 is outside the loss mask.
BEHAVIOUR = torch.tensor([-1.0, -1.0, -3.0, -2.0])
PROXIMAL = _logprobs([-1.0, -1.0, -3.0, -2.0], [LN(2), LN(0.5), LN(8), 0.0])
CURRENT = PROXIMAL + torch.tensor([LN(1.5), LN(0.5), 0.0, 0.0])
ADVANTAGES = torch.tensor([1.0, -2.0, 0.5, 3.0])
LOSS_MASK = torch.tensor([True, True, True, False])


def _decoupled_loss(mode: str, level: str = "token", cap: float = 5.0) -> torch.Tensor:
    weights = behaviour_importance_weights(
        PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS, level=level, mode=mode, cap=cap
    ).weights
    return ppo_policy_loss(
        CURRENT, PROXIMAL, ADVANTAGES, LOSS_MASK, eps_clip=0.2, behaviour_weights=weights
    ).per_token_loss


def test_decoupled_loss_masks_tokens_above_the_cap():
    # loss = -w * min(u A, clip(u, 0.8, 1.2) A):
    # entry 0: w = 2,   u = 1.5, A = 1:  min(1.5, 1.2) = 1.2          -> -2 * 1.2   = -2.4
    # entry 1: w = 0.5, u = 0.5, A = -2: min(-1.0, 0.8 * -2 = -1.6)   -> -0.5 * -1.6 = 0.8
    # entry 2: w = 8 > cap 5: masked, w = 0                            -> 0
    # entry 3: outside the loss mask                                   -> 0
    expected = torch.tensor([-2.4, 0.8, 0.0, 0.0])
    torch.testing.assert_close(_decoupled_loss("mask"), expected)


def test_decoupled_loss_clamps_tokens_above_the_cap():
    # As above, but entry 2's weight is clamped to the cap: w = 5, u = 1, A = 0.5
    # -> -5 * min(0.5, 0.5) = -2.5.
    expected = torch.tensor([-2.4, 0.8, -2.5, 0.0])
    torch.testing.assert_close(_decoupled_loss("clamp"), expected)


def test_decoupled_loss_with_behaviour_equal_to_proximal_is_standard_ppo_exactly():
    logprobs = torch.tensor([-0.7, -1.3, -2.2, -0.1], requires_grad=True)
    proximal = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    standard = ppo_policy_loss(logprobs, proximal, ADVANTAGES, LOSS_MASK, eps_clip=0.2,
                               dual_clip=3.0)
    for mode in BEHAVIOUR_WEIGHT_MODES:
        for level in BEHAVIOUR_WEIGHT_LEVELS:
            weights = behaviour_importance_weights(
                proximal, proximal.clone(), LOSS_MASK, CU_SEQLENS, level=level, mode=mode
            )
            decoupled = ppo_policy_loss(logprobs, proximal, ADVANTAGES, LOSS_MASK, eps_clip=0.2,
                                        dual_clip=3.0, behaviour_weights=weights.weights)
            assert torch.equal(decoupled.per_token_loss, standard.per_token_loss)
            # w = exp(0) = 1 on the response tokens, 0 outside the mask.
            assert weights.weights.tolist() == [1.0, 1.0, 1.0, 0.0]
            assert weights.stats["logp_abs_diff"] == 0.0
            assert weights.stats["capped_fraction"] == 0.0


def test_token_level_weights_and_mismatch_metrics():
    # |log pi_prox - log pi_behav| on the 3 response tokens = [ln 2, ln 2, ln 8] = [1, 1, 3] ln 2
    # -> mean 5/3 ln 2 = 1.155245. Weights (clamp, cap 5): [2, 0.5, 5] -> mean 2.5; one of
    # three tokens over the cap -> capped_fraction 1/3.
    result = behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS,
                                          level="token", mode="clamp", cap=5.0)
    torch.testing.assert_close(result.weights, torch.tensor([2.0, 0.5, 5.0, 0.0]))
    assert result.stats["logp_abs_diff"].item() == pytest.approx(5 / 3 * LN(2), rel=1e-6)
    assert result.stats["weight"].item() == pytest.approx(2.5, rel=1e-6)
    assert result.stats["capped_fraction"].item() == pytest.approx(1 / 3)
    assert result.stats["num_tokens"].item() == 3
    # Masked instead: weights [2, 0.5, 0] -> mean 2.5 / 3 = 0.833333.
    masked = behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS,
                                          level="token", mode="mask", cap=5.0)
    torch.testing.assert_close(masked.weights, torch.tensor([2.0, 0.5, 0.0, 0.0]))
    assert masked.stats["weight"].item() == pytest.approx(2.5 / 3, rel=1e-6)


def test_sequence_level_weight_is_the_product_of_the_token_ratios():
    # Sequence 0: 2 * 0.5 = 1 on both of its tokens. Sequence 1: its only response token
    # (entry 3 is masked) has ratio 8 -> 8 on entry 2, which is over the cap 5.
    truncated = behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS,
                                             level="sequence", mode="clamp", cap=5.0)
    torch.testing.assert_close(truncated.weights, torch.tensor([1.0, 1.0, 5.0, 0.0]))
    masked = behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS,
                                          level="sequence", mode="mask", cap=5.0)
    torch.testing.assert_close(masked.weights, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert masked.stats["capped_fraction"].item() == pytest.approx(1 / 3)
    # A cap of 0.9 drops the whole of sequence 0 too (its product 1 > 0.9): every token masked.
    strict = behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS,
                                          level="sequence", mode="mask", cap=0.9)
    assert strict.weights.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert strict.stats["capped_fraction"].item() == 1.0


def test_sequence_level_weight_of_a_long_response_does_not_overflow():
    # 200 tokens of ratio e: the product e^200 overflows float32 (max ~e^88.7); clamped it is
    # the cap, masked it is 0, never inf or nan.
    cu_seqlens = torch.tensor([0, 201])
    proximal = torch.zeros(200)
    behaviour = torch.full((200,), -1.0)
    mask = torch.ones(200, dtype=torch.bool)
    for mode, value in (("clamp", 5.0), ("mask", 0.0)):
        weights = behaviour_importance_weights(proximal, behaviour, mask, cu_seqlens,
                                               level="sequence", mode=mode, cap=5.0).weights
        assert torch.all(weights == value)


def test_geometric_level_weight_is_the_mean_log_ratio_per_sequence():
    # Sequence 0: exp((ln 2 + ln 0.5) / 2) = 1. Sequence 1 with a third response token of
    # ratio 1/2 on entry 3: exp((ln 8 + ln 0.5) / 2) = sqrt(4) = 2 on both of its tokens.
    proximal = PROXIMAL.clone()
    proximal[3] = BEHAVIOUR[3] + LN(0.5)
    mask = torch.ones(4, dtype=torch.bool)
    result = behaviour_importance_weights(proximal, BEHAVIOUR, mask, CU_SEQLENS,
                                          level="geometric", mode="mask", cap=5.0)
    torch.testing.assert_close(result.weights, torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert result.stats["capped_fraction"].item() == 0.0


def test_truncated_is_corrects_an_injected_mismatch_between_generation_and_training():
    # The trainer's recomputed log-probs are PROXIMAL; the generation engine reported them
    # perturbed by +0.1 on entry 0 and -0.3 on entry 1 (a bf16 engine is off by ~1e-2 per
    # token). w = exp(-0.1) = 0.904837 and exp(0.3) = 1.349859; with cap 1.2 the second is
    # truncated to 1.2. Mean |delta log p| over the 3 response tokens = (0.1 + 0.3 + 0) / 3.
    generation = PROXIMAL + torch.tensor([0.1, -0.3, 0.0, 0.0])
    result = behaviour_importance_weights(PROXIMAL, generation, LOSS_MASK, CU_SEQLENS,
                                          level="token", mode="clamp", cap=1.2)
    torch.testing.assert_close(result.weights, torch.tensor([math.exp(-0.1), 1.2, 1.0, 0.0]))
    assert result.stats["logp_abs_diff"].item() == pytest.approx(0.4 / 3, rel=1e-5)
    assert result.stats["capped_fraction"].item() == pytest.approx(1 / 3)
    assert result.stats["weight"].item() == pytest.approx((math.exp(-0.1) + 1.2 + 1) / 3, rel=1e-6)
    # Sequence level: sequence 0's weight exp(-0.1 + 0.3) = exp(0.2) = 1.221403 > 1.2: masked.
    sequence = behaviour_importance_weights(PROXIMAL, generation, LOSS_MASK, CU_SEQLENS,
                                            level="sequence", mode="mask", cap=1.2)
    torch.testing.assert_close(sequence.weights, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert sequence.stats["capped_fraction"].item() == pytest.approx(2 / 3)


def test_interpolated_proximal_logprobs_follow_areal_loglinear_rule():
    # alpha = (lag - 1) / lag, 0 at lag 0: lags [0, 1, 2, 4] -> alpha [0, 0, 1/2, 3/4];
    # prox = behav + alpha * (current - behav) = -1 + alpha * (-2 - -1) = -1 - alpha.
    behaviour = torch.full((4,), -1.0)
    current = torch.full((4,), -2.0, requires_grad=True)
    lag = torch.tensor([0, 1, 2, 4])
    proximal = interpolated_proximal_logprobs(behaviour, current, lag)
    torch.testing.assert_close(proximal, torch.tensor([-1.0, -1.0, -1.5, -1.75]))
    assert not proximal.requires_grad
    # AReaL's own test case: v_behav 0, v_theta 2 (lag 2), old -1, new -1.5 -> -1.25.
    torch.testing.assert_close(
        interpolated_proximal_logprobs(torch.tensor([-1.0]), torch.tensor([-1.5]),
                                       torch.tensor([2])),
        torch.tensor([-1.25]),
    )


def test_decoupled_loss_with_interpolated_proximal_logprobs():
    # A token generated 2 train steps ago: behav -2, current -2 + 2 ln 2 (ratio 4 to behav).
    # alpha = 1/2 -> prox = -2 + ln 2, so w = pi_prox / pi_behav = 2 and u = pi_theta / pi_prox
    # = 2; with A = 1: -w * min(2 * 1, 1.2 * 1) = -2 * 1.2 = -2.4 (cap 5: not capped).
    behaviour = torch.tensor([-2.0])
    current = torch.tensor([-2.0 + 2 * LN(2)])
    mask = torch.tensor([True])
    cu_seqlens = torch.tensor([0, 2])
    proximal = interpolated_proximal_logprobs(behaviour, current, torch.tensor([2]))
    weights = behaviour_importance_weights(proximal, behaviour, mask, cu_seqlens).weights
    loss = ppo_policy_loss(current, proximal, torch.tensor([1.0]), mask, eps_clip=0.2,
                           behaviour_weights=weights).per_token_loss
    torch.testing.assert_close(weights, torch.tensor([2.0]))
    torch.testing.assert_close(loss, torch.tensor([-2.4]))


def test_behaviour_weight_gradient_flows_only_through_the_current_logprobs():
    # d/d logp of -w * u * A (unclipped, u = 1 at logp = prox) = -w * A = -2 * 1.
    current = PROXIMAL.clone().requires_grad_(True)
    proximal = PROXIMAL.clone().requires_grad_(True)
    weights = behaviour_importance_weights(proximal, BEHAVIOUR, LOSS_MASK, CU_SEQLENS).weights
    loss = ppo_policy_loss(current, proximal, ADVANTAGES, LOSS_MASK,
                           behaviour_weights=weights).per_token_loss
    loss[0].backward()
    assert proximal.grad is None
    assert current.grad.tolist() == pytest.approx([-2.0, 0.0, 0.0, 0.0])


def test_unknown_level_mode_and_bad_cap_name_the_key():
    with pytest.raises(ValueError, match="ppo.behav_imp_weight_level='tokens'"):
        behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS, level="tokens")
    with pytest.raises(ValueError, match="ppo.behav_imp_weight_mode='truncate'"):
        behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS, mode="truncate")
    with pytest.raises(ValueError, match="ppo.behav_imp_weight_cap must be > 0"):
        behaviour_importance_weights(PROXIMAL, BEHAVIOUR, LOSS_MASK, CU_SEQLENS, cap=0.0)


def test_config_choices_match_the_algorithm_module():
    assert rl_config.PROXIMAL_LOGPROB_METHODS == PROXIMAL_LOGPROB_METHODS
    assert rl_config.BEHAVIOUR_WEIGHT_LEVELS == BEHAVIOUR_WEIGHT_LEVELS
    assert rl_config.BEHAVIOUR_WEIGHT_MODES == BEHAVIOUR_WEIGHT_MODES


def test_config_validation_names_the_off_policy_keys():
    problems = rl_config.PPOHyperparameters(
        prox_logp="recompute", behav_imp_weight_level="seq", behav_imp_weight_mode="truncate",
        behav_imp_weight_cap=-1.0,
    ).validate("ppo")
    text = "\n".join(problems)
    for key in ("ppo.prox_logp=recompute", "ppo.behav_imp_weight_level=seq",
                "ppo.behav_imp_weight_mode=truncate", "ppo.behav_imp_weight_cap=-1.0"):
        assert key in text
    # Without the decoupled loss the proximal and behaviour keys are unread (`inert_keys`).
    (rule,) = [rule for rule in rl_config.PPOHyperparameters().inert_keys("ppo")
               if rule.covers("ppo.prox_logp")]
    assert rule.covers("ppo.behav_imp_weight_cap") and rule.fix == "set ppo.decoupled_loss=true"
    assert not any(rule.covers("ppo.prox_logp") for rule in rl_config.PPOHyperparameters(
        decoupled_loss=True).inert_keys("ppo"))
    assert rl_config.PPOHyperparameters(decoupled_loss=True, prox_logp="interpolate").validate(
        "ppo") == []
