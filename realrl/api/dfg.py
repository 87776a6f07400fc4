"""Model function calls (MFCs) and the dataflow graph built from their data keys.

An MFC is one call of a model role (`actor`, `critic`, `ref`, `reward`, ...): `generate`,
`inference` or `train_step`. It reads `input_keys` from the step's packed batch and writes
`output_keys` into it. Edges are not declared: an MFC depends on the MFC that produces each of
its input keys, and a key no MFC produces must come from the dataset. `DataflowGraph` checks all
of that before anything starts, so a typo'd key fails at once instead of hanging a run.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


class MFCKind(str, enum.Enum):
    generate = "generate"
    inference = "inference"
    train_step = "train_step"


@dataclass(frozen=True)
class MicroBatchSpec:
    """How a call's batch is cut into micro-batches on each data-parallel rank."""

    max_tokens_per_microbatch: int | None = None  # None: no token budget
    min_num_microbatches: int = 1


@dataclass(frozen=True)
class ParamReallocHook:
    """Before/after an MFC: copy (eta=1) or blend (0<eta<1) the weights of `source_role` into
    `target_role`: `target = eta * source + (1 - eta) * target`. With the same role on both sides it
    only moves the newest weights of that role onto the MFC's layout."""

    source_role: str
    target_role: str
    eta: float = 1.0


@dataclass(frozen=True)
class OffloadHook:
    """After an MFC: release the model's device memory until its next use (GPU only)."""


Hook = ParamReallocHook | OffloadHook


@dataclass
class MFCDef:
    name: str
    model_role: str
    kind: MFCKind
    interface: str  # registered interface name, e.g. "ppo_actor"
    interface_config: Any = None  # the interface's typed config dataclass
    input_keys: tuple[str, ...] = ()
    output_keys: tuple[str, ...] = ()
    # graph key -> key the interface sees, and interface key -> graph key
    input_key_remap: dict[str, str] = field(default_factory=dict)
    output_key_remap: dict[str, str] = field(default_factory=dict)
    batch_size: int = 1  # in samples (prompts), per call, over all data-parallel ranks
    microbatch: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    pre_hooks: list[Hook] = field(default_factory=list)
    post_hooks: list[Hook] = field(default_factory=list)
    # A train MFC's inputs that its forward needs, when fewer than all: once they exist the
    # master sends the forward ahead (the interface's `train_forward`), and the train call
    # takes it from the engine. Empty: the train call runs its own forward.
    forward_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.kind = MFCKind(self.kind)
        self.input_keys = tuple(self.input_keys)
        self.output_keys = tuple(self.output_keys)
        self.forward_keys = tuple(self.forward_keys)

    @property
    def is_train(self) -> bool:
        return self.kind == MFCKind.train_step


class GraphError(ValueError):
    """The experiment's MFCs do not form a valid graph; lists every problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"invalid dataflow graph ({len(self.problems)} problem(s)):\n{lines}")


DATASET = "<dataset>"


class DataflowGraph:
    """The DAG of MFCs; build with `DataflowGraph(mfcs, dataset_keys, model_roles)`."""

    def __init__(self, mfcs: Sequence[MFCDef], dataset_keys: Iterable[str], model_roles: Iterable[str]):
        self.mfcs = {mfc.name: mfc for mfc in mfcs}
        self.dataset_keys = tuple(dataset_keys)
        self.model_roles = tuple(model_roles)
        problems = self._check_names(mfcs) + self._check_roles(mfcs)
        self.producers: dict[str, str] = {key: DATASET for key in self.dataset_keys}
        problems += self._collect_producers(mfcs)
        problems += self._check_inputs(mfcs) + self._check_forward_keys(mfcs)
        if problems:
            raise GraphError(problems)
        self.parents = {
            name: sorted({self.producers[k] for k in mfc.input_keys} - {DATASET})
            for name, mfc in self.mfcs.items()
        }
        self.children: dict[str, list[str]] = {name: [] for name in self.mfcs}
        for name, parents in self.parents.items():
            for parent in parents:
                self.children[parent].append(name)
        self.levels = self._topological_levels()

    # ---------------------------------------------------------------- checks

    @staticmethod
    def _check_names(mfcs: Sequence[MFCDef]) -> list[str]:
        seen: dict[str, int] = {}
        for mfc in mfcs:
            seen[mfc.name] = seen.get(mfc.name, 0) + 1
        return [f"MFC name `{n}` is used by {c} MFCs; names must be unique." for n, c in seen.items() if c > 1]

    def _check_roles(self, mfcs: Sequence[MFCDef]) -> list[str]:
        return [
            f"MFC `{mfc.name}` runs on model role `{mfc.model_role}`, which the experiment does "
            f"not declare (declared roles: {', '.join(self.model_roles) or 'none'})."
            for mfc in mfcs
            if mfc.model_role not in self.model_roles
        ]

    def _collect_producers(self, mfcs: Sequence[MFCDef]) -> list[str]:
        problems = []
        for mfc in mfcs:
            for key in mfc.output_keys:
                previous = self.producers.get(key)
                if previous is None:
                    self.producers[key] = mfc.name
                elif previous == DATASET:
                    problems.append(
                        f"key `{key}` is produced by MFC `{mfc.name}` but also comes from the dataset; "
                        f"rename the MFC's output (output_key_remap)."
                    )
                else:
                    problems.append(
                        f"key `{key}` is produced by both MFC `{previous}` and MFC `{mfc.name}`; "
                        f"each key must have one producer."
                    )
        return problems

    def _check_inputs(self, mfcs: Sequence[MFCDef]) -> list[str]:
        problems = []
        available = sorted(self.producers)
        for mfc in mfcs:
            for key in mfc.input_keys:
                if key not in self.producers:
                    problems.append(
                        f"MFC `{mfc.name}` needs key `{key}`, which no MFC produces and the dataset "
                        f"does not provide (available keys: {', '.join(available) or 'none'})."
                    )
        return problems

    @staticmethod
    def _check_forward_keys(mfcs: Sequence[MFCDef]) -> list[str]:
        problems = []
        for mfc in mfcs:
            if mfc.forward_keys and not mfc.is_train:
                problems.append(
                    f"MFC `{mfc.name}` ({mfc.kind.value}) has forward_keys; only train calls run "
                    "their forward ahead."
                )
            extra = [key for key in mfc.forward_keys if key not in mfc.input_keys]
            if extra:
                problems.append(
                    f"MFC `{mfc.name}`: forward_keys {extra} are not among its input_keys."
                )
        return problems

    def _topological_levels(self) -> list[list[str]]:
        indegree = {name: len(parents) for name, parents in self.parents.items()}
        level = sorted(name for name, degree in indegree.items() if degree == 0)
        levels = []
        while level:
            levels.append(level)
            upcoming = []
            for name in level:
                for child in self.children[name]:
                    indegree[child] -= 1
                    if indegree[child] == 0:
                        upcoming.append(child)
            level = sorted(upcoming)
        stuck = sorted(name for name, degree in indegree.items() if degree > 0)
        if stuck:
            raise GraphError([self._describe_cycle(stuck)])
        return levels

    def _describe_cycle(self, stuck: list[str]) -> str:
        edges = []
        for name in stuck:
            for key in self.mfcs[name].input_keys:
                producer = self.producers[key]
                if producer in stuck:
                    edges.append(f"`{producer}` -> `{name}` (key `{key}`)")
        return f"the MFCs {', '.join(f'`{s}`' for s in stuck)} form a cycle: {'; '.join(edges)}."

    # ---------------------------------------------------------------- queries

    @property
    def sources(self) -> list[str]:
        return [name for name in self.mfcs if not self.parents[name]]

    @property
    def sinks(self) -> list[str]:
        return [name for name in self.mfcs if not self.children[name]]

    @property
    def order(self) -> list[str]:
        return [name for level in self.levels for name in level]

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer, consumer, key) for every data edge, the dataset as `<dataset>`."""
        result = []
        for name in self.order:
            for key in self.mfcs[name].input_keys:
                result.append((self.producers[key], name, key))
        return result

    # ---------------------------------------------------------------- rendering

    def describe(self) -> str:
        lines = []
        for depth, level in enumerate(self.levels):
            for name in level:
                mfc = self.mfcs[name]
                lines.append(
                    f"[level {depth}] {name} ({mfc.model_role}.{mfc.kind.value}, {mfc.interface}, "
                    f"batch {mfc.batch_size})"
                )
                for key in mfc.input_keys:
                    lines.append(f"    <- {key:<24} from {self.producers[key]}")
                for key in mfc.output_keys:
                    consumers = [c for (_, c, k) in self.edges() if k == key]
                    lines.append(f"    -> {key:<24} to {', '.join(consumers) or '(unused)'}")
                for hook in mfc.pre_hooks + mfc.post_hooks:
                    when = "pre" if hook in mfc.pre_hooks else "post"
                    lines.append(f"    {when}-hook {_hook_text(hook)}")
        return "\n".join(lines)

    def to_mermaid(self) -> str:
        lines = ["flowchart TD", '    dataset[("dataset")]']
        for name, mfc in self.mfcs.items():
            lines.append(f'    {_node_id(name)}["{name}<br/>{mfc.model_role}.{mfc.kind.value}"]')
        for producer, consumer, key in self.edges():
            source = "dataset" if producer == DATASET else _node_id(producer)
            lines.append(f"    {source} -->|{key}| {_node_id(consumer)}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        lines = ["digraph dataflow {", "    rankdir=TB;", '    dataset [shape=cylinder];']
        for name, mfc in self.mfcs.items():
            lines.append(f'    "{name}" [shape=box, label="{name}\\n{mfc.model_role}.{mfc.kind.value}"];')
        for producer, consumer, key in self.edges():
            source = "dataset" if producer == DATASET else f'"{producer}"'
            lines.append(f'    {source} -> "{consumer}" [label="{key}"];')
        lines.append("}")
        return "\n".join(lines)


def _node_id(name: str) -> str:
    return "mfc_" + "".join(c if c.isalnum() else "_" for c in name)


def _hook_text(hook: Hook) -> str:
    if isinstance(hook, ParamReallocHook):
        if hook.source_role == hook.target_role:
            return f"reallocate {hook.source_role} weights onto this layout"
        return f"{hook.target_role} = {hook.eta} * {hook.source_role} + {1 - hook.eta:g} * {hook.target_role}"
    return "offload: release the model's device memory until its next use"
