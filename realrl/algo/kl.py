"""KL divergence between the policy and the reference model, and the KL coefficient controllers.

The estimators follow J. Schulman, "Approximating KL Divergence" (2020), with samples drawn from
the policy pi and ``log_ratio = log pi(a) - log pi_ref(a)``; writing ``r = pi_ref / pi``:

- ``k1 = -log r = log_ratio``                 unbiased, high variance, can be negative;
- ``k2 = (log r)^2 / 2``                      biased, low variance, always >= 0;
- ``k3 = (r - 1) - log r``                    unbiased, low variance, always >= 0.

The KL enters training in one of two ways (see docs/algorithms.md): as a per-token reward penalty
(`kl_penalized_token_rewards`, used with ``ppo.use_kl_loss=False``) or as a loss term
``ppo.kl_ctl * kl`` added to the policy loss (``ppo.use_kl_loss=True``).
"""

from __future__ import annotations

import math

import torch

from realrl.algo.layout import last_true_index, shifted_cu_seqlens

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate ``[total_tokens - num_seqs]`` (Schulman 2020).

    ``clamp`` bounds the estimate to ``[-clamp, clamp]``; useful for k3, whose ``exp`` explodes
    where the policy has drifted far from the reference on a token.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()  # log pi - log pi_ref = -log r
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r with log r = -log_ratio
    else:
        raise ValueError(
            f"unknown KL estimator {estimator!r} (ppo.kl_estimator); valid: {', '.join(KL_ESTIMATORS)}"
        )
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


def kl_penalized_token_rewards(
    task_rewards: torch.Tensor,
    kl: torch.Tensor | None,
    kl_ctl: float,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Per-token rewards ``[total_tokens - num_seqs]`` for the advantage estimators.

    Ziegler et al. 2019, eq. (2): ``R(x, y) = r(x, y) - beta * KL``, spread over tokens as in
    Ouyang et al. 2022: every response token gets ``-kl_ctl * kl`` and the last response token
    also gets the sequence's task reward ``task_rewards [num_seqs]``. Entries outside the loss
    mask are 0. A sequence with no response token has nowhere to hold its reward: it gets 0
    everywhere. Pass ``kl=None`` (or ``kl_ctl=0``) for rewards without a KL penalty.
    """
    mask = loss_mask.bool()
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_ctl != 0.0:
        token_rewards = token_rewards - kl_ctl * kl.detach().float() * mask
    last = last_true_index(mask, shifted_cu_seqlens(cu_seqlens))  # [num_seqs], -1 if empty
    has_response = last >= 0
    return token_rewards.index_add(
        0, last[has_response], task_rewards.detach().float()[has_response]
    )


class FixedKLController:
    """A constant KL coefficient (``ppo.kl_ctl``; ``ppo.adaptive_kl_target=None``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, num_steps: int) -> None:
        """Nothing to adapt; kept so both controllers are used the same way."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL toward ``target``.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", section 2.2:
    ``e_t = clip(KL_t / target - 1, -0.2, 0.2)`` and ``beta_{t+1} = beta_t (1 + K_beta e_t)``
    with ``K_beta = num_steps / horizon`` (``num_steps`` samples seen since the last update).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target > 0 and horizon > 0 "
                f"(ppo.adaptive_kl_target, ppo.adaptive_kl_horizon); got {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, num_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update got a non-finite KL {current_kl}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * num_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
