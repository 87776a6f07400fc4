"""Direct Preference Optimization (Rafailov et al. 2023).

Inputs are paired like reward-model data (``pos0, neg0, pos1, neg1, ...`` per sample) with
``prompt_lens`` (one per pair) and the frozen reference's ``packed_ref_logprobs`` (shifted,
from ``ref_inf``). With ``log pi(y|x)`` the sum of a response's token log-probs, eq. (7) is

    L = -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))])

averaged over all pairs of the batch on all data-parallel ranks. ``beta * (log pi - log ref)``
is the implicit reward of a response; the reported margin is chosen minus rejected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from realrl.algo.distributed_stats import all_reduce_sum
from realrl.algo.layout import (
    response_mask,
    segment_sum,
    sequence_lengths,
    shifted_cu_seqlens,
)
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import (
    DistributedMeans,
    require_engine,
    require_keys,
    unsupported_call,
)
from realrl.interfaces.configs import DPOConfig
from realrl.interfaces.paired_rw import check_pairs

INPUT_KEYS = ("packed_input_ids", "prompt_lens", "packed_ref_logprobs")


def response_logprob_sums(
    logprobs: torch.Tensor, prompt_lens: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Sum of each sequence's response-token log-probs ``[num_seqs]`` from shifted
    ``logprobs [total_tokens - num_seqs]`` and per-pair ``prompt_lens [num_pairs]``."""
    seq_prompt_lens = prompt_lens.long().repeat_interleave(2)  # both sequences of a pair
    mask = response_mask(seq_prompt_lens, sequence_lengths(cu_seqlens).long())
    return segment_sum(logprobs * mask, shifted_cu_seqlens(cu_seqlens))


def dpo_loss(
    policy_sums: torch.Tensor, reference_sums: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss (eq. 7) and the chosen/rejected implicit rewards, ``[num_pairs]``
    each, from interleaved per-sequence log-prob sums ``[2 * num_pairs]``."""
    rewards = beta * (policy_sums - reference_sums.detach())
    chosen, rejected = rewards[0::2], rewards[1::2]
    return -F.logsigmoid(chosen - rejected), chosen, rejected


class DPOInterface:
    def __init__(self, config: DPOConfig) -> None:
        if config.beta <= 0:
            raise ValueError(f"DPO beta={config.beta} must be > 0 (typical: 0.1)")
        self.config = config

    def optimizer_steps_per_call(self) -> int:
        return 1

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """One optimizer step. Stats: ``loss``, ``reward_margin`` (mean chosen - rejected
        implicit reward), ``accuracy`` (margin > 0), ``chosen_reward``, ``rejected_reward``."""
        engine = require_engine(engine, "dpo", "train_step")
        require_keys(data, INPUT_KEYS, "dpo.train_step")
        check_pairs(data)
        group = engine.parallel.dp_group
        data = data.select(INPUT_KEYS).to(engine.device)
        num_pairs = float(data.data["prompt_lens"].numel())
        pair_count = torch.tensor([num_pairs], dtype=torch.float64)
        total_pairs = all_reduce_sum(pair_count, group)[0].clamp(min=1)
        microbatches, _, _ = data.split_microbatches(
            microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
        )
        beta = self.config.beta

        def loss_fn(forward, part: SequenceSample):
            packed_input_ids = part.data["packed_input_ids"]  # [total_tokens]
            cu_seqlens = part.cu_seqlens("packed_input_ids")  # [num_seqs + 1]
            hidden = forward(packed_input_ids, cu_seqlens)  # [total_tokens, hidden]
            logprobs = engine.module.shifted_logprobs(hidden, packed_input_ids, cu_seqlens)
            prompt_lens = part.data["prompt_lens"]  # [num_pairs]
            policy_sums = response_logprob_sums(logprobs, prompt_lens, cu_seqlens)
            reference_sums = response_logprob_sums(
                part.data["packed_ref_logprobs"].float(), prompt_lens, cu_seqlens
            )
            pair_losses, chosen, rejected = dpo_loss(policy_sums, reference_sums, beta)
            loss = pair_losses.sum() / total_pairs.to(pair_losses.device, pair_losses.dtype)
            margin = (chosen - rejected).detach()
            return loss, {
                "loss": loss.detach(),
                "reward_margin": margin.sum(),
                "accuracy": (margin > 0).sum(),
                "chosen_reward": chosen.detach().sum(),
                "rejected_reward": rejected.detach().sum(),
            }

        stats = engine.train_microbatches(microbatches, loss_fn)
        means = DistributedMeans()
        means.add_global_total("loss", stats["loss"])
        for name in ("reward_margin", "accuracy", "chosen_reward", "rejected_reward"):
            means.add(name, stats[name], num_pairs)
        result = means.reduce(group)
        result["grad_norm"], result["lr"] = stats["grad_norm"], stats["lr"]
        return MFCResult(stats=result)

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("dpo", "generate", "train_step")

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("dpo", "inference", "train_step")
