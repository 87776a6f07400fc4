"""ppo-math: PPO-family RL on math (and code) prompts with verifiable rewards.

Six MFCs with the default rule reward, edges from their keys:

    actor_gen ──packed_input_ids──► rew_inf, ref_inf, critic_inf, actor_train, critic_train
    rew_inf ──rewards──► actor_train, critic_train
    ref_inf ──packed_ref_logprobs──► actor_train, critic_train
    critic_inf ──values──► actor_train, critic_train

`reward.sources` swaps `rew_inf` for a reward model (`rm_inf` on role `rm`), an HTTP reward
service (`remote_inf`), or a weighted sum of several (`reward_sum`; see
`realrl.experiments.reward_graph`). `ppo.disable_value=true` drops the critic MFCs,
`ppo.kl_ctl=0` drops `ref_inf`, and
`ref_ema_eta` adds an EMA post-hook on `actor_train` that moves the reference toward the actor.
With `ppo.reuse_forward` and one optimizer step per call, `actor_train`'s forward starts as
soon as `packed_input_ids` exists (`forward_keys`), and `critic_inf`'s forward is the critic's
training forward.

With `actor.lora.rank > 0` the reference is the actor's base (the checkpoint both start from)
with the adapter off: the `ref` role then shares the actor's base weights
(`ModelSpec.shares_base_with`) and holds none of its own, as LlamaFactory's PPO does. With
`ref_ema_eta` it gets an adapter of its own, which the EMA hook moves toward the actor's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from realrl.api.config import BaseExperimentConfig, help_field
from realrl.api.dfg import MFCDef, MFCKind, OffloadHook, ParamReallocHook
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    ExperimentSpec,
    MFCConfig,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    OptimizerConfig,
    RolloutFilter,
    linked_path_help,
)
from realrl.api.registry import register_experiment
from realrl.api.reward_config import REWARD_SECTION_ENABLERS, RewardConfig, RewardSource
from realrl.api.rl_config import (
    GROUP_ESTIMATORS,
    GenerationHyperparameters,
    PPOHyperparameters,
    vllm_config_problems,
)
from realrl.experiments.reward_graph import (
    ScoredSequences,
    reward_mfcs,
    reward_roles,
    rewards_producer,
)
from realrl.interfaces.configs import PPOActorConfig, PPOCriticConfig, ReferenceConfig

PROMPT_KEYS = ("packed_prompts",)
ROLLOUT_KEYS = ("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask")
WEIGHT_VERSIONS_KEY = "packed_weight_versions"  # per token, shifted; -1 before prompt tokens


@register_experiment("ppo-math")
@dataclass
class PPOMathConfig(BaseExperimentConfig):
    """RL (PPO, GRPO, Dr.GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++, ReMax) on math/code."""

    key_help: ClassVar[dict[str, str]] = {
        "critic.path": linked_path_help("actor", ", with a zero-initialised value head"),
        "ref.path": linked_path_help("actor"),
        "rm.path": linked_path_help(
            "actor", ", with a zero-initialised value head, which scores every response 0: set "
            "it to an `rw` run's checkpoint"
        ),
    }
    dataset_kind: ClassVar[DatasetKind] = DatasetKind.prompt
    section_enablers: ClassVar[dict[str, str]] = REWARD_SECTION_ENABLERS | {
        section: "`ppo.disable_value=false`" for section in ("critic", "critic_inf", "critic_train")
    } | {"ref": "`ppo.kl_ctl` > 0", "ref_inf": "`ppo.kl_ctl` > 0"}

    actor: ModelRoleConfig = help_field(
        ModelRoleConfig(optimizer=OptimizerConfig(lr=2e-4)), "The policy."
    )
    critic: ModelRoleConfig = help_field(
        ModelRoleConfig(optimizer=OptimizerConfig(lr=1e-4)),
        "The value model; path empty: initialised from actor.path with a fresh value head.",
    )
    ref: ModelRoleConfig = help_field(
        ModelRoleConfig(), "The frozen reference policy; path empty: actor.path."
    )
    rm: ModelRoleConfig = help_field(
        ModelRoleConfig(), "The reward model of `reward.sources=[model]` (frozen): an `rw` run's "
        "checkpoint, e.g. runs/rw/trial0/checkpoints/latest/default."
    )
    dataset: DatasetConfig = help_field(
        DatasetConfig(batch_size=16, builtin_train_size=256), "Prompts."
    )
    group_size: int = help_field(
        8, "Responses per prompt that enter training; at least 2 for the estimators with a "
        "group baseline (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline).")
    generation_size: int | None = help_field(
        None, "Responses generated per prompt; > group_size keeps the best (best-of-n)."
    )
    total_train_steps: int = help_field(400, "Number of training steps (graph executions).")
    ref_ema_eta: float | None = help_field(
        None, "After each actor_train: ref = eta * actor + (1 - eta) * ref; null: frozen ref."
    )
    gen: GenerationHyperparameters = help_field(
        GenerationHyperparameters(max_new_tokens=8), "Generation."
    )
    ppo: PPOHyperparameters = help_field(PPOHyperparameters(), "PPO-family hyperparameters.")
    reward: RewardConfig = help_field(
        RewardConfig(), "Where rewards come from: rule, model, remote, or a weighted sum "
        "(docs/rewards.md)."
    )
    actor_gen: MFCConfig = help_field(MFCConfig(), "MFC actor_gen.")
    rew_inf: MFCConfig = help_field(MFCConfig(), "MFC rew_inf (reward.sources has rule).")
    rm_inf: MFCConfig = help_field(MFCConfig(), "MFC rm_inf (reward.sources has model).")
    remote_inf: MFCConfig = help_field(MFCConfig(), "MFC remote_inf (reward.sources has remote).")
    reward_sum: MFCConfig = help_field(
        MFCConfig(), "MFC reward_sum (several reward sources, or a weight other than 1)."
    )
    ref_inf: MFCConfig = help_field(MFCConfig(), "MFC ref_inf.")
    critic_inf: MFCConfig = help_field(MFCConfig(), "MFC critic_inf.")
    actor_train: MFCConfig = help_field(MFCConfig(), "MFC actor_train.")
    critic_train: MFCConfig = help_field(MFCConfig(), "MFC critic_train.")

    def _remax_baseline_mfcs(self, actor_config: PPOActorConfig) -> list[MFCDef]:
        """ReMax (Li et al. 2023): one greedy response per prompt, scored by the same reward,
        is the baseline. More MFCs on the same roles, wired by key remaps."""
        greedy_config = dataclasses.replace(
            actor_config, group_size=1, generation_size=1,
            generation=dataclasses.replace(self.gen, greedy=True),
        )
        greedy_keys = {"packed_input_ids": "greedy_input_ids", "prompt_mask": "greedy_prompt_mask",
                       "packed_logprobs": "greedy_logprobs", "seq_no_eos_mask": "greedy_no_eos"}
        greedy = ScoredSequences("baseline_rewards", renamed=greedy_keys, suffix="_greedy",
                                 prefix="greedy_")
        generate = MFCDef(name="actor_gen_greedy", model_role="actor", kind=MFCKind.generate,
                          interface="ppo_actor", interface_config=greedy_config,
                          input_keys=PROMPT_KEYS, output_keys=tuple(greedy_keys.values()),
                          output_key_remap=greedy_keys, batch_size=self.dataset.batch_size,
                          microbatch=self.actor_gen.microbatch_spec())
        return [generate, *reward_mfcs(self.reward, self.dataset.batch_size,
                                       self._reward_microbatches(), greedy, self.rm.offload)]

    def _actor_config(self) -> PPOActorConfig:
        """The actor interface's config of actor_gen and actor_train (ppo-agent adds its
        episode)."""
        return PPOActorConfig(
            ppo=self.ppo,
            generation=self.gen,
            group_size=self.group_size,
            generation_size=self.generation_size or self.group_size,
        )

    def _reward_microbatches(self):
        return {name: getattr(self, name).microbatch_spec()
                for name in ("rew_inf", "rm_inf", "remote_inf", "reward_sum")}

    def model_path_links(self) -> dict[str, str]:
        """Empty paths of these roles take the path of another role."""
        return {"critic": "actor", "ref": "actor", "rm": "actor"}

    def reference_shares_actor_base(self) -> bool:
        """Whether the reference is the actor's base weights with its adapter off: the actor
        has LoRA adapters and the reference would load the same weights in the same dtype."""
        return (self.actor.lora.enabled and self.ppo.kl_ctl > 0
                and self.ref.path in ("", self.actor.path) and self.ref.dtype == self.actor.dtype)

    def _lora_problems(self) -> list[str]:
        problems = []
        if self.ref.lora.enabled:
            problems.append(f"`ref.lora.rank={self.ref.lora.rank}`: the reference does not "
                            "train; with `actor.lora.rank` > 0 it is the actor's base with the "
                            "adapter off. Set `ref.lora.rank=0`.")
        if not self.reference_shares_actor_base():
            if self.actor.lora.enabled and self.ref_ema_eta is not None and self.ppo.kl_ctl > 0:
                problems.append("`ref_ema_eta` with `actor.lora.rank` > 0 blends the actor's "
                                "adapter into one of the reference's, on the actor's base: "
                                "leave `ref.path` empty (or the actor's) and `ref.dtype` null "
                                "(or the actor's).")
            return problems
        if self.ref.offload:
            problems.append("`ref.offload=true` with `actor.lora.rank` > 0: the reference is the "
                            "actor's base weights, which offloading would move from under the "
                            "actor; set `ref.offload=false`.")
        return problems

    def validate(self) -> list[str]:
        problems = super().validate()
        problems += self._lora_problems()
        problems += self.dataset.validate("dataset") + self.gen.validate("gen")
        problems += self.ppo.validate("ppo") + self.reward.validate("reward")
        problems += vllm_config_problems(
            "gen", self.gen, async_rollout=self.rollout.is_async,
            episodes=self._actor_config().episode.enabled, lora_key="actor.lora.rank",
            lora_rank=self.actor.lora.rank or 0)
        problems += self.actor.optimizer.validate("actor.optimizer")
        problems += self.critic.optimizer.validate("critic.optimizer")
        for name in ("actor_gen", "rew_inf", "rm_inf", "remote_inf", "reward_sum", "ref_inf",
                     "critic_inf", "actor_train", "critic_train"):
            problems += getattr(self, name).validate(name)
        for role in ("actor", "critic"):
            if getattr(self, role).offload:
                problems.append(f"`{role}.offload=true`: only frozen models (ref) are offloaded.")
        if self.group_size < 1:
            problems.append(f"`group_size={self.group_size}` must be >= 1.")
        if self.group_size == 1 and self.ppo.adv_estimator in GROUP_ESTIMATORS:
            problems.append(
                f"`group_size=1` with `ppo.adv_estimator={self.ppo.adv_estimator}`: its baseline "
                "is the mean reward of each prompt's group_size responses, so with one response "
                "each reward is its own baseline and no reward reaches the policy; set "
                "group_size to 2 or more (e.g. 8), or use an estimator without a group baseline "
                "(reinforce_plus_plus, remax, or gae with ppo.disable_value=false).")
        if self.group_size == 1 and self.ppo.dynamic_sampling:
            problems.append(
                "`ppo.dynamic_sampling=true` with `group_size=1`: it drops every prompt whose "
                "responses all get the same reward, which one response always does; set "
                "group_size to 2 or more, or ppo.dynamic_sampling=false.")
        if self.generation_size is not None and self.generation_size < self.group_size:
            problems.append(
                f"`generation_size={self.generation_size}` must be >= `group_size={self.group_size}`."
            )
        if self.ppo.prox_logp == "interpolate" and not self.rollout.is_async:
            problems.append("`ppo.prox_logp=interpolate` needs each token's weight version, which "
                            "only `rollout.mode=async` records; set rollout.mode=async or "
                            "ppo.prox_logp=forward.")
        if self.ref_ema_eta is not None and not 0 < self.ref_ema_eta <= 1:
            problems.append(f"`ref_ema_eta={self.ref_ema_eta}` must be in (0, 1] or null.")
        if self.ref_ema_eta is not None and self.ppo.kl_ctl == 0:
            problems.append("`ref_ema_eta` is set but `ppo.kl_ctl=0` drops the reference model.")
        if self.dataset.batch_size % self.ppo.num_minibatches:
            problems.append(
                f"`ppo.num_minibatches={self.ppo.num_minibatches}` must divide "
                f"`dataset.batch_size={self.dataset.batch_size}`."
            )
        return problems

    def _notes(self, use_critic: bool, use_ref: bool, rollout_filter: RolloutFilter | None,
               generation_size: int) -> list[str]:
        """What `--dry-run` says about the graph beside it: dropped MFCs, a reward model that
        cannot score, the rollout filter."""
        notes = []
        if not use_critic:
            notes.append("ppo.disable_value=true: critic_inf and critic_train are not in the graph.")
        if not use_ref:
            notes.append("ppo.kl_ctl=0: ref_inf is not in the graph.")
        if use_ref and self.reference_shares_actor_base():
            notes.append(
                f"actor.lora.rank={self.actor.lora.rank}: ref_inf runs the actor's base weights "
                "with its adapter off (no copy of its own)"
                + (", plus an adapter of its own that ref_ema_eta moves toward the actor's"
                   if self.ref_ema_eta is not None else ""))
        if RewardSource.model in self.reward.sources and self.rm.path in ("", self.actor.path):
            notes.append("rm.path is actor.path (or empty): the reward model is the policy with "
                         "a zero-initialised value head, which scores every response 0; set "
                         "rm.path to an `rw` run's checkpoint.")
        ppo = self.ppo
        if ppo.policy_loss == "gspo" and (ppo.eps_clip > 0.01
                                          or ppo.loss_agg_mode != "seq-mean-token-mean"):
            notes.append(
                f"ppo.policy_loss=gspo with ppo.eps_clip={ppo.eps_clip}, "
                f"ppo.loss_agg_mode={ppo.loss_agg_mode}: GSPO's paper clips a sequence's ratio "
                "(the geometric mean of its tokens', which spreads far less than one token's) "
                "to 3e-4 / 4e-4 and averages per sequence; set ppo.eps_clip=3e-4 "
                "ppo.eps_clip_high=4e-4 ppo.loss_agg_mode=seq-mean-token-mean to follow it.")
        if rollout_filter is not None:
            notes.append(
                f"rollout filter after {rollout_filter.after_mfc}: keep the best {self.group_size} of "
                f"{generation_size} responses per prompt"
                + (", drop prompts whose rewards all agree and refill (dynamic sampling)"
                   if self.ppo.dynamic_sampling else "")
            )
        return notes

    def build(self) -> ExperimentSpec:
        use_critic = not self.ppo.disable_value
        use_ref = self.ppo.kl_ctl > 0
        batch_size = self.dataset.batch_size
        train_inputs = ROLLOUT_KEYS + ("rewards",)
        train_inputs += ("packed_ref_logprobs",) if use_ref else ()
        train_inputs += ("values",) if use_critic else ()
        train_inputs += ("baseline_rewards",) if self.ppo.adv_estimator == "remax" else ()
        # An asynchronous rollout records each token's weight version (interruptible generation,
        # `realrl.workers.chunked_generation`); the interpolated proximal log-probs read it.
        gen_outputs = ROLLOUT_KEYS
        if self.rollout.is_async:
            gen_outputs += (WEIGHT_VERSIONS_KEY,)
            if self.ppo.decoupled_loss and self.ppo.prox_logp == "interpolate":
                train_inputs += (WEIGHT_VERSIONS_KEY,)
        actor_config = self._actor_config()

        def mfc(name, role, kind, interface, config, inputs, outputs, **extra):
            return MFCDef(name=name, model_role=role, kind=kind, interface=interface,
                          interface_config=config, input_keys=inputs, output_keys=outputs,
                          batch_size=batch_size,
                          microbatch=getattr(self, name).microbatch_spec(), **extra)

        actor_train_hooks = []
        if use_ref and self.ref_ema_eta is not None:
            actor_train_hooks.append(ParamReallocHook("actor", "ref", eta=self.ref_ema_eta))
        generation_size = self.generation_size or self.group_size
        # actor_train's forward goes out beside ref_inf and critic_inf; without either, there
        # is nothing to run beside (GRPO), and sending it ahead would only cost a request.
        ahead = self.ppo.reuses_forward() and (use_ref or use_critic)
        forward_keys = ("packed_input_ids",) if ahead else ()
        rollout_filter = None
        if generation_size > self.group_size or self.ppo.dynamic_sampling:
            rollout_filter = RolloutFilter(
                after_mfc=rewards_producer(self.reward), group_size=self.group_size,
                drop_equal_reward_groups=self.ppo.dynamic_sampling,
                max_rounds=self.ppo.max_generation_rounds if self.ppo.dynamic_sampling else 1,
            )
        # actor_gen returns every generated response; the rollout filter keeps group_size.
        gen_config = dataclasses.replace(actor_config, group_size=generation_size)
        mfcs = [
            mfc("actor_gen", "actor", MFCKind.generate, "ppo_actor", gen_config, PROMPT_KEYS,
                gen_outputs),
            *reward_mfcs(self.reward, batch_size, self._reward_microbatches(),
                         offload_reward_model=self.rm.offload),
            mfc("actor_train", "actor", MFCKind.train_step, "ppo_actor", actor_config,
                train_inputs, (), post_hooks=actor_train_hooks,
                forward_keys=forward_keys),
        ]
        if self.ppo.adv_estimator == "remax":
            mfcs += self._remax_baseline_mfcs(actor_config)
        if use_ref:
            mfcs.append(mfc("ref_inf", "ref", MFCKind.inference, "reference", ReferenceConfig(),
                            ("packed_input_ids",), ("packed_ref_logprobs",),
                            post_hooks=[OffloadHook()] if self.ref.offload else []))
        if use_critic:
            critic_config = PPOCriticConfig(ppo=self.ppo)
            mfcs.append(mfc("critic_inf", "critic", MFCKind.inference, "ppo_critic",
                            critic_config, ("packed_input_ids", "seq_no_eos_mask"), ("values",)))
            mfcs.append(mfc("critic_train", "critic", MFCKind.train_step, "ppo_critic",
                            critic_config, train_inputs, ()))
        models = {
            "actor": ModelSpec("actor", ModelKind.lm, self.actor, trainable=True),
            **reward_roles(self.reward, self.actor, self.rm),  # `reward`: the actor's tokenizer
        }
        if use_ref and self.reference_shares_actor_base():
            # The actor's base with its adapter off; with EMA, an adapter of its own.
            ref_config = (dataclasses.replace(self.ref, lora=self.actor.lora)
                          if self.ref_ema_eta is not None else self.ref)
            models["ref"] = ModelSpec("ref", ModelKind.lm, ref_config, shares_base_with="actor")
        elif use_ref:
            models["ref"] = ModelSpec("ref", ModelKind.lm, self.ref)
        if use_critic:
            models["critic"] = ModelSpec("critic", ModelKind.critic, self.critic, trainable=True)
        notes = self._notes(use_critic, use_ref, rollout_filter, generation_size)
        return ExperimentSpec(models, mfcs, self.dataset_kind, PROMPT_KEYS, notes,
                              rollout_filter)
