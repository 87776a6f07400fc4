"""The launcher imports one way, and `realrl/api` imports nothing above it (issue 26, item 7).

Read from the source with `ast`, so every import counts: those at module level and those
inside functions (a function-level import still ties the two modules together, it only hides
the tie from a reader). Each failure names the offending import by file and line.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Packages the launcher may not import: the CLI on top of it, and the experiments it runs
# (it gets their configs as objects; `realrl.apps.quickstart` registers them).
ABOVE_THE_LAUNCHER = ("realrl.apps", "realrl.experiments")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = REPO_ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports_of(source: str, package: str) -> Iterator[tuple[str, int]]:
    """(module, line) for every realrl module that `source`, a module of `package`, imports,
    anywhere in it. `from realrl.launcher import slurm_task` names `realrl.launcher.slurm_task`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..api import y`
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base
                     for alias in node.names]
        else:
            continue
        yield from ((name, node.lineno) for name in names if name.startswith("realrl."))


def import_graph(package: str) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the import} over `package`'s modules."""
    directory = REPO_ROOT.joinpath(*package.split("."))
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(directory.glob("*.py")):
        edges = graph.setdefault(module_name(path), {})
        for name, line in imports_of(path.read_text(), package):
            edges.setdefault(name, f"{path.relative_to(REPO_ROOT)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One import cycle within `graph`'s modules, as its edges ("a -> b (file:line)"), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in graph[module]:
            if imported not in graph or state.get(imported) == "done":
                continue
            if state.get(imported) == "open":
                loop = path[path.index(imported):] + [imported]
                return [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(loop, loop[1:])]
            if (cycle := visit(imported)) is not None:
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in graph:
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_launcher_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph("realrl.launcher"))
    assert cycle is None, "realrl/launcher imports in a circle:\n  " + "\n  ".join(cycle or [])


def test_the_launcher_imports_neither_the_cli_nor_the_experiments():
    offending = [f"{where} imports {name}"
                 for edges in import_graph("realrl.launcher").values()
                 for name, where in edges.items() if name.startswith(ABOVE_THE_LAUNCHER)]
    assert offending == [], "the launcher imports a layer above it:\n  " + "\n  ".join(offending)


def test_api_imports_nothing_above_it():
    offending = [f"{where} imports {name}"
                 for edges in import_graph("realrl.api").values()
                 for name, where in edges.items() if not name.startswith("realrl.api")]
    assert offending == [], (
        "realrl/api imports from a layer above it (api is the bottom layer; hand what it needs "
        "down to it instead):\n  " + "\n  ".join(offending))


def test_the_import_reader_sees_imports_inside_functions_and_modules_from_packages():
    source = textwrap.dedent("""
        import json
        from realrl.api.config import ConfigError

        def start():
            from realrl.launcher import slurm_task, no_such_module
            from . import plan
            import realrl.launcher.processes as processes
        """)
    assert sorted(imports_of(source, "realrl.launcher")) == [
        ("realrl.api.config", 3), ("realrl.launcher", 6), ("realrl.launcher.plan", 7),
        ("realrl.launcher.processes", 8), ("realrl.launcher.slurm_task", 6)]


def test_a_cycle_is_reported_edge_by_edge_with_the_importing_lines():
    graph = {"realrl.launcher.run": {"realrl.launcher.slurm": "run.py:10", "json": "run.py:1"},
             "realrl.launcher.slurm": {"realrl.launcher.run": "slurm.py:20"},
             "realrl.launcher.plan": {}}
    assert find_cycle(graph) == ["realrl.launcher.run -> realrl.launcher.slurm (run.py:10)",
                                 "realrl.launcher.slurm -> realrl.launcher.run (slurm.py:20)"]
    del graph["realrl.launcher.slurm"]["realrl.launcher.run"]
    assert find_cycle(graph) is None
