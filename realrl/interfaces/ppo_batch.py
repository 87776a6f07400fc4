"""PPO rollout preparation, shared by the actor and the critic: shaped rewards, KL, advantages.

`prepare_ppo_batch` turns a step's rollouts (``packed_input_ids``, ``prompt_mask``,
``packed_logprobs``, ``seq_no_eos_mask``, ``rewards`` and, when present, ``ref_logprobs`` and
``values``) into the shifted training tensors both PPO interfaces train on; `PPOTrainingState`
is what they keep between steps. Notation as in `realrl.interfaces.common`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.algo.advantages import AdvantageInputs, AdvantageSettings, compute_advantages
from realrl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_token_rewards,
)
from realrl.algo.layout import segment_sum
from realrl.algo.rewards import (
    mask_no_eos_with_zero,
    mask_truncated_from_loss,
    overlong_reward_penalty,
    scale_rewards,
)
from realrl.algo.value_norm import ValueNormalizer
from realrl.api.data import SequenceSample
from realrl.api.rl_config import PPOHyperparameters
from realrl.interfaces.common import (
    DistributedMeans,
    loss_mask_from_prompt_mask,
    require_keys,
    shifted_seqlens,
)


class PPOTrainingState:
    """What a PPO interface keeps between steps: the KL coefficient and the value normaliser.

    The actor and the critic each hold one and update it from the same data in the same way
    (ReaLHF's arrangement), so both use the same KL coefficient for the token rewards and the
    same statistics to denormalise the critic's values before GAE.
    """

    def __init__(self, ppo: PPOHyperparameters, max_new_tokens: int | None) -> None:
        self.ppo = ppo
        self.max_new_tokens = max_new_tokens
        if ppo.adaptive_kl_target is not None:
            self.kl_controller = AdaptiveKLController(
                ppo.kl_ctl, ppo.adaptive_kl_target, ppo.adaptive_kl_horizon
            )
        else:
            self.kl_controller = FixedKLController(ppo.kl_ctl)
        self.value_normalizer: ValueNormalizer | None = None

    @property
    def kl_coef(self) -> float:
        return self.kl_controller.value

    def normalizer(self, process_group: dist.ProcessGroup | None) -> ValueNormalizer | None:
        """The running value statistics (created on first use, global over the dp group)."""
        if self.ppo.value_norm and self.value_normalizer is None:
            self.value_normalizer = ValueNormalizer(
                mode=_enum_value(self.ppo.value_norm_type),
                beta=self.ppo.value_norm_beta,
                process_group=process_group,
            )
        return self.value_normalizer

    def update_kl_controller(self, stats: dict[str, float]) -> dict[str, float]:
        """Adapt the KL coefficient to this step's KL; returns the coefficient used."""
        used = self.kl_coef
        if "kl_to_ref_per_sequence" in stats:
            self.kl_controller.update(
                stats["kl_to_ref_per_sequence"], int(stats.get("num_sequences", 0))
            )
        return {"kl_coef": used}

    def state_dict(self) -> dict:
        state = {"kl_controller": self.kl_controller.state_dict()}
        if self.value_normalizer is not None:
            state["value_normalizer"] = self.value_normalizer.state_dict()
        return state


def _enum_value(value) -> str:
    return getattr(value, "value", value)


ROLLOUT_KEYS = ("packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask", "rewards")


def shaped_rewards(
    ppo: PPOHyperparameters,
    raw_rewards: torch.Tensor,  # [num_seqs]
    response_lens: torch.Tensor,  # [num_seqs]
    seq_no_eos: torch.Tensor,  # [num_seqs] bool
    max_new_tokens: int | None,
) -> torch.Tensor:
    """Task rewards after the shaping steps of `realrl.algo.rewards`, in its documented order."""
    rewards = raw_rewards.float()
    if ppo.overlong_buffer_len > 0:
        if max_new_tokens is None:
            raise ValueError(
                "ppo.overlong_buffer_len > 0 needs the generation's max_new_tokens, which this "
                "interface's config does not carry; set ppo.overlong_buffer_len=0"
            )
        rewards = rewards + overlong_reward_penalty(
            response_lens, max_new_tokens, ppo.overlong_buffer_len, ppo.overlong_penalty_factor
        )
    if ppo.mask_no_eos_with_zero:
        rewards = mask_no_eos_with_zero(rewards, seq_no_eos)
    return scale_rewards(rewards, ppo.reward_scaling, ppo.reward_bias, ppo.reward_clip)


def _baseline_rewards(ppo: PPOHyperparameters, data: SequenceSample,
                      group_sizes: torch.Tensor) -> torch.Tensor | None:
    """ReMax's greedy-rollout rewards (`baseline_rewards`, one per prompt) for every sequence
    of the prompt, scaled like the task rewards; None when the batch carries none."""
    if "baseline_rewards" not in data.keys:
        return None
    baseline = data.data["baseline_rewards"].float().cpu().reshape(-1)  # [num_prompts]
    baseline = scale_rewards(baseline, ppo.reward_scaling, ppo.reward_bias, ppo.reward_clip)
    return torch.repeat_interleave(baseline, group_sizes)  # [num_seqs]


def prepare_ppo_batch(
    state: PPOTrainingState,
    data: SequenceSample,
    process_group: dist.ProcessGroup | None,
) -> tuple[SequenceSample, DistributedMeans]:
    """Rewards -> token rewards -> advantages and returns for this rank's rollouts.

    Returns a sample with ``packed_input_ids`` and the shifted ``loss_mask``,
    ``old_logprobs`` (the generation's), ``advantages``, ``returns`` (plus ``ref_logprobs``,
    ``policy_lag`` (`policy_lag`), and per-token ``values`` when given), and the
    rollout statistics to reduce with the training ones.
    Whitening and value-normaliser statistics are global over ``process_group``.
    """
    ppo = state.ppo
    require_keys(data, ROLLOUT_KEYS, "PPO train_step")
    seqlens = data.seqlens["packed_input_ids"]
    cu_seqlens = data.cu_seqlens("packed_input_ids").cpu()  # [num_seqs + 1]
    num_seqs = cu_seqlens.numel() - 1
    raw_rewards = data.data["rewards"].float().cpu().reshape(-1)  # [num_seqs]
    if raw_rewards.numel() != num_seqs:
        raise ValueError(
            f"PPO train_step: `rewards` has {raw_rewards.numel()} values for {num_seqs} sequences; "
            "the reward MFC must output one reward per sequence"
        )
    prompt_mask = data.data["prompt_mask"].cpu().bool()  # [total_tokens]
    seq_no_eos = data.data["seq_no_eos_mask"].cpu().bool().reshape(-1)  # [num_seqs]
    loss_mask = loss_mask_from_prompt_mask(prompt_mask, cu_seqlens)  # [total_tokens - num_seqs]
    response_lens = segment_sum((~prompt_mask).long(), cu_seqlens)  # [num_seqs]
    rewards = shaped_rewards(ppo, raw_rewards, response_lens, seq_no_eos, state.max_new_tokens)
    if ppo.mask_too_long:
        loss_mask = mask_truncated_from_loss(loss_mask, seq_no_eos, cu_seqlens)
    old_logprobs = data.data["packed_logprobs"].float().cpu()  # [total_tokens - num_seqs]
    ref_logprobs = None
    kl = torch.zeros_like(old_logprobs)
    if "packed_ref_logprobs" in data.keys:
        ref_logprobs = data.data["packed_ref_logprobs"].float().cpu()
        estimator = _enum_value(ppo.kl_estimator)
        kl = kl_estimate(old_logprobs, ref_logprobs, estimator, ppo.kl_clamp) * loss_mask
    penalty = None if (ppo.use_kl_loss or ref_logprobs is None) else kl
    token_rewards = kl_penalized_token_rewards(
        rewards, penalty, state.kl_coef, loss_mask, cu_seqlens
    )
    values = None if "values" not in data.keys else data.data["values"].float().cpu()
    group_sizes = torch.tensor([len(sample) for sample in seqlens])
    advantages, returns = _advantages_and_returns(
        state,
        AdvantageInputs(
            token_rewards=token_rewards,
            loss_mask=loss_mask,
            cu_seqlens=cu_seqlens,
            values=values,
            seq_no_eos=seq_no_eos,
            group_ids=torch.repeat_interleave(torch.arange(data.bs), group_sizes),
            baseline_rewards=_baseline_rewards(ppo, data, group_sizes),
        ),
        process_group,
    )
    tensors = {
        "packed_input_ids": data.data["packed_input_ids"].cpu(),
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "returns": returns,
        "ref_logprobs": ref_logprobs,
        "values": values,
        # Train steps since each token's generating weights (the decoupled loss's
        # `ppo.prox_logp=interpolate` reads it).
        "policy_lag": policy_lag(data),
    }
    prepared = _training_sample(data.ids, seqlens, tensors)
    means = _rollout_means(
        raw_rewards,
        rewards,
        response_lens,
        seq_no_eos,
        loss_mask,
        advantages,
        kl,
        ref_logprobs is not None,
    )
    return prepared, means


def _advantages_and_returns(
    state: PPOTrainingState, inputs: AdvantageInputs, process_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and critic targets (normalised when ``ppo.value_norm``), both shifted.

    ``inputs.values`` are the critic's outputs; with value normalisation they are
    denormalised for the estimator, and the running statistics then absorb the new returns.
    """
    ppo = state.ppo
    normalizer = state.normalizer(process_group)
    if normalizer is not None and inputs.values is not None:
        inputs.values = normalizer.denormalize(inputs.values)
    settings = AdvantageSettings(
        gamma=ppo.gamma,
        lam=ppo.lam,
        adv_norm=ppo.adv_norm,
        group_std_eps=ppo.group_std_eps,
        whiten_eps=ppo.whiten_eps,
    )
    outputs = compute_advantages(ppo.adv_estimator, inputs, settings, process_group)
    returns = outputs.returns
    if normalizer is not None:
        normalizer.update(returns, inputs.loss_mask)
        returns = normalizer.normalize(returns)
    return outputs.advantages.float(), returns.float()


def policy_lag(data: SequenceSample) -> torch.Tensor | None:
    """``[total_tokens - num_seqs]`` long: train steps between the weights that chose each
    response token and the trainer's, 0 where the next token is a prompt token; None unless the
    rollout records each token's version (``packed_weight_versions``, -1 on prompt tokens) and
    the batch the trainer's (``trainer_version`` metadata): an asynchronous rollout
    (`realrl.workers.async_rollout`) gives both."""
    if "packed_weight_versions" not in data.keys or "trainer_version" not in data.metadata:
        return None
    versions = data.data["packed_weight_versions"].cpu().long()
    tokens_per_sample = [sum(lengths) for lengths in data.seqlens["packed_weight_versions"]]
    trainer = torch.repeat_interleave(torch.tensor(data.metadata["trainer_version"]),
                                      torch.tensor(tokens_per_sample))
    return torch.where(versions >= 0, trainer - versions, torch.zeros_like(versions))


def _training_sample(ids, seqlens: list[list[int]], tensors: dict) -> SequenceSample:
    """Pack the train-step tensors (None entries skipped): ``packed_input_ids`` and ``values``
    per token, everything else shifted."""
    shifted = shifted_seqlens(seqlens)
    per_token = ("packed_input_ids", "values")
    present = {key: tensor for key, tensor in tensors.items() if tensor is not None}
    layout = {key: seqlens if key in per_token else shifted for key in present}
    return SequenceSample.from_tensors(ids=ids, seqlens=layout, data=present)


def _rollout_means(
    raw_rewards,
    rewards,
    response_lens,
    seq_no_eos,
    loss_mask,
    advantages,
    kl,
    has_ref: bool,
) -> DistributedMeans:
    """Rollout statistics as sums and counts (see `DistributedMeans`)."""
    num_seqs = float(raw_rewards.numel())
    mask = loss_mask.float()
    num_tokens = mask.sum()
    means = DistributedMeans()
    means.add("task_reward", raw_rewards.sum(), num_seqs)
    means.add("shaped_reward", rewards.sum(), num_seqs)
    means.add("response_length", response_lens.float().sum(), num_seqs)
    means.add("no_eos_fraction", seq_no_eos.float().sum(), num_seqs)
    means.add("advantage", (advantages * mask).sum(), num_tokens)
    means.add_global_total("num_sequences", num_seqs)
    if has_ref:
        means.add("kl_to_ref", (kl * mask).sum(), num_tokens)
        means.add("kl_to_ref_per_sequence", (kl * mask).sum(), num_seqs)
    return means
