"""An experiment's dataflow graph as the work the cost model prices (`MFCWork` per MFC).

Read from the resolved config without torch: model shapes from each role's ``config.json``,
sequences per call from the MFC's batch size and the responses per prompt, tokens per
sequence from ``plan.prompt_tokens`` and ``gen.max_new_tokens``, optimizer steps from
``ppo.num_minibatches x ppo.num_epochs``. The micro-batch count of each MFC is the
configured ``<mfc>.min_num_microbatches``: the search places MFCs, it does not change how
a run cuts its batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from realrl.api.dfg import DATASET, DataflowGraph, MFCDef, MFCKind
from realrl.api.experiment import ExperimentSpec, ModelKind, ModelSpec
from realrl.plan.costs import MFCWork, ModelShape, WorkKind

BUILTIN_PROMPT_TOKENS = 8  # "123+45=" and the like, one token per character


class WorkloadError(ValueError):
    """The graph cannot be priced (a model without a config.json); the message says why."""


def model_shape(spec: ExperimentSpec, model: ModelSpec) -> ModelShape:
    source = spec.models[model.shares_base_with] if model.shares_base_with else model
    assert source.config is not None  # rule roles have no shape and are not asked
    path = Path(source.config.path) / "config.json"
    if not path.is_file():
        raise WorkloadError(
            f"allocation_mode=search prices each model from its config.json, and role "
            f"{model.role!r} has none at {path}; set `{model.config_key('path')}` to a Hugging "
            "Face model directory, or use allocation_mode=auto")
    return ModelShape.from_hf_config(json.loads(path.read_text()),
                                     value_head=model.kind == ModelKind.critic)


def prompt_tokens(config: Any) -> int:
    if config.plan.prompt_tokens:
        return config.plan.prompt_tokens
    dataset = getattr(config, "dataset", None)
    if dataset is None or not dataset.path:
        return BUILTIN_PROMPT_TOKENS
    limit = dataset.max_prompt_len or dataset.max_seq_len or 2 * BUILTIN_PROMPT_TOKENS
    return max(1, limit // 2)


def _responses_per_prompt(config: Any, mfc: MFCDef) -> int:
    group = getattr(mfc.interface_config, "group_size", None)
    return group or getattr(config, "group_size", 1) or 1


def mfc_work(config: Any, spec: ExperimentSpec, graph: DataflowGraph, mfc: MFCDef) -> MFCWork:
    model = spec.models[mfc.model_role]
    generation = getattr(config, "gen", None)
    generated = getattr(generation, "max_new_tokens", 0) if generation is not None else 0
    ppo = getattr(config, "ppo", None)
    trained_roles = {graph.mfcs[name].model_role for name in graph.mfcs
                     if graph.mfcs[name].is_train}
    kind = WorkKind.rule if model.kind == ModelKind.rule else WorkKind(mfc.kind.value)
    optimizer_steps = epochs = 1
    if mfc.kind == MFCKind.train_step and ppo is not None:
        epochs = ppo.num_epochs
        optimizer_steps = ppo.num_minibatches * ppo.num_epochs
    dtype = getattr(model.config, "dtype", None) if model.config is not None else None
    # The master sends a train call's forward ahead once an MFC of the step has produced one of
    # its `forward_keys` (`Master._run_mfcs`).
    ahead = sorted({graph.producers[key] for key in mfc.forward_keys} - {DATASET})
    return MFCWork(
        name=mfc.name, role=mfc.model_role, kind=kind,
        model=None if kind == WorkKind.rule else model_shape(spec, model),
        num_sequences=mfc.batch_size * _responses_per_prompt(config, mfc),
        prompt_tokens=prompt_tokens(config), generated_tokens=generated,
        dtype=getattr(dtype, "value", dtype) or "float32",
        role_is_trained=mfc.model_role in trained_roles,
        optimizer_steps=optimizer_steps, epochs=epochs,
        microbatch_choices=(mfc.microbatch.min_num_microbatches,),
        forward_ahead_after=tuple(ahead), num_samples=mfc.batch_size,
    )


def graph_works(config: Any, spec: ExperimentSpec, graph: DataflowGraph
                ) -> tuple[dict[str, MFCWork], dict[str, tuple[str, ...]]]:
    """(MFC name -> work in graph order, MFC name -> the MFCs it reads from)."""
    works = {name: mfc_work(config, spec, graph, graph.mfcs[name]) for name in graph.order}
    dependencies = {name: tuple(sorted(graph.parents[name])) for name in graph.order}
    return works, dependencies
