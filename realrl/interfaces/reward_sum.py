"""The weighted sum of several reward sources (MFC ``reward_sum``).

Each source's MFC writes ``<source>_rewards`` (``rule_rewards``, ``model_rewards``,
``remote_rewards``); this one writes ``rewards = sum_s weight_s * <source>_rewards``, the key
the actor and critic train on, and reports each source's mean, so a run shows which source
moved. It needs no model: it runs on the rule-based ``reward`` role.
"""

from __future__ import annotations

import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.reward_config import source_key
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import require_keys, unsupported_call
from realrl.interfaces.configs import RewardSumConfig


class RewardSumInterface:
    def __init__(self, config: RewardSumConfig | None = None) -> None:
        self.config = config or RewardSumConfig()

    def optimizer_steps_per_call(self) -> int:
        return 0

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``rewards`` float32, one per sequence. Stats: ``<source>_mean`` of each source's
        rewards before weighting."""
        keys = tuple(source_key(source) for source in self.config.weights)
        require_keys(data, keys, "reward_sum.inference")
        num_seqs = len(data.seqlens_of(keys[0]))  # one value per sequence in each key
        total = torch.zeros(num_seqs, dtype=torch.float64)  # [num_seqs]
        stats = {}
        for source, weight in self.config.weights.items():
            rewards = data.data[source_key(source)].double().reshape(-1)  # [num_seqs]
            total += weight * rewards
            stats[f"{source}_mean"] = float(rewards.mean()) if num_seqs else 0.0
        output = SequenceSample.from_tensors(
            ids=data.ids,
            seqlens={"rewards": data.seqlens[keys[0]]},
            data={"rewards": total.float()},
        )
        return MFCResult(data=output, stats=stats)

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("reward_sum", "generate", "inference")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("reward_sum", "train_step", "inference")
