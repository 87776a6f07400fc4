"""A user-defined experiment: ppo-math plus an extra MFC, registered by decorator.

    python -m realrl.apps.quickstart ppo-gold-rm --import examples/custom_experiment.py \\
        rm.path=runs/rw/trial0/checkpoints/latest/default \\
        gold_rm.path=runs/rw/trial1/checkpoints/latest/default
    python -m realrl.apps.quickstart ppo-gold-rm --import examples/custom_experiment.py --dry-run

A policy trained on a learned reward model learns to please that model beyond what the
preference it stands for supports (reward over-optimisation, Gao et al. 2022). A second,
held-out reward model, the "gold" one, shows it: its scores stop rising, or fall, while the
proxy's keep rising. This experiment trains on the proxy (`reward.sources=[model]`, `rm.path`,
as ppo-math and ppo-rlhf do) and adds `gold_inf`, which scores every response with the gold
model (`gold_rm.path`; empty: `rm.path`) into `gold_scores`. No train MFC reads
`gold_scores`, so they are only logged: the graph picks the new MFC up from its keys and runs
it beside rm_inf, ref_inf and critic_inf.

What is logged: this experiment names `gold_scores` in `log.per_sample_keys`, so metrics.jsonl
holds `batch/gold_scores/mean`, `/std`, `/min` and `/max` every step (the progress line shows
the mean beside the proxy's `reward`), and samples.jsonl shows each logged response's
`gold_scores` beside its `reward`.
"""

from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import LogConfig, help_field
from realrl.api.dfg import MFCDef, MFCKind
from realrl.api.experiment import (
    ExperimentSpec,
    MFCConfig,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    linked_path_help,
)
from realrl.api.registry import register_experiment
from realrl.api.reward_config import ModelRewardConfig, RewardConfig, RewardSource
from realrl.experiments.ppo_math import PPOMathConfig


@register_experiment("ppo-gold-rm")
@dataclass
class PPOWithGoldRewardModelConfig(PPOMathConfig):
    """ppo-math on a reward model (rm), watched by a held-out one (gold_rm, logged only)."""

    key_help: ClassVar[dict[str, str]] = PPOMathConfig.key_help | {
        "gold_rm.path": linked_path_help("rm", ": the gold scores then equal the proxy's"),
    }

    reward: RewardConfig = help_field(
        RewardConfig(sources=[RewardSource.model]),
        "What the actor trains on: the proxy reward model in rm.path (docs/rewards.md).",
    )
    gold_rm: ModelRoleConfig = help_field(
        ModelRoleConfig(), "The held-out reward model (another `rw` run's checkpoint)."
    )
    gold_inf: MFCConfig = help_field(MFCConfig(), "MFC gold_inf.")
    log: LogConfig = help_field(
        LogConfig(per_sample_keys=["gold_scores"]),
        "What each step logs besides the MFCs' statistics (docs/metrics.md).",
    )

    def model_path_links(self) -> dict[str, str]:
        return super().model_path_links() | {"gold_rm": "rm"}

    def validate(self) -> list[str]:
        return super().validate() + self.gold_inf.validate("gold_inf")

    def build(self) -> ExperimentSpec:
        spec = super().build()
        spec.models["gold_rm"] = ModelSpec("gold_rm", ModelKind.critic, self.gold_rm)
        spec.mfcs.append(MFCDef(
            name="gold_inf", model_role="gold_rm", kind=MFCKind.inference,
            interface="model_reward", interface_config=ModelRewardConfig(),  # raw scores
            input_keys=("packed_input_ids",), output_keys=("gold_scores",),
            output_key_remap={"rewards": "gold_scores"}, batch_size=self.dataset.batch_size,
            microbatch=self.gold_inf.microbatch_spec(),
        ))
        return spec
