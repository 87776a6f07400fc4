"""ppo-rlhf: PPO-family RLHF on chat prompts, rewarded by a learned reward model.

The classic InstructGPT recipe's third stage (Ouyang et al. 2022, sec. 3.5): the policy
answers chat prompts, an `rw` reward model (`rm.path`) scores each answer, and PPO trains on
the scores. It is ppo-math with three differences, and the same algorithm keys (`ppo.*`,
`gen.*`, `group_size`, the roles and their MFCs):

- the prompts are chat records, `{"prompt": str}` or `{"messages": [{"role", "content"},
  ...]}` with no answer needed (`realrl.datasets.records`), each put into the tokenizer's chat
  template with the assistant header after it (`dataset.apply_chat_template`, as in every
  experiment);
- the reward comes from the reward model by default (`reward.sources=[model]`); a rule reward
  and an HTTP reward service can replace it or be added to it (docs/rewards.md);
- the built-in data is the built-in arithmetic problems as one-turn chats, so that the chain
  sft -> rw -> ppo-rlhf runs offline on the built-in model, whose tokenizer has no template
  (its prompts stay raw).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import help_field
from realrl.api.experiment import DatasetConfig, DatasetKind
from realrl.api.registry import register_experiment
from realrl.api.reward_config import RewardConfig, RewardSource
from realrl.experiments.ppo_math import PPOMathConfig


@register_experiment("ppo-rlhf")
@dataclass
class PPORLHFConfig(PPOMathConfig):
    """PPO-family RLHF on chat prompts with a learned reward model (rm.path, an `rw` run's)."""

    dataset_kind: ClassVar[DatasetKind] = DatasetKind.chat

    dataset: DatasetConfig = help_field(
        DatasetConfig(batch_size=16, builtin_train_size=256),
        "Chat prompts: JSONL of {\"prompt\"} or {\"messages\": [{\"role\", \"content\"}, ...]}; "
        "empty path: the built-in arithmetic problems as one-turn chats.",
    )
    reward: RewardConfig = help_field(
        RewardConfig(sources=[RewardSource.model]),
        "Where rewards come from: the reward model in rm.path by default; rule, remote, or a "
        "weighted sum (docs/rewards.md).",
    )
