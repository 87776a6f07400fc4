"""Per-token PPO-family losses on shifted packed tensors ``[total_tokens - num_seqs]``.

The functions here return *per-token* losses plus statistics; turn them into the scalar to
back-propagate with `realrl.algo.aggregation` (``ppo.loss_agg_mode``), whose normaliser spans the
whole mini-batch across micro-batches and data-parallel ranks.

A typical actor micro-batch::

    policy = ppo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, eps_clip=0.2)
    per_token = policy.per_token_loss
    if entropy_coef: per_token = per_token - entropy_coef * entropy          # bonus
    if use_kl_loss:  per_token = per_token + kl_ctl * kl_estimate(logprobs, ref_logprobs, "k3")
    loss = aggregate_loss(per_token, loss_mask, cu_seqlens, mode, normaliser)

The decoupled objective (``ppo.decoupled_loss``) passes the proximal log-probs as
``old_logprobs`` and the capped behaviour weights of `realrl.algo.offpolicy`.

Statistics are detached scalar tensors (no host sync): masked means over this micro-batch's
response tokens, plus ``num_tokens`` so a caller can combine micro-batches by weighting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from realrl.algo.layout import segment_ids, segment_mean, shifted_cu_seqlens

# GSPO's cap on a sequence's log-ratio before the exponential (as verl's implementation): a
# sequence whose mean token log-ratio exceeds it is e^10 off-policy, and its gradient stops.
GSPO_MAX_LOG_RATIO = 10.0


@dataclass
class LossOutput:
    per_token_loss: torch.Tensor  # [total_tokens - num_seqs], 0 outside the loss mask
    stats: dict[str, torch.Tensor]  # detached scalars


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask_f = mask.to(values.dtype)
    return (values * mask_f).sum() / mask_f.sum().clamp(min=1)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_early_stop: float | None = None,
    behaviour_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped surrogate, Schulman et al. 2017 (PPO), eq. (7), as a loss to minimise.

    ``ratio = exp(logprobs - old_logprobs)``;
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))``.

    - ``eps_clip_high`` (DAPO "clip-higher", Yu et al. 2025, eq. (10)): a separate upper bound,
      default ``eps_clip``; a larger value lets low-probability tokens grow (less entropy collapse).
    - ``dual_clip = c > 1`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. (5)):
      for ``A < 0`` the loss is further bounded by ``-c * A``, so a huge ratio on a bad action
      cannot produce an unbounded update. Positive advantages are untouched.
    - ``ratio_early_stop = b``: if the masked mean ratio of this micro-batch leaves
      ``[1 - b, 1 + b]`` the policy has drifted too far from the behaviour policy; the whole
      micro-batch's loss is multiplied by 0 (the graph is kept so backward and gradient
      all-reduce still run on every rank), and ``stats["early_stopped"]`` is 1.
    - ``behaviour_weights [total_tokens - num_seqs]`` (the decoupled objective, AReaL, Fu et al.
      2025, arXiv:2505.24298): ``old_logprobs`` are then the *proximal* policy's and each
      token's loss is multiplied by its capped ``pi_prox / pi_behav`` (`realrl.algo.offpolicy`).
      None: weight 1.

    Stats: ``clip_fraction`` (tokens where the clipped branch is active), ``dual_clip_fraction``,
    ``approx_kl`` (k3 estimate of KL(old || new), Schulman 2020), ``ratio_mean``,
    ``early_stopped``, ``num_tokens``.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"ppo.dual_clip must be > 1 (it bounds -A * ratio), got {dual_clip}")
    mask = loss_mask.bool()
    log_ratio = (logprobs.float() - old_logprobs.detach().float()) * mask
    ratio = torch.exp(log_ratio)  # [total_tokens - num_seqs], 1 outside the mask
    advantages = advantages.detach().float()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        bound = -dual_clip * advantages  # positive where A < 0
        dual_active = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
    if behaviour_weights is not None:
        loss = loss * behaviour_weights.detach().float()
    loss = loss * mask

    ratio_mean = _masked_mean(ratio.detach(), mask)
    early_stopped = torch.zeros((), device=loss.device)
    if ratio_early_stop is not None:
        early_stopped = ((ratio_mean - 1.0).abs() > ratio_early_stop).float()
        loss = loss * (1.0 - early_stopped)
    stats = _policy_stats(clip_active, log_ratio, ratio, mask, dual_active, early_stopped)
    return LossOutput(loss, stats)


def _policy_stats(clipped: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor,
                  mask: torch.Tensor, dual_clipped: torch.Tensor | None = None,
                  early_stopped: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The statistics every policy loss reports (see `ppo_policy_loss`): ``clipped`` and
    ``dual_clipped`` mark tokens, ``ratio`` is what the loss weighs each token by."""
    zero = torch.zeros((), device=ratio.device)
    log_ratio = log_ratio.detach()
    return {
        "clip_fraction": _masked_mean(clipped.float(), mask),
        "dual_clip_fraction": zero if dual_clipped is None else _masked_mean(
            dual_clipped.float(), mask),
        "approx_kl": _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),  # k3, r = new/old
        "ratio_mean": _masked_mean(ratio.detach(), mask),
        "early_stopped": zero if early_stopped is None else early_stopped,
        "num_tokens": mask.sum().float(),
    }


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eps_clip: float = 3e-4,
    eps_clip_high: float | None = 4e-4,
    behaviour_weights: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO, Zheng et al. 2025 (arXiv:2507.18071), in its GSPO-token form, eqs. (5)-(7) and
    (13)-(14): the clipped surrogate of the *sequence's* ratio, as a per-token loss.

    Sequence ``i``'s ratio is the geometric mean of its tokens' ratios,
    ``s_i = exp(mean_t (log pi(y_it) - log pi_old(y_it)))`` over its response tokens, and
    token ``t`` carries ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``: equal to ``s_i`` in value,
    with the gradient of ``log pi(y_it)``. With one advantage per sequence (GRPO's), the
    per-token loss ``max(-A s_it, -A clip(s_it, 1 - eps_clip, 1 + eps_clip_high))`` averaged
    per sequence (``ppo.loss_agg_mode=seq-mean-token-mean``) is GSPO's sequence objective and
    its gradient. A sequence is clipped whole; the paper's ranges are 3e-4 and 4e-4 (a
    sequence's mean ratio spreads far less than a token's).

    ``cu_seqlens [num_seqs + 1]``: the packed sequences' boundaries (the tensors here are
    shifted). ``behaviour_weights`` as in `ppo_policy_loss` (the decoupled objective). Stats as
    `ppo_policy_loss`'s, per token: ``clip_fraction`` counts the tokens of clipped sequences,
    ``ratio_mean`` averages ``s_i`` over tokens; ``dual_clip_fraction`` and ``early_stopped`` are
    0 (neither applies).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    mask = loss_mask.bool()
    shifted = shifted_cu_seqlens(cu_seqlens)
    log_ratio = (logprobs.float() - old_logprobs.detach().float()) * mask
    sequence_log_ratio = segment_mean(log_ratio.detach(), mask, shifted)  # [num_seqs]
    per_token_log_ratio = sequence_log_ratio[segment_ids(shifted)]  # [total_tokens - num_seqs]
    log_s = logprobs.float() - logprobs.detach().float() + per_token_log_ratio
    ratio = torch.exp(log_s.clamp(max=GSPO_MAX_LOG_RATIO))
    advantages = advantages.detach().float()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    if behaviour_weights is not None:
        loss = loss * behaviour_weights.detach().float()
    loss = loss * mask
    return LossOutput(loss, _policy_stats(clipped > unclipped, log_ratio, ratio, mask))


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behaviour_weights: torch.Tensor | None = None,
) -> LossOutput:
    """CISPO, MiniMax 2025 (MiniMax-M1, arXiv:2506.13585, eq. (4)): clip the importance weight,
    not the update. Each token's gradient is ``sg[clip(ratio, 1 - eps_clip, 1 + eps_clip_high)]
    * A * grad log pi``: a token past the band still learns, with its weight truncated, where
    PPO's clipped branch would drop its gradient.

    The per-token loss is ``-sg[w] * A * exp(log pi - sg[log pi])``: ``-w * A`` in value (the
    surrogate's, comparable with `ppo_policy_loss`'s) and that gradient. Stats as
    `ppo_policy_loss`'s; ``clip_fraction`` counts the tokens whose weight was truncated.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    mask = loss_mask.bool()
    log_ratio = (logprobs.float() - old_logprobs.detach().float()) * mask
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    advantages = advantages.detach().float()
    loss = -weight * advantages * torch.exp(logprobs.float() - logprobs.detach().float())
    if behaviour_weights is not None:
        loss = loss * behaviour_weights.detach().float()
    loss = loss * mask
    return LossOutput(loss, _policy_stats(weight != ratio, log_ratio, ratio, mask))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    value_eps_clip: float | None = 0.2,
) -> LossOutput:
    """Clipped value loss, the PPO2 reference implementation (Engstrom et al. 2020, sec. 3).

    ``values``/``old_values`` are the critic outputs at the *states* of the shifted positions,
    ``[total_tokens - num_seqs]`` (use `realrl.algo.layout.shifted_values` on per-token values).
    ``v_clip = old + clip(values - old, -eps, eps)`` and
    ``loss = 0.5 * max((values - R)^2, (v_clip - R)^2)``; the 0.5 makes the gradient
    ``values - R`` (it is the squared error's natural constant, so ``ppo.value_coef``-style
    weights stay comparable with other libraries). ``value_eps_clip=None`` disables clipping.
    With value normalisation, pass normalised ``returns`` and normalised old values.
    """
    mask = loss_mask.bool()
    values = values.float()
    returns = returns.detach().float()
    unclipped_error = (values - returns) ** 2
    if value_eps_clip is None:
        loss = 0.5 * unclipped_error
        clip_active = torch.zeros_like(mask)
    else:
        old_values = old_values.detach().float()
        clipped_values = old_values + (values - old_values).clamp(-value_eps_clip, value_eps_clip)
        clipped_error = (clipped_values - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
        clip_active = clipped_error > unclipped_error
    loss = loss * mask
    stats = {
        "value_clip_fraction": _masked_mean(clip_active.float(), mask),
        "value_mean": _masked_mean(values.detach(), mask),
        "returns_mean": _masked_mean(returns, mask),
        "num_tokens": mask.sum().float(),
    }
    return LossOutput(loss, stats)


def entropy_bonus_loss(entropy: torch.Tensor, loss_mask: torch.Tensor, entropy_coef: float):
    """Per-token ``-entropy_coef * H`` (Mnih et al. 2016 / PPO eq. (9) ``c2 S``) to add to a loss.

    ``entropy [total_tokens - num_seqs]`` comes from `realrl.algo.layout.packed_entropy`. With
    ``ppo.entropy_coef=0`` the entropy is only logged; this returns zeros (no gradient path).
    """
    if entropy_coef == 0.0:
        return torch.zeros_like(entropy)
    return -entropy_coef * entropy * loss_mask
