"""gen: sample completions for a prompt set and write them to JSONL."""

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
)
from realrl.api.registry import register_experiment
from realrl.api.rl_config import GenerationHyperparameters
from realrl.interfaces.configs import GenerationConfig


@register_experiment("gen")
@dataclass
class GenerationExperimentConfig(BaseExperimentConfig):
    """Generate completions for {"prompt", ...} records into <run_dir>/generated.rank<N>.jsonl."""

    model: ModelRoleConfig = help_field(ModelRoleConfig(), "The model to sample from.")
    dataset: DatasetConfig = help_field(DatasetConfig(batch_size=16), "Prompts.")
    gen: GenerationHyperparameters = help_field(GenerationHyperparameters(), "Generation.")
    n_samples: int = help_field(1, "Completions per prompt.")
    total_train_steps: int = help_field(1, "Batches to generate for (one pass: ceil(N / batch)).")
    genDefault: MFCConfig = help_field(MFCConfig(), "MFC genDefault.")

    def validate(self) -> list[str]:
        problems = super().validate() + self.dataset.validate("dataset") + self.gen.validate("gen")
        if self.n_samples < 1:
            problems.append(f"`n_samples={self.n_samples}` must be >= 1.")
        return problems + self.genDefault.validate("genDefault")

    def build(self) -> ExperimentSpec:
        generate = MFCDef(
            name="genDefault", model_role="default", kind=MFCKind.generate, interface="generation",
            interface_config=GenerationConfig(generation=self.gen, n_samples=self.n_samples),
            input_keys=("packed_prompts",), batch_size=self.dataset.batch_size,
            microbatch=self.genDefault.microbatch_spec(),
        )
        models = {"default": ModelSpec("default", ModelKind.lm, self.model)}
        return ExperimentSpec(models, [generate], DatasetKind.prompt, ("packed_prompts",))
