"""Every check a run can pass before a process starts, in one place.

`prepare_launch(config)` is called by `--dry-run` and by `realrl.launcher.prepare.prepare_run`,
which both the local and the SLURM start go through, so that a dry run refuses exactly what a
start would. It resolves what the launcher decides
for the user (empty `<role>.path`s, null `dataset.max_prompt_len`/`max_seq_len`,
`slurm.gpu_request=auto`), builds the launch plan, and gathers every problem into one
`ConfigError` (the CLI prints each on one line and exits 2), each naming the key, the value,
the file where one is involved, and the fix:

- each model directory: config.json, and the weights' files (a safetensors header and the
  file's size, without loading a tensor; `checkpoint_files`);
- the dataset, streamed line by line (a multi-GB file is never held in memory): its first
  bad lines (bad JSON, a missing key, bytes that are not UTF-8, with file:line), and its
  record count against `dataset.batch_size`;
- prompt limit plus new tokens (or the sequence limit) against the models' context;
- `recover_mode=resume` with no complete checkpoint in the run directory;
- a remote reward service's token variable (`reward.remote.token_env`) unset or empty;
- more local CPU workers than cores (`allow_oversubscribe`), megatron without CUDA, a chat
  template the tokenizer lacks;
- with mode=slurm, the `slurm.*` keys and `sbatch --test-only` (`slurm_checks`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from realrl.api import environment
from realrl.api.config import (
    BaseExperimentConfig,
    ConfigError,
    LaunchMode,
    RecoverMode,
    may_have_gpus,
    usable_cores,
)
from realrl.api.experiment import (
    BuiltinSplit,
    DatasetKind,
    ExperimentSpec,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
)
from realrl.api.rl_config import GenerationHyperparameters
from realrl.datasets.jsonl import DatasetError
from realrl.datasets.records import (
    iter_chat_records,
    iter_paired_records,
    iter_prompt_records,
    iter_sft_records,
)
from realrl.launcher.checkpoint_files import checkpoint_problem, read_model_config
from realrl.launcher.plan import LaunchPlan, build_plan, workers_without_gpus
from realrl.launcher.warm_start import default_model_path

logger = logging.getLogger(__name__)


def prepare_launch(config: BaseExperimentConfig) -> LaunchPlan:
    """Resolve, check and plan `config` (see the module docstring); raises `ConfigError`
    with every problem found. Starts nothing and writes nothing but default models."""
    environment.shared_memory_enabled()  # a bad REALRL_SHARED_MEMORY fails here
    environment.fork_server_enabled()  # and a bad REALRL_FORK_SERVER
    problems: list[str] = []
    if config.mode == LaunchMode.slurm:
        from realrl.launcher.slurm_checks import resolve_gpu_request
        from realrl.launcher.slurm_script import slurm_problems

        problems += slurm_problems(config)
        resolve_gpu_request(config)
    resolve_model_paths(config)
    spec = config.build()
    problems += model_path_problems(spec.models)
    if problems:  # the plan reads the models' config.json
        raise ConfigError(problems)
    problems += context_problems(config, spec)
    plan = build_plan(config)
    problems += dataset_problems(config, plan)
    problems += resume_problems(config)
    problems += oversubscription_problems(config)
    problems += optimizer_backend_problems(plan)
    problems += remote_token_problems(config)
    if config.mode == LaunchMode.slurm and not problems:
        from realrl.launcher.slurm_checks import submission_problems

        problems += submission_problems(config)
    if problems:
        raise ConfigError(problems)
    return plan


def resolve_model_paths(config: BaseExperimentConfig) -> None:
    """Fill empty `*.path` keys: linked roles (critic, ref) take their source's path, the rest
    the built-in default model (see `realrl.launcher.warm_start`)."""
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if isinstance(getattr(config, f.name), ModelRoleConfig)}
    links = config.model_path_links()
    for name, section in sections.items():
        if not section.path and name not in links:
            section.path = str(default_model_path(config, name))
    for name, source in links.items():
        if not sections[name].path:
            sections[name].path = sections[source].path


def model_path_problems(models: dict[str, ModelSpec]) -> list[str]:
    """One problem per unusable model directory, naming the first role's key that uses it."""
    problems, seen = [], set()
    for spec in sorted(models.values(), key=lambda spec: spec.kind == ModelKind.rule):
        if spec.config is None or spec.config.path in seen:
            continue
        seen.add(spec.config.path)
        problem = checkpoint_problem(spec.config.path, needs_weights=spec.kind != ModelKind.rule)
        if problem is not None:
            key = spec.config_key("path")
            problems.append(f"`{key}={spec.config.path}`: {problem}; set {key} to a local Hugging "
                            "Face checkpoint directory (config.json, model.safetensors, "
                            "tokenizer files)")
    return problems


def _context_limit(models: dict[str, ModelSpec]) -> tuple[int, str] | None:
    """(positions, where it is declared) of the model with the shortest context."""
    limits = []
    for spec in models.values():
        if spec.kind == ModelKind.rule or spec.config is None:
            continue
        hf_config, _ = read_model_config(Path(spec.config.path))
        positions = (hf_config or {}).get("max_position_embeddings",
                                          (hf_config or {}).get("n_positions"))
        if isinstance(positions, int):
            limits.append((positions, f"max_position_embeddings in {spec.config.path}/config.json, "
                                      f"{spec.config_key('path')}"))
    return min(limits) if limits else None


def context_problems(config: BaseExperimentConfig, spec: ExperimentSpec) -> list[str]:
    """Fill null length limits from the models' context, and refuse limits past it."""
    limit = _context_limit(spec.models)
    dataset = getattr(config, "dataset", None)
    if limit is None or dataset is None:
        return []
    positions, source = limit
    if spec.dataset_kind not in (DatasetKind.prompt, DatasetKind.chat):
        if dataset.max_seq_len is None:
            dataset.max_seq_len = positions
        elif dataset.max_seq_len > positions:
            return [f"`dataset.max_seq_len={dataset.max_seq_len}` exceeds the model's context of "
                    f"{positions} positions ({source}): set it to at most {positions}, or null"]
        return []
    generation = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                  if isinstance(getattr(config, f.name), GenerationHyperparameters)]
    key, new_tokens = max(((f"{name}.max_new_tokens", section.max_new_tokens)
                           for name, section in generation), key=lambda item: item[1],
                          default=("", 0))
    if dataset.max_prompt_len is None:
        if new_tokens >= positions:
            return [f"`{key}={new_tokens}` leaves no room for a prompt in the model's context of "
                    f"{positions} positions ({source}): set {key} to at most {positions - 1}"]
        dataset.max_prompt_len = positions - new_tokens
        return []
    if dataset.max_prompt_len + new_tokens > positions:
        room = positions - new_tokens
        fix = (f"lower dataset.max_prompt_len to {room} (null: the context minus {key})"
               if room >= 1 else f"set {key} to at most {positions - 1}")
        return [f"`dataset.max_prompt_len={dataset.max_prompt_len}` plus `{key}={new_tokens}` "
                f"exceeds the model's context of {positions} positions ({source}): {fix}"]
    return []


def dataset_problems(config: BaseExperimentConfig, plan: LaunchPlan) -> list[str]:
    """A user file streamed and validated (file:line), its record count against
    `dataset.batch_size`, and `dataset.apply_chat_template=true` against the tokenizer."""
    dataset = config.dataset
    try:
        records = count_records(plan.spec.dataset_kind, dataset.path, dataset.builtin_size())
    except DatasetError as error:
        return [str(error)]
    problems = []
    where = dataset.path or (f"the built-in data (`dataset.builtin_train_size={records}`)"
                             if dataset.builtin_split == BuiltinSplit.train
                             else "the built-in eval split (`dataset.builtin_split=eval`)")
    one_pass = config.total_train_steps == 0  # `gen`: the last batch may be partial
    if records < dataset.batch_size and not one_pass:
        problems.append(f"`dataset.batch_size={dataset.batch_size}` exceeds the {records} records "
                        f"of {where}, so no full batch can be served: set dataset.batch_size to "
                        f"at most {records}, or add records")
    if dataset.apply_chat_template:
        from realrl.workers.data_source import check_chat_template  # imports transformers

        check_chat_template(dataset.apply_chat_template, plan.spec.models)
    return problems


def count_records(kind: DatasetKind, path: str, builtin_size: int) -> int:
    """The records `realrl.workers.data_source.load_records` would return, validated line by
    line without keeping them (a multi-GB file never sits in memory), and without torch."""
    if not path:
        return builtin_size
    iterate = {DatasetKind.prompt: iter_prompt_records, DatasetKind.sft: iter_sft_records,
               DatasetKind.paired: iter_paired_records, DatasetKind.chat: iter_chat_records}[kind]
    return sum(1 for _ in iterate(path))


def resume_problems(config: BaseExperimentConfig) -> list[str]:
    if config.recover_mode != RecoverMode.resume:
        return []
    from realrl.workers.recovery import checkpoint_root, latest_complete_checkpoint

    if latest_complete_checkpoint(config.run_dir) is not None:
        return []
    return [f"`recover_mode=resume` needs a complete checkpoint, and "
            f"{checkpoint_root(config.run_dir)} holds none (the run directory comes from "
            "output_root, experiment_name and trial_name): set recover_mode=auto to resume when "
            "a checkpoint exists and start fresh otherwise, or recover_mode=disabled to start "
            "fresh"]


def oversubscription_problems(config: BaseExperimentConfig) -> list[str]:
    """A local CPU run may start at most one model worker per usable core."""
    if config.mode != LaunchMode.local or config.allow_oversubscribe:
        return []
    cores = usable_cores()
    if config.n_workers <= cores or not workers_without_gpus(config):
        return []
    return [f"`n_devices_per_node={config.n_devices_per_node}` (x n_nodes={config.n_nodes}) "
            f"starts {config.n_workers} CPU model workers on the {cores} cores this process may "
            f"use: set n_devices_per_node to at most {cores} (0: detect), or "
            "allow_oversubscribe=true to start them anyway"]


def remote_token_problems(config: BaseExperimentConfig) -> list[str]:
    """`reward.remote.token_env` names a variable this process lacks: the workers (which
    inherit the launcher's environment, under SLURM too) could not authenticate."""
    reward = getattr(config, "reward", None)
    if reward is None or "remote" not in [getattr(s, "value", s) for s in reward.sources]:
        return []
    name = reward.remote.token_env
    if not name or os.environ.get(name, "").strip():
        return []
    state = "empty" if name in os.environ else "not set"
    return [f"`reward.remote.token_env={name}`, but ${name} is {state} here: export "
            f"{name}=<the reward service's token> before starting the run, or set "
            "reward.remote.token_env= (empty) for a service without authentication"]


def optimizer_backend_problems(plan: LaunchPlan) -> list[str]:
    """A local run's workers compute on this machine: `<role>.optimizer.backend=megatron`
    without a usable GPU is refused here (a worker refuses it too, for launches elsewhere)."""
    if plan.config.mode != LaunchMode.local:
        return []
    specs = [spec for spec in plan.spec.models.values() if spec.config is not None]
    if not any(spec.megatron_without_cuda("cpu") for spec in specs):
        return []
    device_type = "cpu"
    if may_have_gpus():
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return [problem for spec in specs if (problem := spec.megatron_without_cuda(device_type))]
