"""A learned reward model's rewards (MFC ``rm_inf``, `reward.sources=[model]`).

The model is an `rw` run's checkpoint: a transformer with a scalar value head, trained with
the Bradley-Terry loss on the score at the last token of prompt + completion + EOS
(`realrl.interfaces.paired_rw`). A response is scored the same way, at the last token of
prompt + response (its EOS when it has one). The score then becomes the reward as
`reward.model` says: as it is, ``(score - offset) / scale``, or ``(score - mean) / std``
with running statistics of every score so far, global over the data-parallel ranks of the
call; and optionally clipped to ``[-clip, clip]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.algo.value_norm import ValueNormalizer
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.reward_config import ModelRewardConfig, ScoreNormalization
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import (
    map_microbatches,
    one_per_sequence,
    require_engine,
    require_keys,
    unsupported_call,
)
from realrl.interfaces.paired_rw import last_token_scores

# Running normalisation divides by at least this std (ValueNormalizer's variance floor 1e-2),
# so a reward model whose scores barely vary yet does not turn noise into rewards of +-10.
RUNNING_VARIANCE_FLOOR = 1e-2


class ModelRewardInterface:
    def __init__(self, config: ModelRewardConfig | None = None) -> None:
        self.config = config or ModelRewardConfig()
        self._running: ValueNormalizer | None = None  # made on first use, with the dp group

    def optimizer_steps_per_call(self) -> int:
        return 0

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``rewards`` float32, one per sequence. Stats: ``score_mean`` (raw scores),
        ``reward_mean`` (after normalisation and clipping), and with running normalisation
        ``running_mean`` and ``running_std``."""
        engine = require_engine(engine, "model_reward", "inference")
        require_keys(data, ("packed_input_ids",), "model_reward.inference")

        def compute(part: SequenceSample) -> SequenceSample:
            cu_seqlens = part.cu_seqlens("packed_input_ids").to(engine.device)  # [num_seqs + 1]
            values = engine.forward(part.data["packed_input_ids"], cu_seqlens)  # [total_tokens]
            return SequenceSample.from_tensors(
                ids=part.ids,
                seqlens={"rewards": one_per_sequence(part.seqlens["packed_input_ids"])},
                data={"rewards": last_token_scores(values, cu_seqlens).float().cpu()},
            )

        scored = map_microbatches(data, microbatch, compute)
        scores = scored.data["rewards"]  # [num_seqs]
        rewards, stats = self.scores_to_rewards(scores, engine.parallel.dp_group)
        scored.data["rewards"] = rewards
        return MFCResult(data=scored, stats=stats)

    def scores_to_rewards(self, scores: torch.Tensor, process_group: dist.ProcessGroup | None
                          ) -> tuple[torch.Tensor, dict[str, float]]:
        """``[num_seqs]`` scores -> ``[num_seqs]`` float32 rewards and statistics; every rank
        of `process_group` must call it (running normalisation all-reduces)."""
        config = self.config
        stats = {"score_mean": float(scores.mean()) if scores.numel() else 0.0}
        rewards = scores.double()
        if config.normalize == ScoreNormalization.fixed:
            rewards = (rewards - config.offset) / config.scale
        elif config.normalize == ScoreNormalization.running:
            if self._running is None:
                self._running = ValueNormalizer("moving_average",
                                                var_floor=RUNNING_VARIANCE_FLOOR,
                                                process_group=process_group)
            self._running.update(scores)
            mean, std = self._running.mean_std()
            rewards = (rewards - mean) / std
            stats |= {"running_mean": float(mean), "running_std": float(std)}
        if config.clip is not None:
            rewards = rewards.clamp(-config.clip, config.clip)
        rewards = rewards.float()
        stats["reward_mean"] = float(rewards.mean()) if rewards.numel() else 0.0
        return rewards, stats

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("model_reward", "generate", "inference")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("model_reward", "train_step", "inference")
