"""KL estimators, KL-penalised token rewards and KL controllers."""

import math

import pytest
import torch

from realrl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_token_rewards,
)
from realrl.algo.layout import response_mask


def test_k1_k2_k3_by_hand():
    # log_ratio = logp - ref = [1, -1]
    # k1 = [1, -1]; k2 = 0.5 * 1 = [0.5, 0.5]
    # k3 = exp(-log_ratio) - 1 + log_ratio = [e^-1 - 1 + 1, e - 1 - 1] = [0.367879, 0.718282]
    logprobs, ref_logprobs = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "k2"), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(
        kl_estimate(logprobs, ref_logprobs, "k3"), torch.tensor([0.367879, 0.718282])
    )
    torch.testing.assert_close(
        kl_estimate(logprobs, ref_logprobs, "k3", clamp=0.5), torch.tensor([0.367879, 0.5])
    )
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_estimate(logprobs, ref_logprobs, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    policy = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    reference = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    true_kl = float((policy * (policy / reference).log()).sum())  # 0.2597
    generator = torch.Generator().manual_seed(0)
    samples = torch.multinomial(policy, 400_000, replacement=True, generator=generator)
    logprobs, ref_logprobs = policy.log()[samples], reference.log()[samples]
    for estimator in ("k1", "k3"):
        estimate = kl_estimate(logprobs, ref_logprobs, estimator).mean().item()
        assert estimate == pytest.approx(true_kl, abs=5e-3), estimator
    assert (kl_estimate(logprobs, ref_logprobs, "k3") >= 0).all()


def test_token_rewards_put_task_reward_on_last_response_token_and_penalise_kl():
    # seq A: prompt 2 + response 2 -> entries [F, T, T]; kl [5, 0.1, 0.2], kl_ctl 0.5, reward 1
    #        -> [0, -0.05, 1 - 0.1] = [0, -0.05, 0.9]
    # seq B: prompt 2, no response -> entry [F] -> reward 3 has nowhere to go -> [0]
    # seq C: prompt 1 + response 1 -> entry [T]; kl 0.4 -> -0.2 + reward -1 = -1.2
    mask = response_mask(torch.tensor([2, 2, 1]), torch.tensor([4, 2, 2]))
    cu_seqlens = torch.tensor([0, 4, 6, 8])
    kl = torch.tensor([5.0, 0.1, 0.2, 7.0, 0.4])
    rewards = kl_penalized_token_rewards(torch.tensor([1.0, 3.0, -1.0]), kl, 0.5, mask, cu_seqlens)
    torch.testing.assert_close(rewards, torch.tensor([0.0, -0.05, 0.9, 0.0, -1.2]))
    no_penalty = kl_penalized_token_rewards(
        torch.tensor([1.0, 3.0, -1.0]), None, 0.5, mask, cu_seqlens
    )
    torch.testing.assert_close(no_penalty, torch.tensor([0.0, 0.0, 1.0, 0.0, -1.0]))


def test_adaptive_kl_controller_follows_ziegler_update_with_clipped_error():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    # KL 9: error clip(9/6 - 1 = 0.5) = 0.2; beta *= 1 + 0.2 * 256/10000 = 1.00512 -> 0.100512
    controller.update(current_kl=9.0, num_steps=256)
    assert controller.value == pytest.approx(0.100512)
    # KL 3: error clip(-0.5) = -0.2; beta *= 1 - 0.2 * 1000/10000 = 0.98 -> 0.09850176
    controller.update(current_kl=3.0, num_steps=1000)
    assert controller.value == pytest.approx(0.09850176)
    restored = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(controller.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (controller.value, 6.0, 10_000)
    with pytest.raises(ValueError, match="non-finite"):
        controller.update(math.nan, 1)


def test_fixed_kl_controller_never_changes():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, num_steps=10)
    assert controller.value == 0.05
