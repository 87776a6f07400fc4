"""rw: a paired reward model trained with the Bradley-Terry loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import BaseExperimentConfig, help_field
from realrl.api.dfg import MFCDef, MFCKind
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    ExperimentSpec,
    MFCConfig,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    OptimizerConfig,
)
from realrl.api.registry import register_experiment
from realrl.interfaces.configs import PairedRewardConfig

PAIRED_KEYS = ("packed_input_ids", "prompt_lens")


@register_experiment("rw")
@dataclass
class RewardModelingConfig(BaseExperimentConfig):
    """Reward modelling on {"prompt", "pos_answers", "neg_answers"} pairs (Bradley-Terry)."""

    default_model: ClassVar[str] = "fresh"  # empty model.path: the untrained built-in model

    model: ModelRoleConfig = help_field(
        ModelRoleConfig(optimizer=OptimizerConfig(lr=1e-4)),
        "Initial weights; an LM checkpoint gets a fresh scalar value head.",
    )
    dataset: DatasetConfig = help_field(DatasetConfig(batch_size=16), "Paired records.")
    trainDefault: MFCConfig = help_field(MFCConfig(), "MFC trainDefault.")

    def validate(self) -> list[str]:
        problems = super().validate() + self.dataset.validate("dataset")
        problems += self.model.optimizer.validate("model.optimizer")
        return problems + self.trainDefault.validate("trainDefault")

    def build(self) -> ExperimentSpec:
        train = MFCDef(
            name="trainDefault", model_role="default", kind=MFCKind.train_step,
            interface="paired_rw", interface_config=PairedRewardConfig(), input_keys=PAIRED_KEYS,
            batch_size=self.dataset.batch_size, microbatch=self.trainDefault.microbatch_spec(),
        )
        models = {"default": ModelSpec("default", ModelKind.critic, self.model, trainable=True)}
        return ExperimentSpec(models, [train], DatasetKind.paired, PAIRED_KEYS)
