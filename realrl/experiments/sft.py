"""sft: supervised fine-tuning, next-token loss on the answer tokens only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import BaseExperimentConfig, help_field
from realrl.api.dfg import MFCDef, MFCKind
from realrl.api.experiment import (
    FRESH_MODEL_PATH_HELP,
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
from realrl.interfaces.configs import SFTConfig


@register_experiment("sft")
@dataclass
class SFTExperimentConfig(BaseExperimentConfig):
    """Supervised fine-tuning on {"prompt", "answer"} records (loss on answers only)."""

    default_model: ClassVar[str] = "fresh"  # empty model.path: the untrained built-in model
    key_help: ClassVar[dict[str, str]] = {"model.path": FRESH_MODEL_PATH_HELP}

    model: ModelRoleConfig = help_field(
        ModelRoleConfig(optimizer=OptimizerConfig(lr=1e-3)), "The model to fine-tune."
    )
    dataset: DatasetConfig = help_field(DatasetConfig(batch_size=32), "SFT records.")
    trainDefault: MFCConfig = help_field(MFCConfig(), "MFC trainDefault.")

    def validate(self) -> list[str]:
        problems = super().validate() + self.dataset.validate("dataset")
        problems += self.model.optimizer.validate("model.optimizer")
        return problems + self.trainDefault.validate("trainDefault")

    def build(self) -> ExperimentSpec:
        train = MFCDef(
            name="trainDefault", model_role="default", kind=MFCKind.train_step, interface="sft",
            interface_config=SFTConfig(), input_keys=("packed_input_ids", "prompt_mask"),
            batch_size=self.dataset.batch_size, microbatch=self.trainDefault.microbatch_spec(),
        )
        models = {"default": ModelSpec("default", ModelKind.lm, self.model, trainable=True)}
        return ExperimentSpec(models, [train], DatasetKind.sft, ("packed_input_ids", "prompt_mask"))
