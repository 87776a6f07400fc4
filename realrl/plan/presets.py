"""Hypothetical workloads for the plan explorer (`python -m realrl.apps.plan`): model shapes
by name and the PPO and GRPO graphs of `realrl.experiments.ppo_math`, without a config.

PPO (ReaLHF's setting): actor_gen -> {rew_inf (a reward model the critic's size), ref_inf,
critic_inf} -> {actor_train, critic_train}. GRPO: actor_gen -> {reward (rule), ref_inf} ->
actor_train. With one PPO mini-batch, actor_train's forward runs ahead, beside the
inference calls.
"""

from __future__ import annotations

import dataclasses

from realrl.plan.costs import MFCWork, ModelShape, WorkKind

# Llama 2 7B/13B/70B and Code Llama 34B (the shapes ReaLHF's experiments use), Qwen2.5-0.5B
# (benchmarks/README.md's GPU runs) and realrl's built-in tiny model.
MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(4, 128, 384, 4, 2, 52, tied_embeddings=True),
    "0.5b": ModelShape(24, 896, 4864, 14, 2, 151936, tied_embeddings=True),
    "7b": ModelShape(32, 4096, 11008, 32, 32, 32000),
    "13b": ModelShape(40, 5120, 13824, 40, 40, 32000),
    "34b": ModelShape(48, 8192, 22016, 64, 8, 32000),
    "70b": ModelShape(80, 8192, 28672, 64, 8, 32000),
}


def model_shape(name: str) -> ModelShape:
    if name not in MODEL_SHAPES:
        raise KeyError(f"unknown model size {name!r}; known: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


@dataclasses.dataclass(frozen=True)
class RLWorkload:
    algorithm: str = "ppo"  # ppo | grpo
    actor: str = "7b"
    critic: str = "7b"  # also the reward model's size (PPO)
    num_prompts: int = 512
    responses_per_prompt: int = 1
    prompt_tokens: int = 128
    generated_tokens: int = 384
    ppo_minibatches: int = 4
    dtype: str = "bfloat16"


def rl_graph(workload: RLWorkload) -> tuple[dict[str, MFCWork], dict[str, tuple[str, ...]]]:
    """(MFC name -> work, MFC name -> the MFCs it reads from) of `workload`'s step."""
    actor = model_shape(workload.actor)
    critic = dataclasses.replace(model_shape(workload.critic), value_head=True,
                                 tied_embeddings=False)
    sequences = workload.num_prompts * workload.responses_per_prompt

    def work(name: str, role: str, kind: WorkKind, model: ModelShape | None,
             **options) -> MFCWork:
        return MFCWork(name, role, kind, model, sequences, workload.prompt_tokens,
                       workload.generated_tokens, workload.dtype,
                       num_samples=workload.num_prompts, **options)

    trained = {"role_is_trained": True}
    optimizer = {"optimizer_steps": workload.ppo_minibatches, **trained}
    works = {"actor_gen": work("actor_gen", "actor", WorkKind.generate, actor, **trained)}
    if workload.algorithm == "ppo":
        works["rew_inf"] = work("rew_inf", "reward", WorkKind.inference, critic)
    elif workload.algorithm == "grpo":
        works["reward"] = work("reward", "reward", WorkKind.rule, None)
    else:
        raise KeyError(f"unknown algorithm {workload.algorithm!r}; known: ppo, grpo")
    works["ref_inf"] = work("ref_inf", "ref", WorkKind.inference, actor)
    if workload.algorithm == "ppo":
        works["critic_inf"] = work("critic_inf", "critic", WorkKind.inference, critic, **trained)
    # With one optimizer step a call, ppo-math sends actor_train's forward ahead
    # (`ppo.reuse_forward`), beside ref_inf (and critic_inf).
    ahead: tuple[str, ...] = ("actor_gen",) if workload.ppo_minibatches == 1 else ()
    works["actor_train"] = work("actor_train", "actor", WorkKind.train_step, actor,
                                forward_ahead_after=ahead, **optimizer)
    if workload.algorithm == "ppo":
        works["critic_train"] = work("critic_train", "critic", WorkKind.train_step, critic,
                                     **optimizer)
    rollout = tuple(name for name in works if name not in ("actor_gen", "actor_train",
                                                           "critic_train"))
    dependencies: dict[str, tuple[str, ...]] = {name: ("actor_gen",) for name in rollout}
    dependencies["actor_train"] = rollout
    if "critic_train" in works:
        dependencies["critic_train"] = rollout
    return works, dependencies
