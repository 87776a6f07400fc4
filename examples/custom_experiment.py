"""A user-defined experiment: ppo-math plus an extra MFC, registered by decorator.

    python -m realrl.apps.quickstart --import examples/custom_experiment.py
    python -m realrl.apps.quickstart ppo-math-rm --import examples/custom_experiment.py --dry-run

`rm_inf` scores every response with a learned reward model (a paired-RW checkpoint from the `rw`
experiment, path in `rm.path`) next to the rule-based reward; its `rm_scores` key is logged. The
graph picks up the new MFC from its keys alone: it runs beside rew_inf, ref_inf and critic_inf.
"""

from dataclasses import dataclass

from realrl.api.config import help_field
from realrl.api.dfg import MFCDef, MFCKind
from realrl.api.experiment import ExperimentSpec, MFCConfig, ModelKind, ModelRoleConfig, ModelSpec
from realrl.api.registry import register_experiment
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.interfaces.configs import PairedRewardConfig


@register_experiment("ppo-math-rm")
@dataclass
class PPOWithRewardModelConfig(PPOMathConfig):
    """ppo-math that also scores responses with a learned reward model (logged as rm_scores)."""

    rm: ModelRoleConfig = help_field(ModelRoleConfig(), "Learned reward model checkpoint.")
    rm_inf: MFCConfig = help_field(MFCConfig(), "MFC rm_inf.")

    def build(self) -> ExperimentSpec:
        spec = super().build()
        spec.models["rm"] = ModelSpec("rm", ModelKind.critic, self.rm)
        spec.mfcs.append(MFCDef(
            name="rm_inf", model_role="rm", kind=MFCKind.inference, interface="paired_rw",
            interface_config=PairedRewardConfig(), input_keys=("packed_input_ids",),
            output_keys=("rm_scores",), batch_size=self.dataset.batch_size,
            microbatch=self.rm_inf.microbatch_spec(),
        ))
        return spec
