"""ppo-agent: PPO-family RL on multi-turn, tool-using episodes (docs/agentic.md).

ppo-math's graph and keys, with `actor_gen` running the episode `episode.name` once per
response (`realrl.episodes`): the model takes turns, calls tools (a calculator, Python in the
code sandbox), reads their outputs and answers; the rule reward scores the answer; the trainer
sees the packed episodes with tool tokens outside the loss. The defaults train the built-in
agentic task (two- and three-digit products, `dataset.builtin_task=multiplication`) from a
default model warm-started to know the call format (`realrl.launcher.warm_start`), with GRPO
and no critic or reference, the cheapest graph on a CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import help_field
from realrl.api.episode_config import EpisodeConfig
from realrl.api.experiment import TOOL_WARM_START_PATH_HELP, BuiltinTask, DatasetConfig
from realrl.api.registry import RegistryError, import_user_module, register_experiment
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters
from realrl.episodes import builtin  # noqa: F401  (registers the built-in episodes)
from realrl.episodes.api import get_episode
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.interfaces.configs import PPOActorConfig


@register_experiment("ppo-agent")
@dataclass
class PPOAgentConfig(PPOMathConfig):
    """PPO-family RL on multi-turn, tool-using episodes (default: products with a calculator)."""

    default_model: ClassVar[str] = "tool"  # empty actor.path: the tool-call warm start
    key_help: ClassVar[dict[str, str]] = {
        **PPOMathConfig.key_help, "actor.path": TOOL_WARM_START_PATH_HELP,
    }

    dataset: DatasetConfig = help_field(
        DatasetConfig(batch_size=8, builtin_train_size=1024,
                      builtin_task=BuiltinTask.multiplication),
        "Prompts; empty path: the built-in multiplication problems.",
    )
    group_size: int = help_field(8, "Episodes per prompt that enter training.")
    total_train_steps: int = help_field(60, "Number of training steps (graph executions).")
    gen: GenerationHyperparameters = help_field(
        GenerationHyperparameters(max_new_tokens=24), "Generation, per model turn."
    )
    ppo: PPOHyperparameters = help_field(
        PPOHyperparameters(adv_estimator="grpo", disable_value=True, kl_ctl=0.0),
        "PPO-family hyperparameters (default GRPO without critic or reference).",
    )
    episode: EpisodeConfig = help_field(
        EpisodeConfig(name="tool_arithmetic"), "The episode every response is (docs/agentic.md)."
    )

    def validate(self) -> list[str]:
        problems = super().validate() + self.episode.validate("episode")
        if self.ppo.overlong_buffer_len > 0:
            problems.append(
                f"`ppo.overlong_buffer_len={self.ppo.overlong_buffer_len}`: length shaping "
                "compares the model's tokens of all of an episode's turns with "
                "`gen.max_new_tokens`, a per-turn limit in ppo-agent; set "
                "ppo.overlong_buffer_len=0.")
        if not self.episode.enabled:
            problems.append("`episode.name` is empty: ppo-agent needs an episode; use "
                            "`episode.name=tool_arithmetic`, or ppo-math for single turns.")
            return problems
        if self.episode.module:
            try:
                import_user_module(self.episode.module)
            except RegistryError as error:
                return problems + [f"`episode.module={self.episode.module}` cannot be imported "
                                   f"({error}); name a module path or a .py file that "
                                   "registers the episode."]
        try:
            get_episode(self.episode.name)
        except ValueError as error:
            problems.append(str(error))
        return problems

    def _actor_config(self) -> PPOActorConfig:
        return dataclasses.replace(super()._actor_config(), episode=self.episode,
                                   apply_chat_template=self.dataset.apply_chat_template)
