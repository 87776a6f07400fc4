"""What an experiment declares: model roles, MFCs, the dataset, plus shared config sections.

An experiment's config dataclass (registered with `@register_experiment`) turns itself into an
`ExperimentSpec` with `build()`. The spec is plain data: the launcher validates it, the master
runs its graph, and each model worker receives the part it hosts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from realrl.api.config import DType, InertKeys, help_field
from realrl.api.dfg import DataflowGraph, MFCDef, MicroBatchSpec
from realrl.api.lora import LoRAConfig, role_lora_problems

# What an empty `<role>.path` loads (`realrl.launcher.preflight.resolve_model_paths`): the class's
# help names the common case; experiments whose roles start elsewhere say so in `key_help`.
WARM_START_PATH_HELP = (
    "Local Hugging Face checkpoint directory; empty: realrl's default actor, the built-in tiny "
    "model after realrl's own `sft` on the built-in arithmetic data (the SFT warm start, "
    "realrl/assets/default-actor-v1)."
)
TOOL_WARM_START_PATH_HELP = (
    "Local Hugging Face checkpoint directory; empty: ppo-agent's default actor, realrl's "
    "default actor after `sft` on tool-call transcripts of the built-in multiplication task "
    "(realrl/assets/default-agent-v1, docs/agentic.md)."
)
FRESH_MODEL_PATH_HELP = (
    "Local Hugging Face checkpoint directory; empty: the built-in tiny model (Qwen2 "
    "architecture, character tokenizer) with random weights: training starts from scratch."
)


def linked_path_help(source_role: str, note: str = "") -> str:
    """`<role>.path` help of a role whose empty path takes `<source_role>.path`."""
    return f"Local Hugging Face checkpoint directory; empty: `{source_role}.path`{note}."


class LRScheduler(str, enum.Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class OptimizerBackendName(str, enum.Enum):
    """What computes a trained role's gradient sums and optimizer step
    (`realrl.workers.model_loading.resolve_optimizer_backend`)."""

    auto = "auto"
    torch = "torch"
    megatron = "megatron"


@dataclass
class OptimizerConfig:
    lr: float = help_field(1e-5, "Peak learning rate of AdamW.")
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    beta1: float = help_field(0.9, "AdamW beta1.")
    beta2: float = help_field(0.999, "AdamW beta2.")
    eps: float = help_field(1e-8, "AdamW epsilon.")
    lr_scheduler: LRScheduler = help_field(LRScheduler.constant, "constant | linear | cosine decay.")
    warmup_steps_proportion: float = help_field(
        0.0, "Fraction of all optimizer steps spent in linear warm-up from 0."
    )
    min_lr_ratio: float = help_field(0.0, "Final learning rate of linear/cosine decay, over lr.")
    gradient_clipping: float = help_field(1.0, "Max global gradient norm (0 disables clipping).")
    backend: OptimizerBackendName = help_field(
        OptimizerBackendName.auto, "Who sums gradients over data-parallel ranks and steps AdamW. "
        "torch: torch.optim.AdamW on every rank, gradients summed in fp32 buckets (in shared "
        "memory between the CPU ranks of one machine); every rank holds the whole optimizer "
        "state (bf16 weights 2 + fp32 masters 4 + gradients 4 + moments 8 = 18 bytes per "
        "parameter; fp32 16). megatron: megatron-core's DistributedDataParallel (fp32 "
        "gradient reduce-scatter overlapped with the backward) and DistributedOptimizer (fp32 "
        "masters and AdamW moments sharded over the d data-parallel ranks: bf16 2 + 4 + 12/d, "
        "fp32 8 + 8/d bytes per parameter); CUDA workers only; a resume needs the same "
        "layout. auto: megatron on CUDA workers, torch on CPU. Same update either way."
    )

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.lr < 0:
            problems.append(f"`{prefix}.lr={self.lr}` must be >= 0.")
        if not 0.0 <= self.warmup_steps_proportion <= 1.0:
            problems.append(
                f"`{prefix}.warmup_steps_proportion={self.warmup_steps_proportion}` must be in [0, 1]."
            )
        if self.gradient_clipping < 0:
            problems.append(f"`{prefix}.gradient_clipping={self.gradient_clipping}` must be >= 0.")
        if self.weight_decay < 0:
            problems.append(f"`{prefix}.weight_decay={self.weight_decay}` must be >= 0.")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"`{prefix}.{name}={getattr(self, name)}` must be in [0, 1).")
        if not self.eps > 0:
            problems.append(f"`{prefix}.eps={self.eps}` must be > 0 (AdamW's default is 1e-8).")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"`{prefix}.min_lr_ratio={self.min_lr_ratio}` must be in [0, 1].")
        return problems


@dataclass
class ModelRoleConfig:
    """One model role: where its weights come from and how it is trained."""

    path: str = help_field(
        "", WARM_START_PATH_HELP
    )
    dtype: DType | None = help_field(
        None, "Parameter dtype of this role; null: the dtype of the role it is initialised "
        "from (ppo-math's ref and critic, dpo's ref: actor's), else the run-wide `dtype` "
        "(float32 unless set). bfloat16 memory and fp32 master weights: see `dtype`.",
    )
    offload: bool = help_field(
        False, "Frozen models only: move the weights to host memory after each use (frees GPU "
        "memory between calls; nothing to free on CPU)."
    )
    optimizer: OptimizerConfig = help_field(OptimizerConfig(), "Optimizer (trained roles only).")
    compile: bool = help_field(
        False, "torch.compile the transformer blocks (norms, rotary, SwiGLU, residuals; attention "
        "stays eager) of this role's training and inference forwards; the decode step has "
        "gen.compile. On 2 CPU cores, 4M-parameter model: forward+backward 1.15-1.18x faster, "
        "actor_train ~1.1x, after ~5 s of compiling in the first step (~30 s with a cold "
        "inductor cache). Ignored with tensor parallelism; needs a C++ compiler on CPU."
    )
    gradient_checkpointing: bool = help_field(
        False, "Activation checkpointing: a training forward keeps only each transformer "
        "block's input and the backward recomputes the block (torch.utils.checkpoint, "
        "non-reentrant), for about one more forward of compute. Works with `compile` and "
        "tensor parallelism, on CPU and GPU; same losses and gradients. A layer keeps ~5 x "
        "hidden values per token instead of ~28 x hidden (the fused LM head keeps no logits). CPU, "
        "hidden 256, 2048 tokens: 10 layers 620 -> 222 MB per train step, 1.3x its time."
    )
    sequence_parallel: bool = help_field(
        False, "Sequence parallelism (Korthikanti et al. 2022, megatron-core's) in this role's "
        "tensor-parallel layouts: norms and residual adds run on tokens / tp rows per rank, the "
        "column-parallel linears all-gather the tokens and the row-parallel ones "
        "reduce-scatter them, so the ~6 x hidden values per token and layer that tensor "
        "parallelism keeps on every rank (the two norms' inputs and outputs) are divided by tp. "
        "Cost: the backward all-gathers each column-parallel input again (2 more all-gathers "
        "per layer); the forward moves what tp's all-reduces did. Same results. "
        "GPU workers only (megatron-core allocates its buffers on the GPU); needs an MFC of "
        "the role with tp > 1, and layouts with tp = 1 run without it."
    )
    share_prefixes: bool = help_field(
        True, "Training and inference forwards run the tokens that consecutive packed sequences "
        "share from their start (a prompt sampled group_size times, a pair's prompt) once; "
        "attention still sees each sequence whole, and logits and gradients are the same up to "
        "float rounding. GRPO benchmark (9-token prompts, 4 x 32-token responses): actor "
        "forward+backward ~15% faster."
    )
    lora: LoRAConfig = help_field(
        LoRAConfig(), "LoRA adapters (trained roles): train low-rank factors beside frozen "
        "weights instead of the weights (`realrl.api.lora`)."
    )

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        return self.lora.inert_keys(f"{prefix}.lora")

    def lora_problems(self, prefix: str) -> list[str]:
        """`lora` keys this role cannot run with (`BaseExperimentConfig.validate` asks every
        role section)."""
        return role_lora_problems(self, prefix)


@dataclass
class MFCConfig:
    """Per-MFC execution settings."""

    max_tokens_per_microbatch: int | None = help_field(
        None, "Token budget of one micro-batch on one data-parallel rank; null: no budget (the "
        "rank's whole share of a mini-batch in one forward). Activation memory grows with it, "
        "per token: ~(16 x hidden + 4 x intermediate) values per layer in training; 4 bytes per "
        "value in float32, 2 in bfloat16. The LM head is fused with the log-softmax and "
        "computed in chunks of rows, so the vocabulary adds a fixed few MB, not logits per "
        "token. Workers log a value for it when a call nears their memory "
        "(`worker_memory_gb`). The update is the same up to float rounding."
    )
    min_num_microbatches: int = help_field(1, "At least this many micro-batches per rank.")

    def microbatch_spec(self) -> MicroBatchSpec:
        return MicroBatchSpec(self.max_tokens_per_microbatch, self.min_num_microbatches)

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            problems.append(
                f"`{prefix}.max_tokens_per_microbatch={self.max_tokens_per_microbatch}` must be "
                f">= 1 or null."
            )
        if self.min_num_microbatches < 1:
            problems.append(f"`{prefix}.min_num_microbatches={self.min_num_microbatches}` must be >= 1.")
        return problems


class DatasetKind(str, enum.Enum):
    prompt = "prompt"  # RL: {"prompt", "answer" | "solutions", "task", "input_output"?}
    sft = "sft"  # {"prompt", "answer"}
    paired = "paired"  # {"prompt", "pos_answers", "neg_answers"}
    chat = "chat"  # RLHF: {"prompt" | "messages", "answer"?, ...}; no answer needed


# The built-in arithmetic data (`realrl.workers.data_source`): one seeded pool, cut into a
# training split (its first `dataset.builtin_train_size` problems are served) and an eval split
# of this many other problems, which no training run reads.
BUILTIN_EVAL_SIZE = 256


class BuiltinSplit(str, enum.Enum):
    train = "train"
    eval = "eval"


class BuiltinTask(str, enum.Enum):
    arithmetic = "arithmetic"  # one- and two-digit + and -: the single-turn task
    multiplication = "multiplication"  # two- and three-digit products: the agentic task


@dataclass
class DatasetConfig:
    path: str = help_field("", "JSONL file; empty: the built-in synthetic arithmetic data.")
    batch_size: int = help_field(16, "Samples (prompts or pairs) per training step.")
    max_prompt_len: int | None = help_field(
        None, "Prompt records (ppo-math, gen): prompts with more tokens are dropped (counted in the "
        "log). null: the model's context (max_position_embeddings) minus gen.max_new_tokens, "
        "resolved at launch; a limit that lets prompt plus response pass the model's context is "
        "refused at launch."
    )
    max_seq_len: int | None = help_field(
        None, "SFT and paired records (sft, rw, dpo): records with a longer sequence (prompt, "
        "completion and EOS) are dropped (counted in the log). null: the model's context "
        "(max_position_embeddings), resolved at launch; a longer limit is refused at launch."
    )
    builtin_train_size: int = help_field(
        4096, "With an empty path: how many built-in arithmetic problems form the training set."
    )
    builtin_split: BuiltinSplit = help_field(
        BuiltinSplit.train, "With an empty path: train (the first builtin_train_size problems) "
        "or eval (256 other problems of the same pool, which no training run reads: "
        "`gen dataset.builtin_split=eval` evaluates a trained policy on problems it never saw)."
    )
    builtin_task: BuiltinTask = help_field(
        BuiltinTask.arithmetic, "With an empty path: arithmetic (one- and two-digit sums and "
        "differences) or multiplication (two- and three-digit products, where a calculator "
        "tool pays: ppo-agent's task, docs/agentic.md)."
    )
    apply_chat_template: bool | None = help_field(
        None, "Format prompts with the tokenizer's chat template: each prompt becomes one user "
        "turn plus the assistant header (as `apply_chat_template(..., add_generation_prompt="
        "True)`; no BOS added twice), and SFT/RW/DPO answers end with the template's "
        "end-of-turn token (e.g. <|im_end|>). null: apply it when the tokenizer has one (the "
        "built-in model's has none); true: require one; false: use prompts as they are."
    )

    def builtin_size(self) -> int:
        """How many records the built-in data serves (with an empty path)."""
        if self.builtin_split == BuiltinSplit.eval:
            return BUILTIN_EVAL_SIZE
        return self.builtin_train_size

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        if not self.path:
            return []
        return [InertKeys(tuple(f"{prefix}.{name}" for name in ("builtin_train_size",
                                                                "builtin_split", "builtin_task")),
                          f"with `{prefix}.path` set (the built-in data is not read)",
                          f"empty {prefix}.path")]

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.batch_size < 1:
            problems.append(f"`{prefix}.batch_size={self.batch_size}` must be >= 1.")
        if not 1 <= self.builtin_train_size <= 4096:
            problems.append(
                f"`{prefix}.builtin_train_size={self.builtin_train_size}` must be in [1, 4096]."
            )
        for name in ("max_prompt_len", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"`{prefix}.{name}={value}` must be >= 1, or null for the "
                                "model's context.")
        return problems


class ModelKind(str, enum.Enum):
    lm = "lm"  # causal language model with an LM head
    critic = "critic"  # the same trunk with a scalar value head
    rule = "rule"  # no weights: a rule-based reward (math/code verifiers)


@dataclass(frozen=True)
class ModelSpec:
    """A model role as the runtime sees it."""

    role: str
    kind: ModelKind
    config: ModelRoleConfig | None = None  # None for rule-based roles
    trainable: bool = False
    # The role whose base weights this role's layouts use, with that role's LoRA adapter off
    # and no copy of their own (ppo-math's reference of an actor with adapters); None: the
    # role loads `config.path` itself. `config.lora` then describes an adapter of its own
    # (an EMA reference), or none.
    shares_base_with: str | None = None

    def config_key(self, key: str) -> str:
        """The dotted config key of this role's `key`; the built-in single-model experiments
        (sft, rw, gen) name their "default" role `model`."""
        return f"{'model' if self.role == 'default' else self.role}.{key}"

    def megatron_without_cuda(self, device_type: str) -> str | None:
        """The problem of `<role>.optimizer.backend=megatron` for a trained role on workers
        that compute on `device_type` (None: no problem)."""
        if (not self.trainable or device_type == "cuda" or self.config is None
                or self.config.optimizer.backend != OptimizerBackendName.megatron):
            return None
        key = self.config_key("optimizer.backend")
        return (
            f"`{key}=megatron` needs CUDA workers (megatron-core's DistributedDataParallel and "
            f"DistributedOptimizer allocate on the GPU), and the workers compute on "
            f"{device_type}: set `{key}=auto` (megatron on GPUs, torch on CPUs) or `{key}=torch`"
        )

    def sequence_parallel_without_cuda(self, device_type: str) -> str | None:
        """The problem of `<role>.sequence_parallel=true` on workers that compute on
        `device_type` (None: no problem)."""
        if (device_type == "cuda" or self.kind == ModelKind.rule or self.config is None
                or not self.config.sequence_parallel):
            return None
        key = self.config_key("sequence_parallel")
        return (
            f"`{key}=true` needs CUDA workers (megatron-core's sequence-parallel layers "
            f"allocate their all-gather and reduce-scatter buffers on the GPU), and the "
            f"workers compute on {device_type}: set `{key}=false`"
        )


@dataclass(frozen=True)
class RolloutFilter:
    """Applied to the step's batch right after `after_mfc` (and the MFCs it depends on): keep the
    `group_size` best responses per prompt by `reward_key` (best-of-n), and with
    `drop_equal_reward_groups` drop prompts whose rewards all agree and generate for more
    prompts, at most `max_rounds` times, until the batch is full again (DAPO)."""

    after_mfc: str
    reward_key: str = "rewards"
    group_size: int = 1
    drop_equal_reward_groups: bool = False
    max_rounds: int = 1


@dataclass
class ExperimentSpec:
    models: dict[str, ModelSpec]
    mfcs: list[MFCDef]
    dataset_kind: DatasetKind
    dataset_keys: tuple[str, ...]
    notes: list[str] = field(default_factory=list)  # printed by --dry-run (e.g. dropped MFCs)
    rollout_filter: RolloutFilter | None = None

    def graph(self) -> DataflowGraph:
        return DataflowGraph(self.mfcs, self.dataset_keys, self.models)
