"""Supervised fine-tuning: next-token cross-entropy on the answer tokens only.

The loss is a token mean over the *whole* batch: every micro-batch divides its summed
negative log-likelihood by the number of answer tokens on all data-parallel ranks, so the
engine's summed gradients equal one process training on the whole batch.
"""

from __future__ import annotations

import torch

from realrl.algo.aggregation import aggregate_loss, loss_normaliser
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import (
    DistributedMeans,
    loss_mask_from_prompt_mask,
    require_engine,
    require_keys,
    unsupported_call,
)
from realrl.interfaces.configs import SFTConfig

INPUT_KEYS = ("packed_input_ids", "prompt_mask")


def answer_nll(model, hidden: torch.Tensor, part: SequenceSample):
    """Per-token negative log-likelihood ``[total_tokens - num_seqs]`` and the shifted mask of
    answer tokens, for a micro-batch with ``packed_input_ids`` and ``prompt_mask``; ``hidden
    [total_tokens, hidden]`` are `model`'s final hidden states (the engine's forward)."""
    packed_input_ids = part.data["packed_input_ids"]  # [total_tokens]
    cu_seqlens = part.cu_seqlens("packed_input_ids")  # [num_seqs + 1]
    logprobs = model.shifted_logprobs(hidden, packed_input_ids, cu_seqlens)
    loss_mask = loss_mask_from_prompt_mask(part.data["prompt_mask"], cu_seqlens)
    return -logprobs, loss_mask, cu_seqlens


class SFTInterface:
    def __init__(self, config: SFTConfig | None = None) -> None:
        self.config = config or SFTConfig()

    def optimizer_steps_per_call(self) -> int:
        return 1

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """One optimizer step. Stats: ``loss`` (global token mean), ``tokens`` (answer tokens
        over all ranks), ``grad_norm``, ``lr``."""
        engine = require_engine(engine, "sft", "train_step")
        require_keys(data, INPUT_KEYS, "sft.train_step")
        data = data.select(INPUT_KEYS).to(engine.device)
        group = engine.parallel.dp_group
        cu_seqlens = data.cu_seqlens("packed_input_ids")
        loss_mask = loss_mask_from_prompt_mask(data.data["prompt_mask"], cu_seqlens)
        normaliser = loss_normaliser("token-mean", loss_mask, cu_seqlens, process_group=group)
        microbatches, _, _ = data.split_microbatches(
            microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
        )

        def loss_fn(forward, part: SequenceSample):
            nll, mask, part_cu_seqlens = answer_nll(
                engine.module,
                forward(part.data["packed_input_ids"], part.cu_seqlens("packed_input_ids")),
                part,
            )
            loss = aggregate_loss(nll, mask, part_cu_seqlens, "token-mean", normaliser)
            return loss, {"loss": loss.detach()}

        stats = engine.train_microbatches(microbatches, loss_fn)
        means = DistributedMeans()
        means.add_global_total("loss", stats["loss"])
        means.add_global_total("tokens", loss_mask.sum())
        result = means.reduce(group)
        result["grad_norm"], result["lr"] = stats["grad_norm"], stats["lr"]
        return MFCResult(stats=result)

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """Evaluation: ``loss`` (this rank's token-mean answer NLL) and ``tokens``; no data."""
        engine = require_engine(engine, "sft", "inference")
        require_keys(data, INPUT_KEYS, "sft.inference")
        totals = {"nll": 0.0, "tokens": 0.0}
        microbatches, _, _ = data.select(INPUT_KEYS).split_microbatches(
            microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
        )
        for part in microbatches:
            part = part.to(engine.device)
            ids, cu_seqlens = part.data["packed_input_ids"], part.cu_seqlens("packed_input_ids")
            with torch.no_grad():
                nll, mask, _ = answer_nll(engine.module, engine.forward(ids, cu_seqlens), part)
            totals["nll"] += float((nll * mask).sum())
            totals["tokens"] += float(mask.sum())
        loss = totals["nll"] / max(totals["tokens"], 1.0)
        return MFCResult(stats={"loss": loss, "tokens": totals["tokens"]})

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("sft", "generate", "train_step and inference")
