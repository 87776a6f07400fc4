"""gen: sample completions for a prompt set into one JSONL file, optionally scored.

`genDefault` samples `n_samples` completions per prompt on every data-parallel rank and returns
them to the master, which writes all of them to `<run_dir>/generated.jsonl`, one line
`{"query_id", "prompt", "completion", "no_eos", "step"}` per completion, and at the end of the
run puts the lines in the order of the prompts in the dataset.

The prompts are chat records, as ppo-rlhf reads them (`{"prompt"}` or `{"messages"}`, with
`answer`, `task`, ... where a rule reward needs them), so the prompts a policy trained on and
held-out prompts of the same file format can be sampled alike. `reward.sources` scores every
completion with the reward MFCs of the PPO family (`realrl.experiments.reward_graph`): the rule
verifiers, an `rw` reward model, an HTTP service, or several; each completion's rewards join
its line, and each MFC's means are in metrics.jsonl (`rew_inf/task_mean`,
`rm_inf/score_mean`, ...), so one command evaluates a policy the way it was trained.
"""

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
    linked_path_help,
)
from realrl.api.registry import register_experiment
from realrl.api.reward_config import REWARD_SECTION_ENABLERS, RewardConfig, RewardSource
from realrl.api.rl_config import GenerationHyperparameters, vllm_config_problems
from realrl.experiments.reward_graph import reward_mfcs, reward_roles
from realrl.interfaces.configs import GenerationConfig

# What genDefault returns to the master (`realrl.interfaces.generation`).
OUTPUT_KEYS = ("packed_input_ids", "prompt_mask", "seq_no_eos_mask")
REWARD_MFCS = ("rew_inf", "rm_inf", "remote_inf", "reward_sum")


@register_experiment("gen")
@dataclass
class GenerationExperimentConfig(BaseExperimentConfig):
    """Sample completions of chat records into <run_dir>/generated.jsonl; reward.sources scores them."""

    key_help: ClassVar[dict[str, str]] = {
        "reward.sources": "How to score each completion: [] (default) not at all; [rule] the "
        "math/code verifiers (records need `answer`, `solutions` or `input_output`), [model] "
        "the reward model in rm.path, [remote] the service at reward.remote.url, or several, "
        "e.g. [rule,model]. Each completion's rewards go into its line of generated.jsonl "
        "(`reward`, and `<source>_rewards` for several sources), each MFC's means into "
        "metrics.jsonl (docs/rewards.md).",
        "rm.path": linked_path_help(
            "model", " (unused: reward.sources=[model] refuses an empty rm.path); the reward "
            "model of that source, an `rw` run's checkpoint, e.g. "
            "runs/rw/trial0/checkpoints/latest/default"
        ),
    }

    section_enablers: ClassVar[dict[str, str]] = REWARD_SECTION_ENABLERS

    model: ModelRoleConfig = help_field(ModelRoleConfig(), "The model to sample from.")
    dataset: DatasetConfig = help_field(
        DatasetConfig(batch_size=16),
        "Prompts: JSONL of {\"prompt\"} or {\"messages\": [{\"role\", \"content\"}, ...]} "
        "records, as ppo-rlhf reads; empty path: the built-in arithmetic problems.",
    )
    gen: GenerationHyperparameters = help_field(GenerationHyperparameters(), "Generation.")
    n_samples: int = help_field(1, "Completions per prompt.")
    total_train_steps: int = help_field(
        0, "Batches to generate for; 0: one pass over the prompts, each once, in "
        "ceil(N / dataset.batch_size) batches, the last one partial. A number of batches draws "
        "whole shuffled batches epoch after epoch, as training does."
    )
    reward: RewardConfig = help_field(RewardConfig(sources=[]), "Scoring of the completions.")
    rm: ModelRoleConfig = help_field(
        ModelRoleConfig(), "The reward model of `reward.sources=[model]` (frozen): an `rw` "
        "run's checkpoint, e.g. runs/rw/trial0/checkpoints/latest/default."
    )
    genDefault: MFCConfig = help_field(MFCConfig(), "MFC genDefault.")
    rew_inf: MFCConfig = help_field(MFCConfig(), "MFC rew_inf (reward.sources has rule).")
    rm_inf: MFCConfig = help_field(MFCConfig(), "MFC rm_inf (reward.sources has model).")
    remote_inf: MFCConfig = help_field(MFCConfig(), "MFC remote_inf (reward.sources has remote).")
    reward_sum: MFCConfig = help_field(MFCConfig(), "MFC reward_sum (several reward sources).")

    def one_pass_allowed(self) -> bool:
        return True

    def model_path_links(self) -> dict[str, str]:
        return {"rm": "model"}  # its dtype follows model's; an empty rm.path is refused in use

    def validate(self) -> list[str]:
        problems = super().validate() + self.dataset.validate("dataset") + self.gen.validate("gen")
        problems += vllm_config_problems("gen", self.gen, async_rollout=self.rollout.is_async,
                                         episodes=False, lora_key="model.lora.rank",
                                         lora_rank=self.model.lora.rank or 0)
        if self.n_samples < 1:
            problems.append(f"`n_samples={self.n_samples}` must be >= 1.")
        if self.reward.sources:
            problems += self.reward.validate("reward")
        if RewardSource.model in self.reward.sources and not self.rm.path:
            problems.append("`reward.sources` has model but `rm.path` is empty: set rm.path to "
                            "an `rw` run's checkpoint, e.g. "
                            "rm.path=runs/rw/trial0/checkpoints/latest/default.")
        for name in ("genDefault", *REWARD_MFCS):
            problems += getattr(self, name).validate(name)
        return problems

    def build(self) -> ExperimentSpec:
        generate = MFCDef(
            name="genDefault", model_role="default", kind=MFCKind.generate, interface="generation",
            interface_config=GenerationConfig(generation=self.gen, n_samples=self.n_samples),
            input_keys=("packed_prompts",), output_keys=OUTPUT_KEYS,
            batch_size=self.dataset.batch_size,
            microbatch=self.genDefault.microbatch_spec(),
        )
        microbatches = {name: getattr(self, name).microbatch_spec() for name in REWARD_MFCS}
        scoring = (reward_mfcs(self.reward, self.dataset.batch_size, microbatches,
                               offload_reward_model=self.rm.offload)
                   if self.reward.sources else [])
        models = {"default": ModelSpec("default", ModelKind.lm, self.model),
                  **(reward_roles(self.reward, self.model, self.rm) if scoring else {})}
        return ExperimentSpec(models, [generate, *scoring], DatasetKind.chat, ("packed_prompts",))
