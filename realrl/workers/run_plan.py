"""The resolved run as data: what the master publishes to every model worker.

`RunPlan` is built once by the launcher from the experiment's config and launch plan, written to
`plan.json` in the run directory, and published by the master in the rendezvous store, so workers
on other nodes need no shared filesystem and never import the user's experiment module.

Layouts: an MFC runs its model role on a layout = (role, mesh ranks, parallel strategy). MFCs of a
role with equal layouts share one model replica. The *owner* layout of a role holds its newest
weights: the layout of its train MFC, or of its first MFC for frozen roles. Other layouts are
refreshed from the owner by parameter reallocation when they fall behind.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from realrl.api.allocation import MFCAllocation
from realrl.api.config import BaseExperimentConfig
from realrl.api.dfg import MFCDef, ParamReallocHook
from realrl.api.experiment import (
    DatasetConfig,
    DatasetKind,
    ModelKind,
    ModelRoleConfig,
    ModelSpec,
    RolloutFilter,
)
from realrl.api.serialization import (
    allocation_from_data,
    allocation_to_data,
    from_data,
    mfc_from_data,
    mfc_to_data,
    to_data,
)
from realrl.interfaces.configs import INTERFACE_CONFIGS


@dataclass(frozen=True, order=True)
class LayoutKey:
    role: str
    ranks: tuple[int, ...]
    strategy: str  # e.g. "d2t1p1"

    def __str__(self) -> str:
        return f"{self.role}@{','.join(map(str, self.ranks))}:{self.strategy}"


@dataclass
class RunPlan:
    base: BaseExperimentConfig
    dataset: DatasetConfig
    dataset_kind: DatasetKind
    models: dict[str, ModelSpec]
    mfcs: list[MFCDef]  # in topological order
    allocations: dict[str, MFCAllocation]
    rollout_filter: RolloutFilter | None = None

    # ------------------------------------------------------------------ layouts

    def layout_of(self, mfc_name: str) -> LayoutKey:
        mfc = next(m for m in self.mfcs if m.name == mfc_name)
        allocation = self.allocations[mfc_name]
        return LayoutKey(mfc.model_role, tuple(allocation.mesh.ranks), str(allocation.strategy))

    def allocation_of_layout(self, layout: LayoutKey) -> MFCAllocation:
        name = next(m.name for m in self.mfcs if self.layout_of(m.name) == layout)
        return self.allocations[name]

    def layouts(self) -> list[LayoutKey]:
        """Every distinct layout, in a deterministic order (process groups depend on it)."""
        return sorted({self.layout_of(m.name) for m in self.mfcs if self.has_weights(m)})

    def layouts_in_build_order(self) -> list[LayoutKey]:
        """`layouts()`, those of roles that use another role's base weights
        (`ModelSpec.shares_base_with`) last: they take the weights of that role's layouts."""
        return sorted(self.layouts(),
                      key=lambda layout: self.models[layout.role].shares_base_with is not None)

    def owner_layout(self, role: str) -> LayoutKey:
        mfcs = [m for m in self.mfcs if m.model_role == role]
        train = [m for m in mfcs if m.is_train]
        return self.layout_of((train or mfcs)[0].name)

    def ema_hooks(self) -> list[tuple[str, ParamReallocHook]]:
        return [(m.name, hook) for m in self.mfcs for hook in m.post_hooks
                if isinstance(hook, ParamReallocHook)]

    def transfers(self) -> list[tuple[LayoutKey, LayoutKey]]:
        """Every (source, destination) layout pair a reallocation may move weights along."""
        pairs = set()
        for layout in self.layouts():
            owner = self.owner_layout(layout.role)
            if layout != owner:
                pairs.add((owner, layout))
        for _, hook in self.ema_hooks():
            pairs.add((self.owner_layout(hook.source_role), self.owner_layout(hook.target_role)))
        return sorted(pairs)

    def train_mfcs(self) -> list[str]:
        return [m.name for m in self.mfcs if m.is_train]

    def rollout_mfcs(self) -> list[str]:
        """Every MFC but the train ones: what `pipeline_rollout` runs one step ahead."""
        return [m.name for m in self.mfcs if not m.is_train]

    def has_weights(self, mfc: MFCDef) -> bool:
        return self.models[mfc.model_role].kind != ModelKind.rule

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "base": to_data(self.base),
            "dataset": to_data(self.dataset),
            "dataset_kind": self.dataset_kind.value,
            "models": {role: to_data(spec) for role, spec in self.models.items()},
            "mfcs": [mfc_to_data(m) for m in self.mfcs],
            "allocations": {name: allocation_to_data(a) for name, a in self.allocations.items()},
            "rollout_filter": to_data(self.rollout_filter),
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunPlan:
        data = json.loads(text)
        models = {}
        for role, spec in data["models"].items():
            config = None if spec["config"] is None else from_data(ModelRoleConfig, spec["config"])
            models[role] = ModelSpec(role, ModelKind(spec["kind"]), config, spec["trainable"],
                                     spec.get("shares_base_with"))
        return cls(
            base=from_data(BaseExperimentConfig, data["base"]),
            dataset=from_data(DatasetConfig, data["dataset"]),
            dataset_kind=DatasetKind(data["dataset_kind"]),
            models=models,
            mfcs=[mfc_from_data(m, INTERFACE_CONFIGS) for m in data["mfcs"]],
            allocations={n: allocation_from_data(a) for n, a in data["allocations"].items()},
            rollout_filter=(RolloutFilter(**data["rollout_filter"])
                            if data.get("rollout_filter") else None),
        )


def base_settings(config: BaseExperimentConfig) -> BaseExperimentConfig:
    """The common keys of an experiment config, as a plain `BaseExperimentConfig`."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(BaseExperimentConfig)}
    return BaseExperimentConfig(**values)
