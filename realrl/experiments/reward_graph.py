"""The reward MFCs of a PPO-family graph, built from its `reward` section
(`realrl.api.reward_config`).

With one source of weight 1, that source's MFC writes `rewards` itself. Otherwise each source
writes `<source>_rewards` and `reward_sum` adds them up, weighted, into `rewards`:

    actor_gen ─packed_input_ids─► rew_inf    ─rule_rewards───┐
                               ─► rm_inf     ─model_rewards──┼─► reward_sum ─rewards─► actor_train,
                               ─► remote_inf ─remote_rewards─┘                        critic_train

`rew_inf`, `remote_inf` and `reward_sum` run on the weightless `reward` role (the policy's
tokenizer); `rm_inf` on the `rm` role, the reward model, with its own allocation like any
other model. ReMax scores its greedy baseline with copies of the same MFCs (`_greedy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from realrl.api.dfg import MFCDef, MFCKind, MicroBatchSpec, OffloadHook
from realrl.api.experiment import ModelKind, ModelRoleConfig, ModelSpec
from realrl.api.reward_config import RewardConfig, RewardSource, source_key
from realrl.interfaces.configs import RewardSumConfig

RULE_ROLE, MODEL_ROLE = "reward", "rm"
SUM_MFC = "reward_sum"


@dataclass(frozen=True)
class SourceMFC:
    name: str
    role: str
    interface: str
    inputs: tuple[str, ...]  # the keys the interface reads


SOURCE_MFCS = {
    RewardSource.rule: SourceMFC("rew_inf", RULE_ROLE, "rule_reward",
                                 ("packed_input_ids", "prompt_mask")),
    RewardSource.model: SourceMFC("rm_inf", MODEL_ROLE, "model_reward", ("packed_input_ids",)),
    RewardSource.remote: SourceMFC("remote_inf", RULE_ROLE, "remote_reward",
                                   ("packed_input_ids", "prompt_mask")),
}


@dataclass(frozen=True)
class ScoredSequences:
    """Which responses the reward MFCs score and where their reward goes: `renamed` maps an
    interface's input key to the graph key holding it (ReMax's greedy responses), the MFCs'
    names get `suffix`, and per-source keys `prefix`."""

    output_key: str = "rewards"
    renamed: dict[str, str] = field(default_factory=dict)
    suffix: str = ""
    prefix: str = ""

    def graph_key(self, key: str) -> str:
        return self.renamed.get(key, key)


def reward_mfcs(reward: RewardConfig, batch_size: int, microbatch: Mapping[str, MicroBatchSpec],
                scored: ScoredSequences = ScoredSequences(),
                offload_reward_model: bool = False) -> list[MFCDef]:
    """The MFCs that write `scored.output_key`; `microbatch` is keyed by the MFC names
    `rew_inf`, `rm_inf`, `remote_inf` and `reward_sum` (without suffix).
    `offload_reward_model` (`rm.offload`) frees the reward model's memory after `rm_inf`."""
    summed = reward.needs_sum()
    mfcs = []
    for source in reward.sources:
        spec = SOURCE_MFCS[source]
        output = scored.prefix + source_key(source.value) if summed else scored.output_key
        inputs = tuple(scored.graph_key(key) for key in spec.inputs)
        mfcs.append(MFCDef(
            name=spec.name + scored.suffix, model_role=spec.role, kind=MFCKind.inference,
            interface=spec.interface, interface_config=getattr(reward, source.value),
            input_keys=inputs, output_keys=(output,),
            input_key_remap={scored.graph_key(key): key for key in spec.inputs
                             if scored.graph_key(key) != key},
            output_key_remap={"rewards": output} if output != "rewards" else {},
            batch_size=batch_size, microbatch=microbatch[spec.name],
            post_hooks=[OffloadHook()] if offload_reward_model and spec.role == MODEL_ROLE else [],
        ))
    if summed:
        keys = {source_key(s.value): scored.prefix + source_key(s.value) for s in reward.sources}
        mfcs.append(MFCDef(
            name=SUM_MFC + scored.suffix, model_role=RULE_ROLE, kind=MFCKind.inference,
            interface="reward_sum",
            interface_config=RewardSumConfig({s.value: w for s, w in reward.weights().items()}),
            input_keys=tuple(keys.values()), output_keys=(scored.output_key,),
            input_key_remap={graph: key for key, graph in keys.items() if graph != key},
            output_key_remap=({"rewards": scored.output_key}
                              if scored.output_key != "rewards" else {}),
            batch_size=batch_size, microbatch=microbatch[SUM_MFC],
        ))
    return mfcs


def rewards_producer(reward: RewardConfig) -> str:
    """The MFC that writes `rewards` (where a rollout filter goes)."""
    return SUM_MFC if reward.needs_sum() else SOURCE_MFCS[reward.sources[0]].name


def reward_roles(reward: RewardConfig, policy: ModelRoleConfig,
                 reward_model: ModelRoleConfig) -> dict[str, ModelSpec]:
    """The roles the reward MFCs run on: `reward` (no weights, the policy's tokenizer) and
    `rm` (the reward model, frozen), each only where a source needs it."""
    roles = {}
    if reward.needs_sum() or {RewardSource.rule, RewardSource.remote} & set(reward.sources):
        roles[RULE_ROLE] = ModelSpec(RULE_ROLE, ModelKind.rule, policy)
    if RewardSource.model in reward.sources:
        roles[MODEL_ROLE] = ModelSpec(MODEL_ROLE, ModelKind.critic, reward_model)
    return roles
