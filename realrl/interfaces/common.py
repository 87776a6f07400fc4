"""Helpers shared by the interfaces: micro-batched forwards, masks, mini-batches, statistics.

Notation follows `realrl.api.data` and `realrl.algo.layout`: ``packed_input_ids
[total_tokens]``, ``cu_seqlens [num_seqs + 1]``, *shifted* tensors ``[total_tokens - num_seqs]``
(entry ``j`` of a sequence predicts token ``j + 1``).

Training statistics follow one rule: a loss function returns *sums* (and the counts they are
sums over); `DistributedMeans` all-reduces every sum and count in one call at the end of the
step, so every data-parallel rank reports the same global means without a sync per
micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from realrl.algo.advantages import AdvantageInputs, AdvantageSettings, compute_advantages
from realrl.algo.distributed_stats import all_reduce_sum
from realrl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_token_rewards,
)
from realrl.algo.layout import packed_shifted_logprobs, prediction_rows, segment_sum
from realrl.algo.rewards import (
    mask_no_eos_with_zero,
    mask_truncated_from_loss,
    overlong_reward_penalty,
    scale_rewards,
)
from realrl.algo.value_norm import ValueNormalizer
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters
from realrl.models.sampling import GenerationConfig as SamplingConfig

logger = logging.getLogger(__name__)


def unsupported_call(interface_name: str, method: str, supported: str) -> NotImplementedError:
    """The error an interface raises for an MFC kind it does not implement."""
    return NotImplementedError(
        f"interface {interface_name!r} has no {method}(); it supports {supported}. Check the MFC "
        f"that names interface={interface_name!r} in the experiment graph: its kind must be one "
        "of those."
    )


def require_engine(engine, interface_name: str, method: str):
    """Fail with a readable message when a model-backed MFC is handed no model."""
    if engine is None or getattr(engine, "module", None) is None:
        raise ValueError(
            f"interface {interface_name!r}.{method}() needs a model engine but got none; the MFC "
            "must run on a model role with weights (not a rule-based role)"
        )
    return engine


def require_keys(data: SequenceSample, keys: tuple[str, ...], where: str) -> None:
    missing = [key for key in keys if key not in data.keys]
    if missing:
        raise KeyError(
            f"{where}: input lacks key(s) {missing}; it has {sorted(data.keys)}. Add them to the "
            "MFC's input_keys (or remap the producing MFC's output keys)"
        )


def shifted_seqlens(seqlens: list[list[int]]) -> list[list[int]]:
    """Per-sample lengths of shifted quantities: each sequence of length L owns L - 1 entries."""
    return [[max(length - 1, 0) for length in sample] for sample in seqlens]


def one_per_sequence(seqlens: list[list[int]]) -> list[list[int]]:
    """Per-sample lengths of a key holding one scalar per sequence."""
    return [[1] * len(sample) for sample in seqlens]


def loss_mask_from_prompt_mask(prompt_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Shifted loss mask ``[total_tokens - num_seqs]``: True where token ``j + 1`` is a response
    token, from the per-token ``prompt_mask [total_tokens]`` (True on prompt tokens)."""
    return ~prompt_mask.bool()[prediction_rows(cu_seqlens) + 1]


def sampling_config(hyperparameters: GenerationHyperparameters, n: int, engine) -> SamplingConfig:
    """The generation engine's settings for ``n`` samples per prompt.

    EOS comes from the model config; a model config without one falls back to the
    tokenizer's EOS, so a response can always end.
    """
    eos_token_id = None
    if not engine.module.config.eos_token_ids and engine.tokenizer is not None:
        eos_token_id = engine.tokenizer.eos_token_id
    return SamplingConfig(
        n=n,
        max_new_tokens=hyperparameters.max_new_tokens,
        min_new_tokens=hyperparameters.min_new_tokens,
        greedy=hyperparameters.greedy,
        temperature=hyperparameters.temperature,
        top_k=hyperparameters.top_k,
        top_p=hyperparameters.top_p,
        stop_token_ids=list(hyperparameters.stop_token_ids),
        eos_token_id=eos_token_id,
        compile=hyperparameters.compile,
    )


def map_microbatches(
    data: SequenceSample,
    microbatch: MicroBatchSpec,
    compute: Callable[[SequenceSample], SequenceSample],
) -> SequenceSample:
    """Run ``compute`` on each micro-batch (token budget from ``microbatch``) and put the
    results back in the order of ``data``. ``compute`` returns the new keys for exactly the
    samples it was given, same ids, same order."""
    microbatches, _, backward_indices = data.split_microbatches(
        microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
    )
    outputs = [compute(part) for part in microbatches]
    return SequenceSample.gather(outputs).reorder(backward_indices)


def shifted_logprobs(
    engine, data: SequenceSample, microbatch: MicroBatchSpec, output_key: str
) -> SequenceSample:
    """Log-probability (temperature 1) of every next token of ``packed_input_ids`` under the
    engine's model, as ``output_key`` float32 shifted; micro-batched, no gradient.

    Temperature 1 matches the generation engine's ``packed_logprobs``, which are taken from
    the unmodified distribution, so a PPO ratio against them starts at exactly 1.
    """
    require_keys(data, ("packed_input_ids",), output_key)

    def compute(part: SequenceSample) -> SequenceSample:
        packed_input_ids = part.data["packed_input_ids"].to(engine.device)  # [total_tokens]
        cu_seqlens = part.cu_seqlens("packed_input_ids").to(engine.device)  # [num_seqs + 1]
        logits = engine.forward(packed_input_ids, cu_seqlens)  # [total_tokens, vocab]
        with torch.no_grad():
            logprobs = packed_shifted_logprobs(logits, packed_input_ids, cu_seqlens)
        return SequenceSample.from_tensors(
            ids=part.ids,
            seqlens={output_key: shifted_seqlens(part.seqlens["packed_input_ids"])},
            data={output_key: logprobs.float().cpu()},  # [total_tokens - num_seqs]
        )

    return map_microbatches(data, microbatch, compute)


def strided_minibatches(data: SequenceSample, num_minibatches: int) -> list[SequenceSample]:
    """Split this rank's samples into ``num_minibatches`` mini-batches, sample ``i`` going to
    mini-batch ``i % num_minibatches``.

    Striding (rather than contiguous chunks) makes the union over data-parallel ranks of
    mini-batch ``k`` equal to mini-batch ``k`` of a single process when the batch was cut into
    contiguous rank shares, and keeps every mini-batch's sample count within one of the others.
    """
    if data.bs < num_minibatches:
        raise ValueError(
            f"this data-parallel rank holds {data.bs} samples but ppo.num_minibatches="
            f"{num_minibatches}; every mini-batch needs a sample on every rank. Lower "
            "ppo.num_minibatches or raise the batch size"
        )
    return [
        data.reorder(list(range(start, data.bs, num_minibatches)))
        for start in range(num_minibatches)
    ]


class DistributedMeans:
    """Sums and counts of statistics, reduced over a process group in one all-reduce.

    ``add("entropy", sum_of_entropies, num_tokens)`` accumulates; `reduce` returns
    ``{"entropy": global_sum / global_count}``. Values may be floats or 0-dim tensors.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.counts: dict[str, torch.Tensor | float] = {}
        self.fixed_divisors: dict[str, float] = {}

    def add(self, name: str, total, count=1.0) -> None:
        """Accumulate ``total`` over ``count`` items; both are summed over ranks."""
        self.sums[name] = self.sums.get(name, 0.0) + _as_float64(total)
        self.counts[name] = self.counts.get(name, 0.0) + _as_float64(count)

    def add_global_total(self, name: str, total, divisor: float = 1.0) -> None:
        """Accumulate ``total``, summed over ranks, then divided by ``divisor`` (not reduced):
        e.g. each rank's share of a loss whose shares add up to the global loss."""
        self.add(name, total, 0.0)
        self.fixed_divisors[name] = float(divisor)

    def reduce(
        self, process_group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
    ) -> dict[str, float]:
        names = sorted(self.sums)
        if not names:
            return {}
        values = [_as_float64(self.sums[n]) for n in names] + [
            _as_float64(self.counts[n]) for n in names
        ]
        vector = torch.stack([v.to(device) for v in values])  # [2 * num_stats] float64
        all_reduce_sum(vector, process_group)
        sums, counts = vector.cpu().split(len(names))
        result = {}
        for name, total, count in zip(names, sums.tolist(), counts.tolist()):
            if name in self.fixed_divisors:
                result[name] = total / self.fixed_divisors[name]
            else:
                result[name] = total / count if count > 0 else 0.0
        return result


def _as_float64(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64)


def reduction_device(engine) -> torch.device:
    """Where collective tensors live: the engine's device (NCCL needs CUDA, gloo takes CPU)."""
    group = engine.parallel.dp_group
    if group is not None and dist.get_backend(group) == "nccl":
        return engine.device
    return torch.device("cpu")


# ---------------------------------------------------------------------- PPO rollout preparation
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
    device: torch.device | str = "cpu",
) -> tuple[SequenceSample, DistributedMeans]:
    """Rewards -> token rewards -> advantages and returns for this rank's rollouts.

    Returns a sample with ``packed_input_ids`` and the shifted ``loss_mask``,
    ``old_logprobs``, ``advantages``, ``returns`` (plus ``ref_logprobs`` and per-token
    ``values`` when given), and the rollout statistics to reduce with the training ones.
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
