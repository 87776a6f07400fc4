"""Typed configuration: one dataclass tree per experiment is the single source of truth.

A user sets values three ways, merged in this order onto the dataclass defaults:
YAML files (`--config file.yaml`), then `key=value` overrides in Hydra's syntax
(`actor.optimizer.lr=1e-5`, `gen.stop_token_ids=[2,3]`). The result is converted back to
the dataclasses with `OmegaConf.to_object`, validated once (every problem reported together),
written to the run directory, and shipped to workers as data.

Every field carries a help text in `field(metadata={"help": ...})`; `help_field` builds one.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from realrl.api.errors import UserFacingError


class ConfigError(UserFacingError, ValueError):
    """A user-facing configuration error; the message lists every problem found."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:  # one mistake, one line
            super().__init__(f"invalid configuration: {self.problems[0]}")
            return
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


def help_field(default: Any = dataclasses.MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field with a help text; mutable defaults go through `default_factory`."""
    metadata = {"help": help}
    if default is not dataclasses.MISSING and isinstance(default, (list, dict, set)):
        container: Any = default
        return field(default_factory=lambda: type(container)(container), metadata=metadata,
                     **kwargs)
    if default is not dataclasses.MISSING and dataclasses.is_dataclass(default):
        section: Any = default
        return field(default_factory=lambda: dataclasses.replace(section), metadata=metadata,
                     **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


class LaunchMode(str, enum.Enum):
    local = "local"
    slurm = "slurm"


class RecoverMode(str, enum.Enum):
    disabled = "disabled"
    auto = "auto"
    resume = "resume"


class NanPolicy(str, enum.Enum):
    stop = "stop"
    skip = "skip"


class WandbMode(str, enum.Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"
    auto = "auto"


@dataclass
class WandbConfig:
    mode: WandbMode = help_field(
        WandbMode.auto,
        "online | offline | disabled | auto (online when an API key is configured, else offline).",
    )
    project: str | None = help_field(None, "wandb project; defaults to experiment_name.")
    entity: str | None = help_field(None, "wandb entity (team or user).")
    group: str | None = help_field(None, "wandb run group; defaults to trial_name.")
    tags: list[str] = help_field([], "wandb tags.")


@dataclass
class LogConfig:
    per_sample_keys: list[str] = help_field(
        [],
        "Keys of the step's batch to log each step as `batch/<key>/mean`, `/std`, `/min` and "
        "`/max` over every value (e.g. `[rm_scores]`, a custom MFC's per-response scores); a key "
        "that no MFC and no dataset produces is an error at launch, which lists the valid ones.",
    )
    samples_per_step: int = help_field(
        4,
        "Generated responses logged per logged step (prompt, response, reward and every other "
        "per-response value) to samples.jsonl, wandb (a Table) and tensorboard (text); 0: off.",
    )
    samples_every_steps: int = help_field(
        10, "Log samples on step 1 and on every step divisible by this; 0: off."
    )

    def validate(self, prefix: str) -> list[str]:
        problems = [f"`{prefix}.{name}={getattr(self, name)}` must be >= 0 (0: off)."
                    for name in ("samples_per_step", "samples_every_steps")
                    if getattr(self, name) < 0]
        repeated = sorted({key for key in self.per_sample_keys
                           if self.per_sample_keys.count(key) > 1})
        if repeated:
            problems.append(f"`{prefix}.per_sample_keys` names {repeated} more than once.")
        return problems


@dataclass
class SlurmConfig:
    partition: str | None = help_field(None, "sbatch --partition.")
    account: str | None = help_field(None, "sbatch --account.")
    qos: str | None = help_field(None, "sbatch --qos.")
    time_limit: str | None = help_field(None, "sbatch --time, e.g. '2-00:00:00'.")
    exclusive: bool = help_field(False, "sbatch --exclusive.")
    nodelist: str | None = help_field(None, "sbatch --nodelist.")
    exclude: str | None = help_field(None, "sbatch --exclude.")
    cpus_per_task: int | None = help_field(None, "CPUs per worker task (default: node CPUs / tasks).")
    mem_per_task_mb: int | None = help_field(None, "Memory per task in MB.")
    gpu_request: str = help_field(
        "auto", "How GPUs are requested: 'gres' (--gres=gpu:N), 'gpus' (--gpus-per-node=N), "
        "'none' (CPU-only nodes: n_devices_per_node is then worker processes per node), or "
        "'auto': 'gres' when `sinfo` lists a GPU GRES on the partition's nodes, else 'none' "
        "(resolved at launch; 'gres' where sinfo is not on PATH)."
    )
    container_image: str | None = help_field(None, "pyxis --container-image for every srun step.")
    singularity_image: str | None = help_field(None, "Run every task under `singularity exec`.")
    extra_sbatch_args: list[str] = help_field([], "Extra sbatch arguments, verbatim.")
    extra_srun_args: list[str] = help_field([], "Extra srun arguments, verbatim.")
    env: dict[str, str] = help_field({}, "Environment variables exported to every task.")
    poll_interval_s: float = help_field(2.0, "How often the launcher polls squeue/sacct.")
    python: str | None = help_field(
        None, "Python interpreter on the nodes (default: the launcher's own; 'python3' in a "
        "container)."
    )
    preempt_lead_s: int = help_field(
        300, "Seconds before the job's time limit at which SLURM sends the batch script USR1 "
        "(`#SBATCH --signal=B:USR1@N`; also at preemption where the cluster sets "
        "PreemptParameters=send_user_signal): the run finishes its step, writes a checkpoint "
        "and the job ends with exit code 75; with recover_mode=auto the launcher resubmits it. "
        "Must cover one step plus one checkpoint save. 0: no signal (the job is killed at its "
        "time limit)."
    )


class DType(str, enum.Enum):
    """Parameter dtypes of model roles. float16 is not offered: it trains only with loss
    scaling, which realrl does not do, and CPUs have no float16 matmuls."""

    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclass
class CheckpointConfig:
    weights_only: bool = help_field(
        False, "Save the weights (Hugging Face format), the learning-rate schedule, RNG state and "
        "data position, but no optimizer state (AdamW's two moments: twice the fp32 weights). "
        "recover_mode=auto|resume still resumes from such a checkpoint, at its step, data "
        "position and learning rate, with AdamW's moments starting again from zero (a warning "
        "says so), and a bf16 role's fp32 master weights start again from its bf16 weights: "
        "the next updates differ from an uninterrupted run's."
    )
    keep_last: int | None = help_field(
        2, "Keep the N newest complete checkpoints; an older one is deleted only once a newer "
        "one is complete, so a crash never leaves none. 0 or null: keep every checkpoint."
    )

    def validate(self, prefix: str) -> list[str]:
        if self.keep_last is not None and self.keep_last < 0:
            return [f"`{prefix}.keep_last={self.keep_last}` must be >= 1, or 0/null to keep all."]
        return []


@dataclass
class WatchdogConfig:
    """When the master stops a run that hangs (`realrl.workers.watchdog`)."""

    enabled: bool = help_field(
        True, "Stop the run, with a diagnosis in <run_dir>/logs/watchdog.txt (the late ranks, "
        "what each was doing, its Python stack, the end of its log), when an MFC call or "
        "weight transfer outlives its deadline or a model worker stops answering heartbeats "
        "(stopped, frozen, its machine gone). false: a hung run waits for ever."
    )
    deadline_multiple: float = help_field(
        10.0, "A call's deadline: this many times the median duration of the last 100 calls of "
        "the same MFC (or transfer, or checkpoint save), but never below min_deadline_s."
    )
    min_deadline_s: float = help_field(
        600.0, "No call that has run before is stopped sooner, however short its median (a "
        "recompilation for a new shape, a slow filesystem)."
    )
    warmup_calls: int = help_field(
        3, "The first N calls of each MFC, transfer or save have no median yet; they get "
        "warmup_deadline_s."
    )
    warmup_deadline_s: float = help_field(
        3600.0, "Deadline of the first warmup_calls calls: room for torch.compile, CUDA graph "
        "capture, NCCL set-up and a cold page cache."
    )
    heartbeat_interval_s: float = help_field(
        5.0, "How often the master pings every model worker; a thread of the worker answers, "
        "so a worker busy in a long call still answers."
    )
    heartbeat_timeout_s: float = help_field(
        120.0, "A worker that answers no ping for this long is hung (SIGSTOP, a frozen node, an "
        "interpreter lock held for ever) and the run stops. Time while the master itself could "
        "not run (a suspended job) does not count."
    )
    collective_timeout_s: float = help_field(
        1800.0, "torch.distributed timeout of every process group (gloo and NCCL): a collective "
        "whose peer never arrives raises (NCCL: ends the process) after this long instead of "
        "blocking for ever. Applies with enabled=false too."
    )

    def validate(self, prefix: str) -> list[str]:
        problems = [f"`{prefix}.{name}={getattr(self, name)}` must be > 0 (seconds)."
                    for name in ("min_deadline_s", "warmup_deadline_s", "heartbeat_interval_s",
                                 "heartbeat_timeout_s", "collective_timeout_s")
                    if not getattr(self, name) > 0]
        if self.deadline_multiple < 1:
            problems.append(f"`{prefix}.deadline_multiple={self.deadline_multiple}` must be >= 1: "
                            "below, a call slower than its median would stop the run; try 10.")
        if self.warmup_calls < 1:
            problems.append(f"`{prefix}.warmup_calls={self.warmup_calls}` must be >= 1 (the first "
                            "call of each MFC has no median).")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            problems.append(
                f"`{prefix}.heartbeat_timeout_s={self.heartbeat_timeout_s}` must be at least twice "
                f"`{prefix}.heartbeat_interval_s={self.heartbeat_interval_s}`, or one late ping "
                f"stops the run; try heartbeat_timeout_s={4 * self.heartbeat_interval_s:g}."
            )
        return problems


# `async` is a keyword, hence the functional form; OmegaConf parses members by name.
RolloutMode = enum.Enum("RolloutMode", [("sync", "sync"), ("async", "async")], type=str)


class KVCacheMode(str, enum.Enum):
    """What interruptible generation does with a running generation's KV cache when new
    weights arrive (`realrl.models.interruptible_generation`)."""

    recompute = "recompute"
    keep = "keep"


class BatchAssembly(str, enum.Enum):
    """Which finished groups an asynchronous step trains on (`realrl.workers.async_rollout`)."""

    data_order = "data_order"
    finished_first = "finished_first"


@dataclass(frozen=True)
class InertKeys:
    """Keys that do nothing in the configuration at hand: set away from its default, each is
    an error (`inert_key_problems`) that says `when` they do nothing and the `fix` that would
    make them count, e.g. `rollout.*` "with `rollout.mode=sync`", "set rollout.mode=async"."""

    keys: tuple[str, ...]  # dotted keys; one ending in "." covers its whole section
    when: str
    fix: str

    def covers(self, key: str) -> bool:
        return any(key == item or (item.endswith(".") and key.startswith(item))
                   for item in self.keys)


@dataclass
class RolloutConfig:
    """Synchronous rollouts, or AReaL-style asynchronous (streaming) ones
    (`realrl.workers.async_rollout`).

    With `mode=async` the master keeps the generation workers busy: it sends the rollout MFCs
    (every MFC but the train ones) one request at a time and trains each step on finished
    groups. `max_head_offpolicyness` is AReaL's admission rule (Fu et al. 2025, sec. 5.1): with
    `v` train steps done and `B = dataset.batch_size` prompt groups per step, a request starts
    only while at most `(eta + v + 1) * B` groups have been started in all (running, finished or
    trained), so a group trains at most `eta` steps after the weights that generated it.
    """

    mode: RolloutMode = help_field(
        RolloutMode.sync,
        "sync: each step generates its batch, then trains on it (with `pipeline_rollout=true` "
        "one batch ahead). async: the rollout MFCs run continuously on their own workers, one "
        "request per `rollout.groups_per_request` prompt groups, and each step trains on the "
        "next `dataset.batch_size` finished groups, in data order; how stale they may be is "
        "`rollout.max_head_offpolicyness`. Needs the rollout MFCs and the train MFCs on "
        "different workers (allocation_mode=auto does that).",
    )
    max_head_offpolicyness: int = help_field(
        1,
        "rollout.mode=async: the staleness bound eta. A request may start only while at most "
        "(eta + v + 1) * dataset.batch_size prompt groups have been started, v being the train "
        "steps done, so a group is trained at most eta steps after the weights that generated "
        "it. 0 is synchronous training (the same batches and, with one request a batch, the "
        "default `rollout.groups_per_request`, the same updates bit for bit).",
    )
    groups_per_request: int = help_field(
        0,
        "rollout.mode=async: prompt groups (prompts, each with its group_size responses) per "
        "rollout request; 0: dataset.batch_size, one request a batch. realrl's engine batches "
        "within a request, not across requests, so a batch in smaller requests costs more "
        "decode loops and round trips: on CPU four quarter-batch requests took up to twice "
        "one whole one, one group per request 4x (benchmarks/reward_time.md, 'Asynchronous "
        "rollouts'). Smaller ones let finished_first assembly skip slow groups and rewards "
        "start sooner; new weights reach generation between decode chunks either way "
        "(decode_steps_per_chunk). Must divide dataset.batch_size and be at least the rollout "
        "MFCs' data-parallel size.",
    )

    decode_steps_per_chunk: int = help_field(
        8,
        "rollout.mode=async: interruptible generation. Generation runs in chunks of this many "
        "decode steps, and the trainer's new weights reach a generation in flight between two "
        "chunks: it goes on under them, and every token records the version that chose it "
        "(`packed_weight_versions`). 0: each request generates to the end on the weights it "
        "started with. Each chunk costs one request to the generation workers.",
    )
    interrupt_kv_cache: KVCacheMode = help_field(
        KVCacheMode.recompute,
        "rollout.mode=async: when new weights reach a generation in flight, recompute: run the "
        "prompt and the tokens so far through them once to rebuild the KV cache (the next "
        "tokens are the new model's own); keep: keep the old weights' keys and values (no "
        "recomputation; the next tokens attend over them).",
    )

    assembly: BatchAssembly = help_field(
        BatchAssembly.data_order,
        "rollout.mode=async: which finished groups a step trains on. data_order: batch k is "
        "the data's k-th batch, once all its groups are finished (max_head_offpolicyness=0 is "
        "then synchronous training bit for bit). finished_first: the first dataset.batch_size "
        "groups to finish, as AReaL does, except that the groups the staleness bound would "
        "otherwise exceed go first (a slow response never holds a batch back longer than the "
        "bound needs). Needed by a rollout filter that drops groups (ppo.dynamic_sampling); a "
        "checkpoint then records the data position past every batch drawn and the prompts "
        "drawn and not trained, which a resumed run generates first.",
    )

    def request_groups(self, batch_size: int) -> int:
        """`groups_per_request`, with 0 resolved (see its help)."""
        return self.groups_per_request or batch_size

    @property
    def is_async(self) -> bool:
        return self.mode == RolloutMode["async"]

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        if self.is_async:
            return []
        return [InertKeys((f"{prefix}.",), f"with `{prefix}.mode=sync` (only asynchronous "
                          "rollouts read it)", f"set {prefix}.mode=async")]

    def validate(self, prefix: str, batch_size: int, pipeline_rollout: bool,
                 rollout_data_parallel: int, filter_drops_groups: bool) -> list[str]:
        """Problems of an async setting, each naming the key, the value and a fix (none for
        mode=sync). `rollout_data_parallel`: the largest data-parallel size of a rollout MFC;
        `filter_drops_groups`: the experiment's rollout filter drops groups (DAPO)."""
        if not self.is_async:
            return []
        problems = []
        if pipeline_rollout:
            problems.append(f"`{prefix}.mode=async` already runs the rollout ahead of training; "
                            "set pipeline_rollout=false.")
        if self.max_head_offpolicyness < 0:
            problems.append(f"`{prefix}.max_head_offpolicyness={self.max_head_offpolicyness}` "
                            "must be >= 0 (0: synchronous); try 1.")
        groups = self.request_groups(batch_size)
        if groups < 1 or batch_size % groups:
            problems.append(f"`{prefix}.groups_per_request={groups}` must divide "
                            f"`dataset.batch_size={batch_size}`; try 1 or {batch_size}.")
        elif groups < rollout_data_parallel:
            problems.append(
                f"`{prefix}.groups_per_request={groups}` is below the rollout MFCs' "
                f"data-parallel size {rollout_data_parallel}, which every request is split "
                f"over; set it to a divisor of {batch_size} that is >= {rollout_data_parallel}."
            )
        if self.decode_steps_per_chunk < 0:
            problems.append(f"`{prefix}.decode_steps_per_chunk={self.decode_steps_per_chunk}` "
                            "must be >= 0 (0: no interruption); try 8.")
        if filter_drops_groups and self.assembly != BatchAssembly.finished_first:
            problems.append(
                f"`{prefix}.assembly={self.assembly.value}` cannot fill a batch whose groups the "
                "rollout filter drops (ppo.dynamic_sampling): its batches are the data's; set "
                f"`{prefix}.assembly=finished_first`."
            )
        return problems


@dataclass
class PlanSearchConfig:
    """`allocation_mode=search` (`realrl.plan`): the cost model's device and the search's budget."""

    device: str = help_field(
        "auto", "Device the cost model assumes: auto | cpu | h100 | h200 | a100. auto: cpu for "
        "CPU workers (measured once on this machine by `python -m realrl.plan.calibrate`, "
        "cached in $REALRL_CACHE/plan), else the GPU that nvidia-smi names (h100 if unknown)."
    )
    time_budget_s: float = help_field(
        3.0, "CPU seconds the search may spend when the plans are too many to enumerate (the "
        "result is cached per graph, model shapes, cluster, device and budget)."
    )
    prompt_tokens: int = help_field(
        0, "Prompt length the cost model assumes, in tokens; 0: 8 for the built-in arithmetic "
        "data, else half of `dataset.max_prompt_len`."
    )

    def validate(self, prefix: str) -> list[str]:
        problems = []
        devices = ("auto", "cpu", "h100", "h200", "a100")
        if self.device not in devices:
            problems.append(f"`{prefix}.device={self.device}` is not one of {', '.join(devices)}.")
        if self.time_budget_s <= 0:
            problems.append(f"`{prefix}.time_budget_s={self.time_budget_s}` must be > 0.")
        if self.prompt_tokens < 0:
            problems.append(f"`{prefix}.prompt_tokens={self.prompt_tokens}` must be >= 0 (0: "
                            "estimate).")
        return problems


@dataclass
class BaseExperimentConfig:
    """Keys every experiment has. Experiments subclass this and add their own sections."""

    # Per model-role or MFC section that a run can leave out of its graph, the setting that
    # puts it in; named by the error for keys set on a section the run does not use.
    section_enablers: ClassVar[dict[str, str]] = {}

    experiment_name: str = help_field("", "Name of the experiment; defaults to the registered name.")
    trial_name: str = help_field("trial0", "Name of this trial; runs of one experiment differ here.")
    output_root: str = help_field(
        "./runs", "Root of run directories: <output_root>/<experiment_name>/<trial_name>."
    )
    seed: int = help_field(1, "Global random seed (data order, sampling).")
    mode: LaunchMode = help_field(LaunchMode.local, "Where to launch: local | slurm.")
    n_nodes: int = help_field(1, "Number of nodes.")
    n_devices_per_node: int = help_field(
        0,
        "GPUs per node, or model-worker processes per node on a CPU-only machine; 0: detect "
        "(this machine's GPUs; without GPUs one worker per core up to 2 cores, then one per 2 "
        "cores, at most 4).",
    )
    # ---- preflight (`realrl.launcher.preflight`)
    allow_oversubscribe: bool = help_field(
        False,
        "Local CPU runs: start more model workers (n_nodes * n_devices_per_node) than this "
        "process may use cores. Refused by default: each worker then gets a fraction of a core "
        "and every step waits for the slowest.",
    )
    allocation_mode: str = help_field(
        "auto",
        "Parallel layout: 'auto', 'search', a global layout such as 'd2t1', or per-MFC layouts "
        "such as 'actor_gen:d2,actor_train:d1t2,*:d2' (optionally '@0-1' to pin ranks). "
        "'search' chooses each MFC's layout by predicted step time (`plan.*`, "
        "docs/plan_search.md). 'auto' runs "
        "every MFC data parallel over all workers, except that on CPU workers a graph that "
        "trains two models (PPO's actor and critic) runs each model's calls on its own half "
        "of the workers, generation on all of them (CPU workers: a local run on a machine "
        "without GPUs, or mode=slurm with slurm.gpu_request=none).",
    )
    plan: PlanSearchConfig = help_field(
        PlanSearchConfig(), "allocation_mode=search: the cost model's device and the search budget."
    )
    pipeline_rollout: bool = help_field(
        False,
        "Generate step i+1's rollout while step i trains (one-step off-policy, verl's "
        "one-step-off-policy scheme; `rollout.mode=async` is AReaL's streaming one): each "
        "rollout is generated by weights one train step older than the ones that train on it "
        "(the PPO ratio's clip bounds the update). Needs the rollout MFCs (every MFC but the "
        "train ones) on other workers than the train MFCs (allocation_mode=auto does that; by "
        "hand e.g. `allocation_mode='actor_train:d1@1,*:d1@0'` with 2 workers).",
    )
    rollout: RolloutConfig = help_field(
        RolloutConfig(), "Synchronous or asynchronous (streaming, staleness-bounded) rollouts."
    )
    share_idle_cores: bool = help_field(
        True,
        "Local CPU runs: a model worker serving a request borrows the CPU threads of the "
        "machine's workers that have been idle for 20 ms, between transformer layers, and "
        "gives them back as soon as one of those starts (e.g. the trainer takes the "
        "generator's core once a pipelined rollout is done, not between two chunks of a "
        "streaming one). The thread count then depends on timing, and float sums may round "
        "differently in the last bit from run to run; false keeps each worker's even share "
        "of the cores and makes reruns with the same seed bit-identical.",
    )
    total_train_steps: int = help_field(20, "Number of training steps (graph executions).")
    save_freq_steps: int = help_field(0, "Save a checkpoint every N steps (0: only at the end).")
    recover_mode: RecoverMode = help_field(
        RecoverMode.disabled,
        "disabled | auto (resume from the last complete checkpoint if one exists) | resume "
        "(require one).",
    )
    recover_retries: int = help_field(1, "With recover_mode=auto on SLURM: resubmissions on failure.")
    checkpoint: CheckpointConfig = help_field(
        CheckpointConfig(), "What a checkpoint holds and how many are kept (how often: "
        "save_freq_steps)."
    )
    wandb: WandbConfig = help_field(WandbConfig(), "Weights & Biases logging.")
    tensorboard: bool = help_field(
        True, "Write tensorboard event files into <run_dir>/tensorboard/ (needs the `tensorboard` "
        "package, a dependency of realrl; a run without it warns once and goes on)."
    )
    log: LogConfig = help_field(
        LogConfig(), "What each step logs besides the MFCs' statistics (docs/metrics.md)."
    )
    slurm: SlurmConfig = help_field(SlurmConfig(), "SLURM options, used with mode=slurm.")
    # ---- precision (`resolve_dtypes`)
    dtype: DType = help_field(
        DType.float32,
        "Run-wide parameter dtype, taken by every model role whose `<role>.dtype` is null (a "
        "role initialised from another, such as ppo-math's ref, takes that role's). bfloat16: "
        "frozen roles hold 2 bytes per parameter instead of 4; trained roles compute in bf16 "
        "and keep fp32 master weights, fp32 gradients and fp32 AdamW moments, 18 bytes per "
        "parameter (fp32: 16), so updates below one bf16 spacing (lr=1e-6) still add up; "
        "activations take up to half of fp32's memory per token.",
    )
    # ---- non-finite values (`realrl.backends.torch_engine`, `realrl.workers.model_worker`)
    nan_policy: NanPolicy = help_field(
        NanPolicy.stop,
        "What a NaN or inf loss, gradient norm or MFC output (rewards, values, log-probs) does. "
        "stop: end the run with an error naming the step, the MFC, the role and the micro-batch "
        "(or the output key and samples); the last checkpoint stays the newest. skip: warn, "
        "skip the optimizer step (every data-parallel rank alike: the norm is all-reduced; the "
        "learning-rate schedule does not advance) and count it as `<mfc>/skipped_steps`; a non-finite output goes on to training, whose step "
        "is then skipped. Default stop: on a first run a non-finite value is more often a bug "
        "or a learning rate too high than a rare spike, and skipping would hide it; skip suits "
        "long runs that have shown the odd bad batch (as Megatron and DeepSpeed skip fp16 "
        "overflow steps).",
    )
    # ---- memory guidance (`realrl.workers.memory_watch`)
    worker_memory_gb: float | None = help_field(
        None,
        "Memory one model worker may use, which each MFC call's measured peak "
        "(`<mfc>/peak_memory_gb`) is compared with: past 85% of it a worker logs once per MFC "
        "a `<mfc>.max_tokens_per_microbatch` that would bring the call to about 70%. Nothing "
        "is enforced. null: what the GPU has for the worker at each call (its free memory plus "
        "what the worker holds there; other processes' memory, e.g. a colocated vLLM engine's, "
        "not counted), or on CPU the machine's (MemTotal or the cgroup limit, the smaller) "
        "divided by the workers on the node.",
    )

    # ---- hangs (`realrl.workers.watchdog`, `realrl.workers.heartbeat`)
    watchdog: WatchdogConfig = help_field(
        WatchdogConfig(), "Deadlines of MFC calls, worker heartbeats and collective timeouts: a "
        "hung run stops with a diagnosis instead of waiting for ever."
    )

    def one_pass_allowed(self) -> bool:
        """Whether `total_train_steps=0` means one pass over the data, every record once, the
        last batch partial (`gen`); the master counts the steps once the data is loaded."""
        return False

    def model_path_links(self) -> dict[str, str]:
        """Roles whose empty path takes another role's path (and whose null dtype takes that
        role's dtype), e.g. {"ref": "actor"}; experiments override it."""
        return {}

    def resolve_dtypes(self) -> None:
        """Fill every null `<role>.dtype` (a model role is a section with a `dtype` field): a
        linked role takes its source's resolved dtype, any other role the run-wide `dtype`.
        Called by `resolve_config`, so `--dry-run` and `config.yaml` show concrete dtypes."""
        sections: dict[str, Any] = {
            f.name: section for f in dataclasses.fields(self)
            if dataclasses.is_dataclass(section := getattr(self, f.name))
            and any(g.name == "dtype" for g in dataclasses.fields(section))
        }
        links = self.model_path_links()

        def resolve(name: str, seen: tuple[str, ...]) -> DType:
            section = sections[name]
            if section.dtype is None:
                source = links.get(name)
                if source is not None and source in sections and source not in seen:
                    section.dtype = resolve(source, (*seen, name))
                else:
                    section.dtype = self.dtype
            return section.dtype

        for name in sections:
            resolve(name, ())

    def validate(self) -> list[str]:
        """Cross-field checks; subclasses extend and call super(). Returns every problem."""
        problems = []
        if self.n_nodes < 1:
            problems.append(f"`n_nodes={self.n_nodes}` must be at least 1.")
        if self.n_devices_per_node < 0:
            problems.append(
                f"`n_devices_per_node={self.n_devices_per_node}` must be >= 0 (0: detect).")
        if self.n_devices_per_node == 0 and self.mode == LaunchMode.slurm:
            problems.append(
                "`n_devices_per_node=0` (detect) only works with mode=local: with mode=slurm set "
                "the GPUs (or worker processes) per node, e.g. `n_devices_per_node=8`."
            )
        if self.total_train_steps < (0 if self.one_pass_allowed() else 1):
            problems.append(f"`total_train_steps={self.total_train_steps}` must be at least 1.")
        if self.save_freq_steps < 0:
            problems.append(f"`save_freq_steps={self.save_freq_steps}` must be >= 0.")
        problems += self.checkpoint.validate("checkpoint")
        for name, value in (("experiment_name", self.experiment_name), ("trial_name", self.trial_name)):
            if "/" in value or value in (".", ".."):
                problems.append(f"`{name}={value}` must be a plain name without '/'.")
        problems += self.log.validate("log")
        # ---- LoRA adapters of the model roles (`realrl.api.lora`)
        for section_field in dataclasses.fields(self):
            section = getattr(self, section_field.name)
            if hasattr(section, "lora_problems"):
                problems += section.lora_problems(section_field.name)
        if self.worker_memory_gb is not None and self.worker_memory_gb <= 0:
            problems.append(
                f"`worker_memory_gb={self.worker_memory_gb}` must be > 0, or null to use the "
                "GPU's memory (CPU: the machine's share per worker)."
            )
        problems += self.watchdog.validate("watchdog")
        problems += self.plan.validate("plan")
        return problems

    def inert_keys(self) -> list[InertKeys]:
        """The keys this configuration never reads (`InertKeys`): what each section's
        `inert_keys(prefix)` says of its own keys. Model roles without a model, and MFCs
        outside the graph, are the launch plan's to find
        (`realrl.launcher.plan.unused_section_problems`)."""
        rules: list[InertKeys] = []
        for item in dataclasses.fields(self):
            section = getattr(self, item.name)
            if hasattr(section, "inert_keys"):
                rules += section.inert_keys(item.name)
        return rules

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.experiment_name / self.trial_name

    @property
    def n_workers(self) -> int:
        return self.n_nodes * self.n_devices_per_node


# --------------------------------------------------------------------------- introspection


@dataclass(frozen=True)
class FieldInfo:
    key: str  # dotted path, e.g. "actor.optimizer.lr"
    type_name: str
    default: Any
    help: str


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType):  # e.g. `DType | None`: name each member
        return " | ".join(_type_name(member) for member in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " | ".join(member.value for member in annotation)
        return annotation.__name__
    if typing.get_origin(annotation) is list:  # e.g. `list[RewardSource]`: name the members
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    text = str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None")


def iter_fields(config_class: type, prefix: str = "") -> Iterator[FieldInfo]:
    """Every leaf field of a config dataclass tree, depth first, with its dotted key.

    Each default is the value a run of `config_class` starts from: inside a section, the
    section's own default instance wins over its class's defaults (ppo-math's
    `actor: ModelRoleConfig = help_field(ModelRoleConfig(optimizer=OptimizerConfig(lr=2e-4)))`
    shows `actor.optimizer.lr` = 2e-4, not `OptimizerConfig`'s 1e-5). A help text comes from
    the field, or from the experiment's ``key_help: ClassVar[dict[str, str]]`` (dotted key ->
    text) where a nested key means something else there than its section's class says (what
    an empty `ref.path` loads); a `key_help` entry that names no key is an error.
    """
    key_help = dict(getattr(config_class, "key_help", {}))
    for info in _iter_leaves(config_class, prefix, section_default=None):
        help_text = key_help.pop(info.key, None)
        yield info if help_text is None else dataclasses.replace(info, help=help_text)
    if key_help:
        raise ValueError(
            f"{config_class.__name__}.key_help names unknown key(s) {sorted(key_help)}; use the "
            "dotted keys that `--help` lists"
        )


def _iter_leaves(config_class: type, prefix: str, section_default: Any) -> Iterator[FieldInfo]:
    """`iter_fields` without `key_help`; ``section_default`` is this section's default instance
    (None at the top level, where the fields' own defaults apply)."""
    hints = typing.get_type_hints(config_class)
    for dataclass_field in dataclasses.fields(config_class):
        key = f"{prefix}{dataclass_field.name}"
        annotation = hints[dataclass_field.name]
        if section_default is not None:
            default = getattr(section_default, dataclass_field.name)
        elif dataclass_field.default is not dataclasses.MISSING:
            default = dataclass_field.default
        elif dataclass_field.default_factory is not dataclasses.MISSING:
            default = dataclass_field.default_factory()
        else:
            default = dataclasses.MISSING
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            nested_default = None if default is dataclasses.MISSING else default
            yield from _iter_leaves(annotation, f"{key}.", nested_default)
            continue
        if isinstance(default, enum.Enum):
            default = default.value
        if isinstance(default, list):  # a list of enums shows its values, as YAML holds them
            default = [item.value if isinstance(item, enum.Enum) else item for item in default]
        yield FieldInfo(key, _type_name(annotation), default, dataclass_field.metadata.get("help", ""))


def plain_value(value: Any) -> Any:
    """`value` as `iter_fields` gives defaults and YAML holds it: enums by their value."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [item.value if isinstance(item, enum.Enum) else item for item in value]
    return value


def value_text(value: Any) -> str:
    """`value` as one writes it on the command line: `true`, `null`, `sync`, `[rule,model]`."""
    value = plain_value(value)
    if isinstance(value, list):
        return "[" + ",".join(value_text(item) for item in value) + "]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def inert_key_problems(config: BaseExperimentConfig, problems: Sequence[str] = ()) -> list[str]:
    """One problem per key set away from its default that `config.inert_keys()` says does
    nothing, accepted silently before (`rollout.max_head_offpolicyness=4` on a synchronous run
    trained exactly as without it). Keys that `problems` already name are left to those."""
    rules = config.inert_keys()
    found = []
    for info in iter_fields(type(config)) if rules else ():
        rule = next((rule for rule in rules if rule.covers(info.key)), None)
        if rule is None or any(f"`{info.key}=" in problem for problem in problems):
            continue
        value: Any = config
        for part in info.key.split("."):
            value = getattr(value, part)
        if plain_value(value) != info.default:
            found.append(f"`{info.key}={value_text(value)}` does nothing {rule.when}; "
                         f"{rule.fix}, or remove the key.")
    return found


def all_keys(config_class: type) -> list[str]:
    """Every dotted key a user may set, including the section names."""
    keys: list[str] = []
    for info in iter_fields(config_class):
        parts = info.key.split(".")
        keys.extend(".".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(set(keys))


# --------------------------------------------------------------------------- resolution


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [c for c in candidates if c.rsplit(".", 1)[-1] == leaf][:3]
    return f"; did you mean {', '.join(f'`{c}`' for c in close)}?" if close else ""


def _is_open_dict_key(config_class: type, key: str) -> bool:
    """True if `key` lies under a `dict[...]` field (such as `slurm.env.FOO`): free-form keys."""
    parts = key.split(".")
    current: Any = config_class
    for part in parts[:-1]:
        if not (isinstance(current, type) and dataclasses.is_dataclass(current)):
            return False
        hints = typing.get_type_hints(current)
        if part not in hints:
            return False
        current = hints[part]
        if typing.get_origin(current) is dict:
            return True
    return False


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """Parse Hydra-syntax `key=value` overrides into (key, python value) pairs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    parser = OverridesParser.create()
    parsed: list[tuple[str, Any]] = []
    problems = []
    for text in overrides:
        if "=" not in text:
            problems.append(f"`{text}` is not an override: write `key=value`.")
            continue
        try:
            (override,) = parser.parse_overrides([text])
        except (OverrideParseException, HydraException) as exc:
            problems.append(f"`{text}` cannot be parsed: {str(exc).splitlines()[0]}")
            continue
        if override.is_delete() or override.is_add():
            problems.append(f"`{text}`: '+' and '~' are not supported; write `key=value`.")
            continue
        if override.is_sweep_override():
            # realrl runs no sweeps: `a=x,y` is the plain string "x,y" (e.g. allocation_mode).
            parsed.append((override.key_or_group, text.split("=", 1)[1]))
        else:
            parsed.append((override.key_or_group, override.value()))
    if problems:
        raise ConfigError(problems)
    return parsed


def resolve_config(
    config_class: type,
    overrides: Sequence[str] = (),
    config_files: Sequence[str | Path] = (),
    defaults: dict[str, Any] | None = None,
) -> Any:
    """Compose `config_class` defaults, `defaults`, YAML files and overrides; validate all.

    Raises `ConfigError` listing every unknown key (with the nearest valid ones), every type
    error (key, value, expected type) and every cross-field problem from `validate()`.
    """
    config = OmegaConf.structured(config_class)
    valid_keys = all_keys(config_class)
    problems: list[str] = []

    def apply(key: str, value: Any, origin: str) -> None:
        if key not in valid_keys and not _is_open_dict_key(config_class, key):
            problems.append(f"unknown key `{key}` ({origin}){_suggest(key, valid_keys)}")
            return
        try:
            OmegaConf.update(config, key, value, merge=True)
        except OmegaConfBaseException as exc:
            expected = next((f.type_name for f in iter_fields(config_class) if f.key == key), "?")
            reason = str(exc).splitlines()[0]
            problems.append(
                f"`{key}={value!r}` ({origin}) has the wrong type: expected {expected} ({reason})"
            )

    for key, value in (defaults or {}).items():
        apply(key, value, "experiment default")
    for path in config_files:
        path = Path(path)
        if not path.is_file():
            problems.append(f"config file `{path}` does not exist.")
            continue
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception as exc:  # yaml errors come in several types
            problems.append(f"config file `{path}` is not valid YAML: {exc}")
            continue
        if not isinstance(loaded, dict):
            problems.append(f"config file `{path}` must hold a mapping at the top level.")
            continue
        for key, value in _flatten(loaded):
            apply(key, value, f"from {path}")
    for key, value in parse_overrides(overrides):
        apply(key, value, "command line")
    if problems:
        raise ConfigError(problems)
    try:
        instance: Any = OmegaConf.to_object(config)
    except OmegaConfBaseException as exc:
        raise ConfigError([str(exc).splitlines()[0]]) from None
    if instance.n_devices_per_node == 0 and instance.mode == LaunchMode.local:
        instance.n_devices_per_node = detect_devices_per_node()
    instance.resolve_dtypes()
    problems = instance.validate()
    problems += inert_key_problems(instance, problems)
    if problems:
        raise ConfigError(problems)
    return instance


def may_have_gpus() -> bool:
    """False only where no NVIDIA or AMD GPU driver is present (or CUDA_VISIBLE_DEVICES hides
    every GPU), so that CPU machines need not import torch to learn it."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(os.path.exists(path) for path in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd"))


def detect_devices_per_node() -> int:
    """`n_devices_per_node=0`: the GPUs of this machine; without GPUs, one single-threaded
    worker per core for up to 2 cores (tiny models gain more from data parallelism across
    processes than from threads), then one worker per 2 cores, at most 4."""
    if may_have_gpus():
        import torch  # ~1.5 s of the launcher's start-up: only where a GPU driver exists

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    cores = usable_cores()
    return cores if cores <= 2 else min(4, cores // 2)


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (what a container, `taskset` or SLURM
    grants), not `os.cpu_count()`, which counts the whole host."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _flatten(mapping: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _flatten(value, prefix=f"{dotted}.")
        else:
            yield dotted, value


def to_yaml(config: Any) -> str:
    """The resolved config as YAML (enums as their values)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_resolved_config(config_class: type, yaml_path: str | Path) -> Any:
    """Read back a `config.yaml` written by `to_yaml` (for recovery and SLURM workers)."""
    config = OmegaConf.merge(OmegaConf.structured(config_class), OmegaConf.load(yaml_path))
    return OmegaConf.to_object(config)
