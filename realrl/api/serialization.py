"""Config dataclasses to and from plain JSON data, for shipping a resolved run to workers.

Workers never re-import the user's experiment module: what they need (models, MFCs with their
interface configs, allocations, the common settings) travels as JSON and is rebuilt here from
realrl's own dataclasses. An MFC's interface config is rebuilt from the table of interface
configs by name that the caller hands in (`realrl.interfaces.configs.INTERFACE_CONFIGS`, from
`realrl.workers.run_plan`): `realrl/api` is the bottom layer and imports none of the layers
that build on it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from realrl.api.allocation import DeviceMesh, MFCAllocation, ParallelStrategy
from realrl.api.dfg import MFCDef, MicroBatchSpec, OffloadHook, ParamReallocHook


def to_data(value: Any) -> Any:
    """Dataclasses, enums, tuples -> JSON-compatible dicts, values and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    if isinstance(value, dict):
        return {key: to_data(item) for key, item in value.items()}
    return value


def from_data(config_class: type, data: dict) -> Any:
    """Rebuild a config dataclass (nested dataclasses and enums included) from `to_data` output."""
    merged = OmegaConf.merge(OmegaConf.structured(config_class), data)
    return OmegaConf.to_object(merged)


def _hook_to_data(hook: Any) -> dict:
    return {"type": type(hook).__name__, **to_data(hook)}


def _hook_from_data(data: dict) -> Any:
    fields = {key: value for key, value in data.items() if key != "type"}
    return {"ParamReallocHook": ParamReallocHook, "OffloadHook": OffloadHook}[data["type"]](**fields)


def mfc_to_data(mfc: MFCDef) -> dict:
    data = {f.name: to_data(getattr(mfc, f.name)) for f in dataclasses.fields(mfc)}
    data["pre_hooks"] = [_hook_to_data(hook) for hook in mfc.pre_hooks]
    data["post_hooks"] = [_hook_to_data(hook) for hook in mfc.post_hooks]
    return data


def mfc_from_data(data: dict, interface_configs: Mapping[str, type]) -> MFCDef:
    """The MFC `mfc_to_data` wrote; `interface_configs` maps each interface name to the
    dataclass of its config."""
    config_class = interface_configs.get(data["interface"])
    if config_class is None:
        raise ValueError(
            f"MFC `{data['name']}` uses unknown interface `{data['interface']}`; registered: "
            f"{', '.join(sorted(interface_configs))}"
        )
    fields = dict(data)
    fields["interface_config"] = from_data(config_class, data["interface_config"] or {})
    fields["microbatch"] = MicroBatchSpec(**data["microbatch"])
    fields["pre_hooks"] = [_hook_from_data(hook) for hook in data["pre_hooks"]]
    fields["post_hooks"] = [_hook_from_data(hook) for hook in data["post_hooks"]]
    return MFCDef(**fields)


def allocation_to_data(allocation: MFCAllocation) -> dict:
    mesh, strategy = allocation.mesh, allocation.strategy
    return {
        "mfc_name": allocation.mfc_name,
        "mesh": {"n_nodes": mesh.n_nodes, "n_devices_per_node": mesh.n_devices_per_node,
                 "ranks": list(mesh.ranks)},
        "strategy": {"data": strategy.data, "tensor": strategy.tensor,
                     "pipeline": strategy.pipeline},
    }


def allocation_from_data(data: dict) -> MFCAllocation:
    mesh = DeviceMesh(data["mesh"]["n_nodes"], data["mesh"]["n_devices_per_node"],
                      tuple(data["mesh"]["ranks"]))
    return MFCAllocation(data["mfc_name"], mesh, ParallelStrategy(**data["strategy"]))
