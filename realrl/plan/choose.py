"""`allocation_mode=search` at launch: the run's graph priced on its cluster, searched once and
cached on disk per graph, model shapes, cluster, device, budget and cost-model source
(``$REALRL_CACHE/plan/search-<hash>.json``).

The torch backend runs no pipeline parallelism and holds the whole optimizer state on every
data-parallel rank, so the launched search allows neither (`python -m realrl.apps.plan` may
assume megatron-core's). The device is the CPU worker measured on this machine
(`realrl.plan.devices.cpu_device`) or an analytic GPU (`plan.device`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from realrl.api import environment
from realrl.api.allocation import DeviceMesh, ParallelStrategy
from realrl.api.dfg import DataflowGraph
from realrl.api.experiment import ExperimentSpec
from realrl.plan.calibration import load_calibration
from realrl.plan.costs import Cluster, Layout
from realrl.plan.devices import GIB, DeviceSpec, analytic_device, cpu_device
from realrl.plan.search import Evaluator, SearchProblem, SearchResult, search
from realrl.plan.workload import graph_works

logger = logging.getLogger(__name__)


def _gpu_kind() -> str:
    """The analytic device closest to this machine's GPU, by nvidia-smi's name."""
    if shutil.which("nvidia-smi") is None:
        return "h100"
    result = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30)
    name = result.stdout.lower()
    return next((kind for kind in ("h200", "a100", "h100") if kind in name), "h100")


def _cpu_memory_per_worker(workers_per_node: int) -> float:
    """MemTotal divided over the node's workers (the cgroup limit aside)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / max(workers_per_node, 1)
    except OSError:
        pass
    return 4 * GIB


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def _threads_per_worker(config: Any) -> int:
    return max(1, _cores() // max(config.n_devices_per_node, 1))


def resolve_device(config: Any, cpu_workers: bool) -> DeviceSpec:
    kind = config.plan.device
    if kind == "auto":
        kind = "cpu" if cpu_workers else _gpu_kind()
    if kind == "cpu":
        device = cpu_device(_threads_per_worker(config),
                            _cpu_memory_per_worker(config.n_devices_per_node))
    else:
        device = analytic_device(kind)
    if config.worker_memory_gb is not None:
        device = dataclasses.replace(device, memory_bytes=config.worker_memory_gb * 1e9)
    return device


def resolve_cluster(config: Any, cpu_workers: bool) -> Cluster:
    """The run's nodes and device; CPU workers that outnumber this machine's cores
    (`allow_oversubscribe=true`) share them (`Cluster.parallel_devices_per_node`)."""
    device = resolve_device(config, cpu_workers)
    slots = _cores() // _threads_per_worker(config)  # workers at full speed at once
    shared = not device.is_gpu and slots < config.n_devices_per_node
    return Cluster(config.n_nodes, config.n_devices_per_node, device, slots if shared else None)


def launch_problem(config: Any, spec: ExperimentSpec, graph: DataflowGraph,
                   cpu_workers: bool, calibrated: bool = True) -> SearchProblem:
    """The run's search problem; with the per-MFC calibration that `python -m
    realrl.apps.profile_plan` measured for this workload on this machine, when there is one
    (and `calibrated`), and the contention between its workers that the calibration found."""
    works, dependencies = graph_works(config, spec, graph)
    cluster = resolve_cluster(config, cpu_workers)
    calibration = load_calibration(works, cluster) if calibrated else None
    if calibration is not None:
        cluster = dataclasses.replace(cluster, contention=calibration.contention)
        logger.info("plan search: per-MFC costs calibrated by real runs (%s)", calibration.source)
    elif calibrated and not cluster.device.is_gpu:
        logger.info("plan search: per-MFC costs not calibrated for this workload; `python -m "
                    "realrl.apps.profile_plan <experiment> <the same key=value ...>` measures "
                    "them")
    return SearchProblem(works, dependencies, cluster, calibration=calibration)


def _cache_path(problem: SearchProblem, time_budget_s: float) -> Path:
    """Keyed by the problem, the budget and the cost model's source (a changed model prices
    plans differently, so its old choices are not reused)."""
    model_source = b"".join((Path(__file__).parent / name).read_bytes()
                            for name in ("calibration.py", "candidates.py", "costs.py", "memory.py",
                                         "search.py"))
    key = repr((problem, time_budget_s)).encode() + model_source
    digest = hashlib.sha256(key).hexdigest()[:16]
    return environment.cache_dir() / "plan" / f"search-{digest}.json"


def _layouts_to_json(layouts: dict[str, Layout]) -> dict:
    return {name: {"ranks": list(layout.mesh.ranks), "data": layout.strategy.data,
                   "tensor": layout.strategy.tensor, "pipeline": layout.strategy.pipeline,
                   "microbatches": layout.num_microbatches}
            for name, layout in layouts.items()}


def _layouts_from_json(problem: SearchProblem, data: dict) -> dict[str, Layout]:
    cluster = problem.cluster
    return {name: Layout(DeviceMesh(cluster.n_nodes, cluster.n_devices_per_node,
                                    tuple(entry["ranks"])),
                         ParallelStrategy(entry["data"], entry["tensor"], entry["pipeline"]),
                         entry["microbatches"])
            for name, entry in data.items()}


def cached_search(problem: SearchProblem, time_budget_s: float) -> SearchResult:
    """`search(problem)`, or the plans a previous search of the same problem found, priced
    again (cheap) so that the report is current."""
    path = _cache_path(problem, time_budget_s)
    if path.is_file():
        cached = json.loads(path.read_text())
        evaluator = Evaluator(problem)
        plans = [evaluator.plan(_layouts_from_json(problem, layouts))
                 for layouts in cached["plans"]]
        symmetric = (evaluator.plan(_layouts_from_json(problem, cached["symmetric"]))
                     if cached["symmetric"] else None)
        logger.info("plan search: cached result %s", path)
        return SearchResult(plans, symmetric, cached["space_size"], evaluator.evaluations,
                            cached["exhaustive"], 0.0)
    result = search(problem, time_budget_s=time_budget_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "plans": [_layouts_to_json(plan.layouts) for plan in result.plans],
        "symmetric": _layouts_to_json(result.symmetric.layouts) if result.symmetric else None,
        "space_size": result.space_size, "exhaustive": result.exhaustive,
    }, indent=1) + "\n")
    return result
