"""rw: a paired reward model trained with the Bradley-Terry loss.

It starts, as InstructGPT's does (Ouyang et al. 2022, sec. 3.5), from the SFT model: with an
empty `model.path`, realrl's SFT warm start of the built-in model, which knows enough about
numbers to learn the built-in pairs' mistakes (`realrl.datasets.arithmetic.WRONG_ANSWER_KINDS`)
in the default 200 steps (loss ln 2 -> ~0.3). From random weights the same run learns
little more than the sign of the result (loss ~0.6).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    model: ModelRoleConfig = help_field(
        ModelRoleConfig(optimizer=OptimizerConfig(lr=3e-4)),
        "Initial weights; an LM checkpoint gets a zero-initialised scalar value head.",
    )
    dataset: DatasetConfig = help_field(DatasetConfig(batch_size=64), "Paired records.")
    total_train_steps: int = help_field(200, "Number of training steps (graph executions).")
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
