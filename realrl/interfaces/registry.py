"""Interface name (``MFCDef.interface``) -> class, for the model worker.

The names are those of `realrl.interfaces.configs.INTERFACE_CONFIGS`; each class is built from
the typed config of the same name. The table is explicit so an editor can jump from a name to
its code.
"""

from __future__ import annotations

from realrl.interfaces.base import Interface
from realrl.interfaces.configs import INTERFACE_CONFIGS
from realrl.interfaces.dpo import DPOInterface
from realrl.interfaces.generation import GenerationInterface
from realrl.interfaces.model_reward import ModelRewardInterface
from realrl.interfaces.paired_rw import PairedRewardInterface
from realrl.interfaces.ppo_actor import PPOActorInterface
from realrl.interfaces.ppo_critic import PPOCriticInterface
from realrl.interfaces.reference import ReferenceInterface
from realrl.interfaces.remote_reward import RemoteRewardInterface
from realrl.interfaces.reward_sum import RewardSumInterface
from realrl.interfaces.rule_reward import RuleRewardInterface
from realrl.interfaces.sft import SFTInterface

INTERFACES: dict[str, type] = {
    "ppo_actor": PPOActorInterface,
    "ppo_critic": PPOCriticInterface,
    "reference": ReferenceInterface,
    "rule_reward": RuleRewardInterface,
    "model_reward": ModelRewardInterface,
    "remote_reward": RemoteRewardInterface,
    "reward_sum": RewardSumInterface,
    "sft": SFTInterface,
    "paired_rw": PairedRewardInterface,
    "dpo": DPOInterface,
    "generation": GenerationInterface,
}

assert set(INTERFACES) == set(INTERFACE_CONFIGS), "every interface config needs a class"


def make_interface(name: str, config=None) -> Interface:
    """The interface registered as ``name``, built from ``config`` (its default if None)."""
    if name not in INTERFACES:
        raise ValueError(
            f"unknown interface {name!r} (MFCDef.interface); valid: {', '.join(sorted(INTERFACES))}"
        )
    config_type = INTERFACE_CONFIGS[name]
    if config is None:
        config = config_type()
    if not isinstance(config, config_type):
        raise TypeError(
            f"interface {name!r} takes a {config_type.__name__} config, got "
            f"{type(config).__name__}; build the MFC with interface_config={config_type.__name__}(...)"
        )
    return INTERFACES[name](config)
