"""Advantage estimators, picked by name with ``ppo.adv_estimator``.

Every estimator reads an `AdvantageInputs` and returns ``advantages`` and ``returns``, both
shifted per-token tensors ``[total_tokens - num_seqs]`` that are 0 outside the loss mask.

Token rewards are the common currency: build them with
`realrl.algo.kl.kl_penalized_token_rewards` (task reward at the last response token, minus
``kl_ctl * kl`` on every response token when the KL is used as a reward penalty). Estimators that
work on whole sequences (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, ReMax) use a sequence's
*score* = the sum of its token rewards, and broadcast the sequence advantage over its response
tokens. For critic-free estimators ``returns`` equals the unwhitened return/advantage.

Add an estimator with ``@register_advantage_estimator("name", ...)`` below; the CLI lists the
registered names when a user mistypes one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from realrl.algo.group_stats import (
    discounted_reverse_cumsum,
    group_mean_and_count,
    group_normalised_scores,
    leave_one_out_scores,
    whiten,
)
from realrl.algo.layout import (
    broadcast_to_tokens,
    last_true_index,
    prediction_rows,
    segment_sum,
    shifted_cu_seqlens,
)


@dataclass
class AdvantageInputs:
    """What the estimators read. Shapes use the packed notation of `realrl.algo.layout`."""

    token_rewards: torch.Tensor  # [total_tokens - num_seqs] float, 0 outside the loss mask
    loss_mask: torch.Tensor  # [total_tokens - num_seqs] bool, True where token j+1 is a response
    cu_seqlens: torch.Tensor  # [num_seqs + 1] unshifted boundaries
    values: torch.Tensor | None = None  # [total_tokens] critic values (GAE only)
    seq_no_eos: torch.Tensor | None = None  # [num_seqs] bool, True = truncated (GAE bootstrap)
    group_ids: torch.Tensor | None = None  # [num_seqs] int, equal for samples of one prompt
    baseline_rewards: torch.Tensor | None = None  # [num_seqs] greedy-rollout reward (ReMax)


@dataclass(frozen=True)
class AdvantageSettings:
    """The ``ppo.*`` keys the estimators read; defaults match docs/algorithms.md."""

    gamma: float = 1.0  # ppo.gamma
    lam: float = 1.0  # ppo.lam
    adv_norm: bool = True  # ppo.adv_norm: whiten over the batch (skipped if already whitened)
    group_std_eps: float = 1e-6  # ppo.group_std_eps: GRPO's (r - mean) / (std + eps)
    whiten_eps: float = 1e-5  # ppo.whiten_eps: (a - mean) / sqrt(var + eps)


@dataclass
class AdvantageOutputs:
    advantages: torch.Tensor  # [total_tokens - num_seqs] float32
    returns: torch.Tensor  # [total_tokens - num_seqs] float32


EstimatorFn = Callable[
    [AdvantageInputs, AdvantageSettings, "dist.ProcessGroup | None"], AdvantageOutputs
]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    function: EstimatorFn
    needs_critic: bool  # reads `values` (the experiment must run critic_inf)
    needs_groups: bool  # reads `group_ids` (several samples per prompt)
    whitens: bool  # already whitens globally, so `adv_norm` is not applied again
    recommended_loss_agg_mode: str


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str,
    *,
    needs_critic: bool = False,
    needs_groups: bool = False,
    whitens: bool = False,
    recommended_loss_agg_mode: str = "token-mean",
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Register ``function(inputs, settings, process_group) -> AdvantageOutputs`` as ``name``."""

    def decorator(function: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name].function is not function:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            name, function, needs_critic, needs_groups, whitens, recommended_loss_agg_mode
        )
        return function

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; a miss names the valid choices."""
    if name not in ADVANTAGE_ESTIMATORS:
        close = difflib.get_close_matches(name, list(ADVANTAGE_ESTIMATORS), n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown ppo.adv_estimator={name!r}.{hint} "
            f"Valid: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}."
        )
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(
    name: str,
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """Run estimator ``name`` then, if ``settings.adv_norm``, whiten over the batch.

    ``process_group`` (data-parallel group, None = this process only) makes the whitening
    statistics global. Estimators that whiten by definition (REINFORCE++ variants) are not
    whitened twice.
    """
    estimator = get_advantage_estimator(name)
    _check_inputs(estimator, inputs)
    outputs = estimator.function(inputs, settings, process_group)
    if settings.adv_norm and not estimator.whitens:
        outputs.advantages = whiten(
            outputs.advantages, inputs.loss_mask, process_group, settings.whiten_eps
        )
    return outputs


def _check_inputs(estimator: AdvantageEstimator, inputs: AdvantageInputs) -> None:
    missing = []
    if estimator.needs_critic and inputs.values is None:
        missing.append("values (critic values; run critic_inf)")
    if estimator.needs_groups and inputs.group_ids is None:
        missing.append("group_ids (samples of one prompt share an id)")
    if estimator.name == "remax" and inputs.baseline_rewards is None:
        missing.append("baseline_rewards (reward of the greedy rollout)")
    if missing:
        raise ValueError(f"ppo.adv_estimator={estimator.name} needs {'; '.join(missing)}")


def _required(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None, "checked by _check_inputs"
    return tensor


def _sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """Sum of each sequence's token rewards ``[num_seqs]``."""
    masked = inputs.token_rewards.detach().float() * inputs.loss_mask
    return segment_sum(masked, shifted_cu_seqlens(inputs.cu_seqlens))


def _broadcast(per_sequence: torch.Tensor, inputs: AdvantageInputs) -> AdvantageOutputs:
    tokens = broadcast_to_tokens(per_sequence.float(), inputs.cu_seqlens) * inputs.loss_mask
    return AdvantageOutputs(advantages=tokens, returns=tokens.clone())


@register_advantage_estimator("gae", needs_critic=True)
def gae(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """Generalised Advantage Estimation, Schulman et al. 2016, eqs. (11)-(16).

    ``delta_j = r_j + gamma * V(s_{j+1}) - V(s_j)`` and ``A_j = sum_l (gamma lam)^l delta_{j+l}``;
    returns ``R_j = A_j + V(s_j)`` (the critic's targets). ``V(s_j)`` is ``values`` at token j.
    After a sequence's last token the next value is 0 if it ended with EOS (terminal), and the
    critic's value of the full sequence if it was truncated (``seq_no_eos`` True): bootstrap.
    """
    cu_seqlens = inputs.cu_seqlens
    shifted = shifted_cu_seqlens(cu_seqlens)
    values = _required(inputs.values).detach().float()
    rows = prediction_rows(cu_seqlens)  # [total_tokens - num_seqs] packed index of state j
    current_values, next_values = values[rows], values[rows + 1]
    num_seqs = cu_seqlens.numel() - 1
    no_eos = inputs.seq_no_eos
    if no_eos is None:
        no_eos = torch.zeros(num_seqs, dtype=torch.bool, device=values.device)
    last_entry = shifted[1:] - 1  # [num_seqs] last shifted entry of each sequence
    terminal = (~no_eos.bool()) & (shifted[1:] > shifted[:-1])
    next_nonterminal = torch.ones_like(current_values)
    next_nonterminal[last_entry[terminal].long()] = 0.0
    rewards = inputs.token_rewards.detach().float()
    deltas = rewards + settings.gamma * next_values * next_nonterminal - current_values
    advantages = discounted_reverse_cumsum(deltas, shifted, settings.gamma * settings.lam)
    mask = inputs.loss_mask.float()
    return AdvantageOutputs(advantages * mask, (advantages + current_values) * mask)


@register_advantage_estimator("grpo", needs_groups=True)
def grpo(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """GRPO outcome supervision, Shao et al. 2024 (DeepSeekMath), section 4.1.2.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the *unbiased* std (n - 1) and
    ``eps = settings.group_std_eps``; single-sample and all-equal groups get advantage 0.
    """
    scores = _sequence_scores(inputs)
    normalised = group_normalised_scores(
        scores, _required(inputs.group_ids), divide_by_std=True, std_eps=settings.group_std_eps
    )
    return _broadcast(normalised, inputs)


@register_advantage_estimator(
    "dr_grpo", needs_groups=True, recommended_loss_agg_mode="seq-mean-token-sum-norm"
)
def dr_grpo(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """Dr. GRPO, Liu et al. 2025 ("Understanding R1-Zero-Like Training"), eq. (3).

    ``A_i = r_i - mean(r_group)``: no division by the group std (which up-weights easy and hard
    prompts). The paper also drops the 1/|o_i| length normalisation: pair it with
    ``ppo.loss_agg_mode=seq-mean-token-sum-norm``.
    """
    scores = _sequence_scores(inputs)
    centred = group_normalised_scores(
        scores, _required(inputs.group_ids), divide_by_std=False, std_eps=0.0
    )
    return _broadcast(centred, inputs)


@register_advantage_estimator("rloo", needs_groups=True)
def rloo(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """REINFORCE Leave-One-Out, Ahmadian et al. 2024 ("Back to Basics"), eq. (5) / Kool 2019.

    ``A_i = r_i - 1/(k-1) sum_{j != i} r_j``; a single-sample group gets 0.
    """
    scores = _sequence_scores(inputs)
    return _broadcast(leave_one_out_scores(scores, _required(inputs.group_ids)), inputs)


@register_advantage_estimator("reinforce_plus_plus", whitens=True)
def reinforce_plus_plus(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """REINFORCE++, Hu 2025 (arXiv:2501.03262), section 3.

    Token returns ``G_t = sum_{s >= t} gamma^(s-t) r_s`` of the KL-penalised token rewards, then
    ``A = (G - mean) / sqrt(var + eps)`` whitened over the global batch (all data-parallel ranks
    when ``process_group`` is given). ``returns`` holds the unwhitened ``G``.
    """
    shifted = shifted_cu_seqlens(inputs.cu_seqlens)
    rewards = inputs.token_rewards.detach().float() * inputs.loss_mask
    returns = discounted_reverse_cumsum(rewards, shifted, settings.gamma) * inputs.loss_mask
    advantages = whiten(returns, inputs.loss_mask, process_group, settings.whiten_eps)
    return AdvantageOutputs(advantages, returns)


@register_advantage_estimator("reinforce_plus_plus_baseline", needs_groups=True, whitens=True)
def reinforce_plus_plus_baseline(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """REINFORCE++-baseline, Hu 2025 (arXiv:2501.03262 v3+), group mean as baseline.

    The group mean of the sequence scores is subtracted at each sequence's last response token,
    discounted returns are taken as in REINFORCE++, then whitened globally. With ``gamma=1``
    token ``t``'s return is ``sum_{s >= t} r_s - mean(score_group)``: the rewards still to come,
    not the whole score. It is ``score_i - mean(score_group)`` at the first response token, and
    at every token only when the token rewards carry no per-token KL penalty (``kl_ctl=0`` or
    ``use_kl_loss``). E.g. token rewards [-0.5, 0, 1] and [-0.2, 0, 0] in one group: scores 0.5
    and -0.2, mean 0.15, the first sequence's returns [0.35, 0.85, 0.85].
    """
    shifted = shifted_cu_seqlens(inputs.cu_seqlens)
    group_means, _ = group_mean_and_count(_sequence_scores(inputs), _required(inputs.group_ids))
    rewards = inputs.token_rewards.detach().float() * inputs.loss_mask
    last = last_true_index(inputs.loss_mask, shifted)  # [num_seqs], -1 if no response
    has_response = last >= 0
    rewards = rewards.index_add(0, last[has_response], -group_means.float()[has_response])
    returns = discounted_reverse_cumsum(rewards, shifted, settings.gamma) * inputs.loss_mask
    advantages = whiten(returns, inputs.loss_mask, process_group, settings.whiten_eps)
    return AdvantageOutputs(advantages, returns)


@register_advantage_estimator("remax")
def remax(
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    process_group: dist.ProcessGroup | None = None,
) -> AdvantageOutputs:
    """ReMax, Li et al. 2024, Algorithm 1: ``A_i = r(x, y_i) - r(x, y_greedy)``.

    ``baseline_rewards [num_seqs]`` is the task reward of the greedy response to the same prompt,
    processed exactly like the sampled rewards (scaling, clipping, ...).
    """
    scores = _sequence_scores(inputs)
    baseline = _required(inputs.baseline_rewards).detach().float()
    return _broadcast(scores - baseline, inputs)
