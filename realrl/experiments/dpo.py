"""dpo: direct preference optimisation against a frozen reference model.

With `actor.lora.rank > 0` the reference is the actor's base weights with the adapter off
(`ModelSpec.shares_base_with`, as in ppo-math): no second copy of the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import BaseExperimentConfig, help_field
from realrl.api.dfg import MFCDef, MFCKind, OffloadHook
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    ExperimentSpec,
    MFCConfig,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    OptimizerConfig,
    linked_path_help,
)
from realrl.api.registry import register_experiment
from realrl.interfaces.configs import DPOConfig, ReferenceConfig

PAIRED_KEYS = ("packed_input_ids", "prompt_lens")


@register_experiment("dpo")
@dataclass
class DPOExperimentConfig(BaseExperimentConfig):
    """Direct preference optimisation on {"prompt", "pos_answers", "neg_answers"} pairs."""

    key_help: ClassVar[dict[str, str]] = {"ref.path": linked_path_help("actor")}

    actor: ModelRoleConfig = help_field(
        ModelRoleConfig(optimizer=OptimizerConfig(lr=1e-4)), "The policy being trained."
    )
    ref: ModelRoleConfig = help_field(ModelRoleConfig(), "Frozen reference; path empty: actor.path.")
    dataset: DatasetConfig = help_field(DatasetConfig(batch_size=16), "Paired records.")
    beta: float = help_field(0.1, "DPO inverse temperature beta.")
    ref_inf: MFCConfig = help_field(MFCConfig(), "MFC ref_inf.")
    actor_train: MFCConfig = help_field(MFCConfig(), "MFC actor_train.")

    def model_path_links(self) -> dict[str, str]:
        return {"ref": "actor"}

    def validate(self) -> list[str]:
        problems = super().validate() + self.dataset.validate("dataset")
        problems += self.actor.optimizer.validate("actor.optimizer")
        if self.beta <= 0:
            problems.append(f"`beta={self.beta}` must be > 0.")
        if self.ref.lora.enabled:
            problems.append(f"`ref.lora.rank={self.ref.lora.rank}`: the reference does not "
                            "train; with `actor.lora.rank` > 0 it is the actor's base with the "
                            "adapter off. Set `ref.lora.rank=0`.")
        if self.reference_shares_actor_base() and self.ref.offload:
            problems.append("`ref.offload=true` with `actor.lora.rank` > 0: the reference is the "
                            "actor's base weights, which offloading would move from under the "
                            "actor; set `ref.offload=false`.")
        return problems + self.ref_inf.validate("ref_inf") + self.actor_train.validate("actor_train")

    def reference_shares_actor_base(self) -> bool:
        """The actor has LoRA adapters and the reference would load the same weights in the
        same dtype: the reference is then the actor's base with its adapter off."""
        return (self.actor.lora.enabled and self.ref.path in ("", self.actor.path)
                and self.ref.dtype == self.actor.dtype)

    def build(self) -> ExperimentSpec:
        batch_size = self.dataset.batch_size
        ref_inf = MFCDef(
            name="ref_inf", model_role="ref", kind=MFCKind.inference, interface="reference",
            interface_config=ReferenceConfig(), input_keys=("packed_input_ids",),
            output_keys=("packed_ref_logprobs",), batch_size=batch_size,
            microbatch=self.ref_inf.microbatch_spec(),
            post_hooks=[OffloadHook()] if self.ref.offload else [],
        )
        actor_train = MFCDef(
            name="actor_train", model_role="actor", kind=MFCKind.train_step, interface="dpo",
            interface_config=DPOConfig(beta=self.beta),
            input_keys=PAIRED_KEYS + ("packed_ref_logprobs",), batch_size=batch_size,
            microbatch=self.actor_train.microbatch_spec(),
        )
        models = {
            "actor": ModelSpec("actor", ModelKind.lm, self.actor, trainable=True),
            "ref": ModelSpec("ref", ModelKind.lm, self.ref,
                             shares_base_with="actor" if self.reference_shares_actor_base()
                             else None),
        }
        return ExperimentSpec(models, [ref_inf, actor_train], DatasetKind.paired, PAIRED_KEYS)
