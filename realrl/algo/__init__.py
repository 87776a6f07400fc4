"""The PPO family's math: pure torch on packed tensors, no I/O, no process-group creation.

Packed layout (full legend in `realrl.algo.layout`): ``packed_input_ids [total_tokens]`` with
``cu_seqlens [num_seqs + 1]``; per-token *training* quantities (log-probs, loss mask, token
rewards, advantages, returns, per-token losses) are **shifted**, ``[total_tokens - num_seqs]``,
entry ``j`` predicting token ``j + 1``; ``loss_mask[j]`` is True iff token ``j + 1`` is a response
token; critic values are ``[total_tokens]``. Every function takes the unshifted ``cu_seqlens``.
``process_group=None`` always means "no reduction", never the default world group.

Modules: `layout` (packing helpers, log-probs, entropy), `advantages` (estimator registry),
`losses` (policy, value, entropy), `offpolicy` (the decoupled objective's behaviour weight and
proximal log-probs, ``ppo.decoupled_loss``), `kl` (estimators, controllers), `aggregation`
(``ppo.loss_agg_mode``), `rewards` (reward shaping, DAPO filters), `value_norm`.
docs/algorithms.md lists the config keys that select each piece.
"""

from realrl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    AdvantageSettings,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from realrl.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_normaliser
from realrl.algo.group_stats import whiten
from realrl.algo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_token_rewards,
)
from realrl.algo.layout import (
    packed_entropy,
    packed_shifted_logprobs,
    response_mask,
    segment_mean,
    segment_sum,
    shifted_cu_seqlens,
    shifted_values,
)
from realrl.algo.losses import (
    LossOutput,
    cispo_policy_loss,
    entropy_bonus_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    value_loss,
)
from realrl.algo.offpolicy import (
    BehaviourWeights,
    behaviour_importance_weights,
    interpolated_proximal_logprobs,
)
from realrl.algo.rewards import (
    dynamic_sampling_filter,
    mask_no_eos_with_zero,
    mask_truncated_from_loss,
    overlong_reward_penalty,
    scale_rewards,
)
from realrl.algo.value_norm import ValueNormalizer

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AdvantageOutputs",
    "AdvantageSettings",
    "BehaviourWeights",
    "FixedKLController",
    "LossOutput",
    "ValueNormalizer",
    "aggregate_loss",
    "behaviour_importance_weights",
    "compute_advantages",
    "cispo_policy_loss",
    "dynamic_sampling_filter",
    "entropy_bonus_loss",
    "get_advantage_estimator",
    "gspo_policy_loss",
    "interpolated_proximal_logprobs",
    "kl_estimate",
    "kl_penalized_token_rewards",
    "loss_normaliser",
    "mask_no_eos_with_zero",
    "mask_truncated_from_loss",
    "overlong_reward_penalty",
    "packed_entropy",
    "packed_shifted_logprobs",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "response_mask",
    "scale_rewards",
    "segment_mean",
    "segment_sum",
    "shifted_cu_seqlens",
    "shifted_values",
    "value_loss",
    "whiten",
]
