"""The experiment registry: `@register_experiment("name")` on a config dataclass.

realrl's own experiments register by being imported explicitly in `realrl/experiments/__init__.py`.
Users' experiments come from `--import my_module` (a module path or a `.py` file) or from an
installed plugin that declares an entry point in the `realrl.experiments` group:

    [project.entry-points."realrl.experiments"]
    my_plugin = "my_package.experiments"
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "realrl.experiments"


class RegistryError(ValueError):
    pass


@dataclass(frozen=True)
class ExperimentEntry:
    name: str
    config_class: type
    description: str


_EXPERIMENTS: dict[str, ExperimentEntry] = {}


def register_experiment(name: str, description: str | None = None) -> Callable[[type], type]:
    """Register a config dataclass as the experiment `name`.

    The class must subclass `BaseExperimentConfig` and define `build(self) -> ExperimentSpec`.
    The description defaults to the first line of the class docstring.
    """

    def decorator(config_class: type) -> type:
        if not dataclasses.is_dataclass(config_class):
            raise RegistryError(f"@register_experiment({name!r}) needs a dataclass, got {config_class}")
        if not callable(getattr(config_class, "build", None)):
            raise RegistryError(
                f"experiment {name!r} ({config_class.__qualname__}) must define build() returning an "
                f"ExperimentSpec"
            )
        existing = _EXPERIMENTS.get(name)
        if existing is not None and existing.config_class is not config_class:
            raise RegistryError(
                f"experiment name {name!r} is already registered by "
                f"{existing.config_class.__module__}.{existing.config_class.__qualname__}"
            )
        doc_lines = (config_class.__doc__ or "").strip().splitlines()
        text = description or (doc_lines[0] if doc_lines else "")
        _EXPERIMENTS[name] = ExperimentEntry(name, config_class, text)
        return config_class

    return decorator


def get_experiment(name: str) -> ExperimentEntry:
    try:
        return _EXPERIMENTS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_EXPERIMENTS), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise RegistryError(
            f"unknown experiment {name!r}.{hint} Registered: {', '.join(sorted(_EXPERIMENTS))}."
        ) from None


def list_experiments() -> list[ExperimentEntry]:
    return [_EXPERIMENTS[name] for name in sorted(_EXPERIMENTS)]


def import_user_module(spec: str) -> None:
    """Import `spec`, a dotted module path or a path to a `.py` file, to run its registrations."""
    path = Path(spec)
    try:
        if spec.endswith(".py"):
            if not path.is_file():
                raise RegistryError(f"--import {spec}: no such file")
            module_name = f"realrl_user_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise RegistryError(f"--import {spec}: not an importable Python file")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        else:
            importlib.import_module(spec)
    except RegistryError:
        raise
    except ModuleNotFoundError as exc:
        raise RegistryError(f"--import {spec}: {exc}") from exc
    except Exception as exc:
        raise RegistryError(f"--import {spec} failed: {type(exc).__name__}: {exc}") from exc


def load_plugins() -> None:
    """Import every module registered under the `realrl.experiments` entry-point group."""
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry_point.load()
        except Exception as exc:
            logger.warning("experiment plugin %s (%s) failed to load: %s", entry_point.name,
                           entry_point.value, exc)
