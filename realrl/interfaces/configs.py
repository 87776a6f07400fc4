"""Typed configs of the interfaces, one per interface name.

An MFC names its interface (`MFCDef.interface`) and carries one of these as
`MFCDef.interface_config`. They are built by the experiment from its config sections (handed
down unchanged, never renamed) and shipped to workers as data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from realrl.api.episode_config import EpisodeConfig
from realrl.api.reward_config import ModelRewardConfig, RemoteRewardConfig, RuleRewardConfig
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters


@dataclass
class PPOActorConfig:
    ppo: PPOHyperparameters = field(default_factory=PPOHyperparameters)
    generation: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    group_size: int = 1  # responses kept per prompt
    generation_size: int = 1  # responses generated per prompt (best-of-n when > group_size)
    # Multi-turn episodes instead of one response per prompt (realrl.episodes); the dataset's
    # chat-template setting decides how tool outputs join the sequence.
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    apply_chat_template: bool | None = None


@dataclass
class PPOCriticConfig:
    ppo: PPOHyperparameters = field(default_factory=PPOHyperparameters)


@dataclass
class ReferenceConfig:
    """Log-probabilities of the frozen reference policy."""


@dataclass
class RewardSumConfig:
    """`rewards = sum of weight * <source>_rewards` over the sources named in `weights`."""

    weights: dict[str, float] = field(default_factory=dict)  # source name -> weight


@dataclass
class SFTConfig:
    """Next-token loss on the answer tokens only."""


@dataclass
class PairedRewardConfig:
    """Bradley-Terry loss on (chosen, rejected) pairs through a scalar value head."""


@dataclass
class DPOConfig:
    beta: float = 0.1


@dataclass
class GenerationConfig:
    generation: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    n_samples: int = 1
    output_file: str = "generated.jsonl"  # relative to the run directory


INTERFACE_CONFIGS: dict[str, type] = {
    "ppo_actor": PPOActorConfig,
    "ppo_critic": PPOCriticConfig,
    "reference": ReferenceConfig,
    "rule_reward": RuleRewardConfig,  # the `reward.<source>` sections, unchanged
    "model_reward": ModelRewardConfig,
    "remote_reward": RemoteRewardConfig,
    "reward_sum": RewardSumConfig,
    "sft": SFTConfig,
    "paired_rw": PairedRewardConfig,
    "dpo": DPOConfig,
    "generation": GenerationConfig,
}
