"""gen: sample completions for a prompt set into one JSONL file.

`genDefault` samples `n_samples` completions per prompt on every data-parallel rank and returns
them to the master, which writes all of them to `<run_dir>/generated.jsonl`, one line
`{"query_id", "prompt", "completion", "no_eos", "step"}` per completion, and at the end of the
run puts the lines in the order of the prompts in the dataset.
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
)
from realrl.api.registry import register_experiment
from realrl.api.rl_config import GenerationHyperparameters
from realrl.interfaces.configs import GenerationConfig

# What genDefault returns to the master (`realrl.interfaces.generation`).
OUTPUT_KEYS = ("packed_input_ids", "prompt_mask", "seq_no_eos_mask")


@register_experiment("gen")
@dataclass
class GenerationExperimentConfig(BaseExperimentConfig):
    """Generate completions for {"prompt", ...} records into one <run_dir>/generated.jsonl."""

    model: ModelRoleConfig = help_field(ModelRoleConfig(), "The model to sample from.")
    dataset: DatasetConfig = help_field(DatasetConfig(batch_size=16), "Prompts.")
    gen: GenerationHyperparameters = help_field(GenerationHyperparameters(), "Generation.")
    n_samples: int = help_field(1, "Completions per prompt.")
    total_train_steps: int = help_field(
        0, "Batches to generate for; 0: one pass over the prompts, each once, in "
        "ceil(N / dataset.batch_size) batches, the last one partial. A number of batches draws "
        "whole shuffled batches epoch after epoch, as training does."
    )
    genDefault: MFCConfig = help_field(MFCConfig(), "MFC genDefault.")

    def one_pass_allowed(self) -> bool:
        return True

    def validate(self) -> list[str]:
        problems = super().validate() + self.dataset.validate("dataset") + self.gen.validate("gen")
        if self.n_samples < 1:
            problems.append(f"`n_samples={self.n_samples}` must be >= 1.")
        return problems + self.genDefault.validate("genDefault")

    def build(self) -> ExperimentSpec:
        generate = MFCDef(
            name="genDefault", model_role="default", kind=MFCKind.generate, interface="generation",
            interface_config=GenerationConfig(generation=self.gen, n_samples=self.n_samples),
            input_keys=("packed_prompts",), output_keys=OUTPUT_KEYS,
            batch_size=self.dataset.batch_size,
            microbatch=self.genDefault.microbatch_spec(),
        )
        models = {"default": ModelSpec("default", ModelKind.lm, self.model)}
        return ExperimentSpec(models, [generate], DatasetKind.prompt, ("packed_prompts",))
