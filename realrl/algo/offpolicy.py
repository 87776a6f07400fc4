"""Off-policy corrections: the behaviour importance weight and the proximal log-probs of the
decoupled PPO objective (``ppo.decoupled_loss``).

Three policies take part (AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", arXiv:2505.24298, section "Decoupled
PPO Objective"):

- the *behaviour* policy ``pi_behav``: the weights and the engine that generated the tokens
  (the generation engine's ``packed_logprobs``);
- the *proximal* policy ``pi_prox``: the trainer's weights before this train step's update;
- the *current* policy ``pi_theta``, the one being optimised.

The per-token loss is ``-w * min(u * A, clip(u, 1 - eps, 1 + eps_high) * A)`` with the trust
region ``u = pi_theta / pi_prox`` (`realrl.algo.losses.ppo_policy_loss` with ``old_logprobs =
proximal`` log-probs) and the behaviour weight ``w = pi_prox / pi_behav``, capped
(`behaviour_importance_weights`). Clipping against ``pi_prox`` instead of ``pi_behav`` keeps the
trust region around the newest weights however stale the data; ``w`` corrects the staleness.

In a synchronous run ``pi_prox`` and ``pi_behav`` are the same weights evaluated by two engines
(generation kernels, precision), so ``w`` is the *rollout correction* for their mismatch:
truncated importance sampling (``clamp``, Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training") or masked importance sampling (``mask``), at the
token or the sequence level, as verl's rollout correction does in its decoupled mode.

Shapes follow `realrl.algo`: shifted per-token tensors ``[total_tokens - num_seqs]`` and the
unshifted ``cu_seqlens [num_seqs + 1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from realrl.algo.layout import broadcast_to_tokens, segment_sum, shifted_cu_seqlens

BEHAVIOUR_WEIGHT_LEVELS = ("token", "sequence", "geometric")
BEHAVIOUR_WEIGHT_MODES = ("clamp", "mask")
PROXIMAL_LOGPROB_METHODS = ("forward", "interpolate")


@dataclass
class BehaviourWeights:
    weights: torch.Tensor  # [total_tokens - num_seqs], 0 outside the loss mask and where masked
    stats: dict[str, torch.Tensor]  # detached masked means over response tokens, + num_tokens


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask_f = mask.to(values.dtype)
    return (values * mask_f).sum() / mask_f.sum().clamp(min=1)


def behaviour_log_weights(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, level: str
) -> torch.Tensor:
    """``log w`` per token from the per-token ``log_ratio = log pi_prox - log pi_behav``.

    ``token``: ``log_ratio`` itself. ``sequence``: the sum of the sequence's response-token
    log-ratios (``w`` = the product of the token ratios, the exact importance weight of the
    whole response), on every token of the sequence. ``geometric``: their mean (``w`` = the
    geometric mean of the token ratios, which does not grow with the response length; verl's
    "geo" level, GSPO's sequence ratio).
    """
    if level not in BEHAVIOUR_WEIGHT_LEVELS:
        raise ValueError(
            f"unknown ppo.behav_imp_weight_level={level!r}; valid: "
            f"{', '.join(BEHAVIOUR_WEIGHT_LEVELS)}"
        )
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    if level == "token":
        return log_ratio
    shifted = shifted_cu_seqlens(cu_seqlens)
    per_sequence = segment_sum(log_ratio, shifted)  # [num_seqs]
    if level == "geometric":
        per_sequence = per_sequence / segment_sum(mask.to(log_ratio.dtype), shifted).clamp(min=1)
    return broadcast_to_tokens(per_sequence, cu_seqlens)


def behaviour_importance_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    level: str = "token",
    mode: str = "mask",
    cap: float = 5.0,
) -> BehaviourWeights:
    """The capped behaviour weight ``w = pi_prox / pi_behav`` of every response token.

    ``w`` comes from `behaviour_log_weights` at ``level``; above ``cap`` it is set to ``cap``
    (``mode="clamp"``, truncated IS) or to 0 (``mode="mask"``, the token, or with a sequence
    level the whole sequence, leaves the gradient; AReaL's ``behav_imp_weight_cap``). Masked
    tokens keep their place in the loss denominator (`realrl.algo.aggregation` computes it from
    the unmodified loss mask), as in AReaL, so masking does not scale up the other tokens.
    Both inputs are detached: ``w`` is a constant of the loss.

    Stats (masked means over response tokens, as in `realrl.algo.losses`):
    ``logp_abs_diff`` mean ``|log pi_prox - log pi_behav|`` per token (the mismatch, whatever
    the level), ``weight`` mean ``w`` as applied (0 where masked), ``capped_fraction`` tokens
    whose ``w`` exceeded the cap (clamped or masked), ``num_tokens``.
    """
    if mode not in BEHAVIOUR_WEIGHT_MODES:
        raise ValueError(
            f"unknown ppo.behav_imp_weight_mode={mode!r}; valid: "
            f"{', '.join(BEHAVIOUR_WEIGHT_MODES)}"
        )
    if not cap > 0:
        raise ValueError(f"ppo.behav_imp_weight_cap must be > 0, got {cap}")
    mask = loss_mask.bool()
    token_log_ratio = proximal_logprobs.detach().float() - behaviour_logprobs.detach().float()
    log_weights = behaviour_log_weights(token_log_ratio, mask, cu_seqlens, level)
    log_cap = math.log(cap)
    over_cap = (log_weights > log_cap) & mask
    weights = torch.exp(log_weights.clamp(max=log_cap))  # never overflows
    if mode == "mask":
        weights = torch.where(over_cap, torch.zeros_like(weights), weights)
    weights = weights * mask
    stats = {
        "logp_abs_diff": _masked_mean(token_log_ratio.abs(), mask),
        "weight": _masked_mean(weights, mask),
        "capped_fraction": _masked_mean(over_cap.float(), mask),
        "num_tokens": mask.sum().float(),
    }
    return BehaviourWeights(weights, stats)


def interpolated_proximal_logprobs(
    behaviour_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor,
    policy_lag: torch.Tensor,
) -> torch.Tensor:
    """AReaL's log-linear approximation of the proximal log-probs, without a forward pass.

    AReaL (``prox_logp_method=loglinear``, ``compute_prox_logp_approximations`` in
    ``areal/trainer/ppo/actor.py``; docs ``algorithms/prox_approx.md``) interpolates between the
    behaviour and the current log-probs by weight version: with ``v_behav`` the version that
    generated the token, ``v_theta`` the trainer's version and ``v_prox = v_theta - 1``,
    ``alpha = clamp((v_prox - v_behav) / (v_theta - v_behav), 0, 1)`` (0 where
    ``v_theta == v_behav``) and ``log pi_prox ~ log pi_behav + alpha * (log pi_theta -
    log pi_behav)``. Only the difference ``policy_lag = v_theta - v_behav`` (train steps
    between the generating weights and the trainer's, per token) enters:
    ``alpha = (lag - 1) / lag`` for ``lag >= 1``, 0 for ``lag = 0``. So a lag of 0 or 1 gives
    ``alpha = 0``, the behaviour log-probs themselves (the behaviour weight is then 1 and the
    objective is PPO against the behaviour policy); lag 2 gives 1/2, lag 8 gives 7/8.

    ``current_logprobs`` are detached; all three tensors are ``[total_tokens - num_seqs]``.
    """
    lag = policy_lag.to(torch.float32)
    alpha = torch.where(lag > 0, (lag - 1.0) / lag.clamp(min=1.0), torch.zeros_like(lag))
    alpha = alpha.clamp(0.0, 1.0)
    behaviour = behaviour_logprobs.detach().float()
    return behaviour + alpha * (current_logprobs.detach().float() - behaviour)
