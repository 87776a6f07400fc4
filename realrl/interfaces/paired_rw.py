"""Reward modelling from preference pairs with a scalar value head (Bradley-Terry).

A sample holds ``pos0, neg0, pos1, neg1, ...``: sequences of one prompt with a preferred and
a rejected completion each. The score of a sequence is the critic-kind model's value at its
last token, and the loss is the Bradley-Terry negative log-likelihood of the preferences
(Ouyang et al. 2022, eq. (1)): ``-log sigmoid(s_pos - s_neg)``, averaged over all pairs of the
batch on all data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from realrl.algo.distributed_stats import all_reduce_sum
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import (
    DistributedMeans,
    map_microbatches,
    one_per_sequence,
    require_engine,
    require_keys,
    unsupported_call,
)
from realrl.interfaces.configs import PairedRewardConfig


def last_token_scores(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each sequence's value at its last token: ``[num_seqs]`` from ``values [total_tokens]``."""
    return values[cu_seqlens[1:].long() - 1]


def check_pairs(data: SequenceSample) -> None:
    odd = [data.ids[i] for i, lens in enumerate(data.seqlens["packed_input_ids"]) if len(lens) % 2]
    if odd:
        raise ValueError(
            f"paired data: samples {odd[:5]} hold an odd number of sequences; each sample must "
            "interleave (positive, negative) pairs: pos0, neg0, pos1, neg1, ..."
        )


def bradley_terry_loss(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss ``-log sigmoid(s_pos - s_neg)`` and margin, ``[num_pairs]`` each, from
    interleaved ``scores [2 * num_pairs]``."""
    margin = scores[0::2] - scores[1::2]
    return -F.logsigmoid(margin), margin


class PairedRewardInterface:
    def __init__(self, config: PairedRewardConfig | None = None) -> None:
        self.config = config or PairedRewardConfig()

    def optimizer_steps_per_call(self) -> int:
        return 1

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """One optimizer step on the mean pair loss. Stats: ``loss``, ``accuracy`` (fraction of
        pairs scored the right way round), ``positive_score``, ``negative_score``."""
        engine = require_engine(engine, "paired_rw", "train_step")
        require_keys(data, ("packed_input_ids",), "paired_rw.train_step")
        check_pairs(data)
        group = engine.parallel.dp_group
        data = data.select(("packed_input_ids",)).to(engine.device)
        num_pairs = len(data.seqlens_of("packed_input_ids")) / 2.0  # this rank's
        pair_count = torch.tensor([num_pairs], dtype=torch.float64)
        total_pairs = all_reduce_sum(pair_count, group)[0].clamp(min=1)  # every rank's
        microbatches, _, _ = data.split_microbatches(
            microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
        )

        def loss_fn(forward, part: SequenceSample):
            cu_seqlens = part.cu_seqlens("packed_input_ids")
            values = forward(part.data["packed_input_ids"], cu_seqlens)  # [total_tokens]
            scores = last_token_scores(values, cu_seqlens)  # [num_seqs]
            pair_losses, margin = bradley_terry_loss(scores)
            loss = pair_losses.sum() / total_pairs.to(pair_losses.device, pair_losses.dtype)
            return loss, {
                "loss": loss.detach(),
                "correct": (margin > 0).sum().detach(),
                "positive_score": scores[0::2].sum().detach(),
                "negative_score": scores[1::2].sum().detach(),
            }

        stats = engine.train_microbatches(microbatches, loss_fn)
        means = DistributedMeans()
        means.add_global_total("loss", stats["loss"])
        # Local sums over local counts: `reduce` sums both over the ranks.
        for name in ("positive_score", "negative_score"):
            means.add(name, stats[name], num_pairs)
        means.add("accuracy", stats["correct"], num_pairs)
        result = means.reduce(group)
        result["grad_norm"], result["lr"] = stats["grad_norm"], stats["lr"]
        return MFCResult(stats=result)

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``rm_scores`` float32, one per sequence: the value at its last token."""
        engine = require_engine(engine, "paired_rw", "inference")
        require_keys(data, ("packed_input_ids",), "paired_rw.inference")

        def compute(part: SequenceSample) -> SequenceSample:
            cu_seqlens = part.cu_seqlens("packed_input_ids").to(engine.device)
            values = engine.forward(part.data["packed_input_ids"], cu_seqlens)
            return SequenceSample.from_tensors(
                ids=part.ids,
                seqlens={"rm_scores": one_per_sequence(part.seqlens["packed_input_ids"])},
                data={"rm_scores": last_token_scores(values, cu_seqlens).float().cpu()},
            )

        return MFCResult(data=map_microbatches(data, microbatch, compute))

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("paired_rw", "generate", "train_step and inference")
