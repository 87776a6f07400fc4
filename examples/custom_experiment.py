"""A user-defined experiment: ppo-math plus an extra MFC, registered by decorator.

    python -m realrl.apps.quickstart ppo-math-rm --import examples/custom_experiment.py \\
        rm.path=runs/rw/trial0/checkpoints/stepNNNNNN/default
    python -m realrl.apps.quickstart ppo-math-rm --import examples/custom_experiment.py --dry-run

`rm_inf` scores every response with a learned reward model (a paired-RW checkpoint from the `rw`
experiment, path in `rm.path`; empty: a fresh value head on actor.path, which scores but has
learned nothing) next to the rule-based reward of `rew_inf`. The graph picks up the new MFC
from its keys alone: it runs beside rew_inf, ref_inf and critic_inf.

What is logged: this experiment names `rm_scores` in `log.per_sample_keys`, so metrics.jsonl
holds `batch/rm_scores/mean`, `/std`, `/min` and `/max` every step (the progress line shows the
mean), and samples.jsonl shows each logged response's `rm_scores` beside its `reward`.

`reward_source=model` trains the actor (and critic) on `rm_scores` instead of the rule reward:
the train MFCs read `rm_scores` as their `rewards` (`input_key_remap`), and the progress line's
`reward` and metrics.png follow it. rew_inf still runs, so `rew_inf/task_mean` keeps
reporting the verifiable accuracy of the same responses.
"""

import dataclasses
import enum
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
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.interfaces.configs import PairedRewardConfig


class RewardSource(str, enum.Enum):
    rule = "rule"  # rew_inf's verifiable reward
    model = "model"  # rm_inf's rm_scores


@register_experiment("ppo-math-rm")
@dataclass
class PPOWithRewardModelConfig(PPOMathConfig):
    """ppo-math that also scores responses with a learned reward model (logged as rm_scores)."""

    key_help: ClassVar[dict[str, str]] = PPOMathConfig.key_help | {
        "rm.path": linked_path_help(
            "actor", ", with a zero-initialised value head: it scores, but has learned nothing"
        ),
    }

    rm: ModelRoleConfig = help_field(
        ModelRoleConfig(), "Learned reward model checkpoint (an `rw` run's); empty: actor.path "
        "with a fresh value head."
    )
    rm_inf: MFCConfig = help_field(MFCConfig(), "MFC rm_inf.")
    reward_source: RewardSource = help_field(
        RewardSource.rule, "What the actor trains on: 'rule' (rew_inf's verifiable reward; rm_scores only "
        "logged) or 'model' (the reward model's rm_scores)."
    )
    log: LogConfig = help_field(
        LogConfig(per_sample_keys=["rm_scores"]),
        "What each step logs besides the MFCs' statistics (docs/metrics.md).",
    )

    def model_path_links(self) -> dict[str, str]:
        return super().model_path_links() | {"rm": "actor"}

    def validate(self) -> list[str]:
        problems = super().validate() + self.rm_inf.validate("rm_inf")
        if self.reward_source == RewardSource.model and self.ppo.adv_estimator == "remax":
            problems.append("`reward_source=model` with `ppo.adv_estimator=remax`: the ReMax "
                            "baseline is scored by the rule reward; use reward_source=rule.")
        return problems

    def build(self) -> ExperimentSpec:
        spec = super().build()
        spec.models["rm"] = ModelSpec("rm", ModelKind.critic, self.rm)
        spec.mfcs.append(MFCDef(
            name="rm_inf", model_role="rm", kind=MFCKind.inference, interface="paired_rw",
            interface_config=PairedRewardConfig(), input_keys=("packed_input_ids",),
            output_keys=("rm_scores",), batch_size=self.dataset.batch_size,
            microbatch=self.rm_inf.microbatch_spec(),
        ))
        if self.reward_source == RewardSource.model:
            for mfc in spec.mfcs:
                if mfc.is_train:
                    mfc.input_keys = tuple("rm_scores" if key == "rewards" else key
                                           for key in mfc.input_keys)
                    mfc.input_key_remap = {**mfc.input_key_remap, "rm_scores": "rewards"}
            if spec.rollout_filter is not None:  # best-of-n / dynamic sampling by the RM score
                spec.rollout_filter = dataclasses.replace(
                    spec.rollout_filter, after_mfc="rm_inf", reward_key="rm_scores")
            spec.notes.append("reward_source=model: actor_train and critic_train read rm_scores "
                              "as their rewards.")
        return spec
