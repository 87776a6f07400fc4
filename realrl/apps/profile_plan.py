"""Calibrate `allocation_mode=search` on this machine: short real runs under probe allocations.

    python -m realrl.apps.profile_plan ppo-math [key=value ...] [--steps 6] [--repeats 1]

Takes the same experiment, overrides, ``--config`` and ``--import`` as
`realrl.apps.quickstart`, and runs the experiment through that CLI for ``--steps`` steps
under each probe allocation: every MFC on worker 0 (``*:d1@0``), every MFC data-parallel
over all workers (``dN``), every MFC ``d(N/2)t2`` when all of them can be split in two, and,
where two of the graph's calls can overlap, the side-by-side probe (its roles alternately on
the two halves of the workers, `realrl.plan.contention`). Each MFC's median seconds over the
steps after the first (`timing/<mfc>`, with the forward a train MFC sends ahead; with
``--repeats``, the median over that many runs of each probe, run round by round) are fitted
per MFC (`realrl.plan.calibration`), the side-by-side probe's step gives the contention
between workers, and the fit is cached, keyed by the workload, the cluster and this machine's
CPU profile; `allocation_mode=search` with the same keys then prices plans with it. Prints,
per probe and call, the prediction before and after the fit against the measurement. Runs go
to a temporary directory (``--work-dir`` keeps them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from realrl.api.allocation_mode import parse_allocation_mode
from realrl.api.config import ConfigError, resolve_config
from realrl.api.registry import RegistryError, get_experiment, import_user_module, load_plugins
from realrl.launcher.plan import workers_without_gpus
from realrl.launcher.preflight import prepare_launch
from realrl.plan.calibration import (
    Calibration,
    ProbeSample,
    fit,
    save_calibration,
)
from realrl.plan.candidates import candidate_layouts
from realrl.plan.choose import launch_problem
from realrl.plan.contention import fit_contention, side_by_side_layouts, with_contention
from realrl.plan.costs import Cluster, Layout
from realrl.plan.search import Evaluator, SearchProblem

logger = logging.getLogger("realrl.apps.profile_plan")
USAGE_EXIT_CODE = 2
# Keys the probes set themselves; the user's values of them are dropped.
PROBE_KEYS = ("allocation_mode", "total_train_steps", "output_root", "experiment_name",
              "trial_name", "recover_mode", "wandb.mode", "tensorboard", "save_freq_steps")


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m realrl.apps.profile_plan",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("experiment", help="registered experiment name")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for a run")
    parser.add_argument("--config", action="append", default=[], help="YAML config file")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="module path or .py file that registers experiments")
    parser.add_argument("--steps", type=int, default=6,
                        help="steps per probe run; the first (warm-up) is not measured")
    parser.add_argument("--work-dir", default=None,
                        help="keep the probe runs here (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per probe, in rounds (every probe once, then again); each "
                        "MFC's seconds are the median of the runs' medians: on CPU two runs of "
                        "the same allocation differ by 5-15%% in step time")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per probe run")
    return parser.parse_intermixed_args(argv)


def probe_allocations(problem: SearchProblem) -> list[str]:
    """``*:d1@0``; ``dN`` with N > 1 workers; ``d(N/2)t2`` when every MFC has that layout."""
    size = problem.cluster.size
    probes = ["*:d1@0"]
    if size > 1:
        probes.append(f"d{size}")
        if size % 2 == 0 and all(
                any(layout.strategy.tensor == 2 and layout.mesh.size == size
                    for layout in candidate_layouts(work, problem.cluster, False, (1,)))
                for work in problem.works.values() if work.model is not None):
            probes.append(f"d{size // 2}t2")
    return probes


def probe_layouts(problem: SearchProblem, allocation_mode: str) -> dict[str, Layout]:
    """The layouts a probe gives each MFC, with the MFC's configured micro-batch count."""
    cluster = problem.cluster
    allocations = parse_allocation_mode(allocation_mode, list(problem.works), cluster.n_nodes,
                                        cluster.n_devices_per_node)
    return {name: Layout(allocations[name].mesh, allocations[name].strategy,
                         work.microbatch_choices[0] if work.microbatch_choices else 1)
            for name, work in problem.works.items()}


def _measured_steps(metrics_path: Path) -> list[dict]:
    """The metrics records of the steps after the first (the warm-up)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    if not records:
        raise RuntimeError(f"{metrics_path} has no step")
    return records[1:] or records


def measured_mfc_seconds(metrics_path: Path, mfc_names: list[str]) -> tuple[dict[str, float],
                                                                               float]:
    """Each MFC's median seconds (its `timing/<mfc>` plus `timing/<mfc>/forward` when it sent a
    forward ahead) and the median step, over the steps after the first."""
    measured = _measured_steps(metrics_path)
    seconds = {}
    for name in mfc_names:
        values = [record.get(f"timing/{name}", 0.0) + record.get(f"timing/{name}/forward", 0.0)
                  for record in measured if f"timing/{name}" in record]
        if values:
            seconds[name] = statistics.median(values)
    return seconds, statistics.median(record["timing/step_s"] for record in measured)


def measured_call_seconds(metrics_path: Path, mfc_names: list[str]) -> tuple[dict[str, float],
                                                                                float]:
    """`measured_mfc_seconds` by call: the forward a train MFC sent ahead on its own
    (``actor_train/forward``), as the search's timeline labels them."""
    measured = _measured_steps(metrics_path)
    labels = [label for name in mfc_names for label in (name, f"{name}/forward")]
    seconds = {label: statistics.median(record[f"timing/{label}"] for record in measured
                                        if f"timing/{label}" in record)
               for label in labels if any(f"timing/{label}" in record for record in measured)}
    return seconds, statistics.median(record["timing/step_s"] for record in measured)


def median_over_runs(runs: list[tuple[dict[str, float], float]]) -> tuple[dict[str, float],
                                                                            float]:
    """`measured_mfc_seconds` of several runs of one allocation: each MFC's median over the
    runs that timed it, and the median step."""
    names = {name for seconds, _ in runs for name in seconds}
    seconds = {name: statistics.median(run[name] for run, _ in runs if name in run)
               for name in names}
    return seconds, statistics.median(step for _, step in runs)


def probe_trial(index: int, repeat: int) -> str:
    """The trial name of probe `index`'s run number `repeat` (from 0)."""
    return f"probe{index}" if repeat == 0 else f"probe{index}-run{repeat + 1}"


def _user_overrides(overrides: list[str]) -> list[str]:
    return [item for item in overrides if item.split("=", 1)[0].lstrip("+~") not in PROBE_KEYS]


def run_probe(args: argparse.Namespace, allocation_mode: str, index: int, repeat: int,
              work_dir: Path) -> Path:
    """One probe run through the CLI; returns its metrics.jsonl."""
    trial = probe_trial(index, repeat)
    command = [sys.executable, "-m", "realrl.apps.quickstart", args.experiment,
               *[f"--config={path}" for path in args.config],
               *[f"--import={module}" for module in args.imports],
               *_user_overrides(args.overrides),
               f"allocation_mode='{allocation_mode}'", f"total_train_steps={args.steps}",
               f"output_root={work_dir}", "experiment_name=profile-plan", f"trial_name={trial}",
               "recover_mode=disabled", "wandb.mode=disabled", "tensorboard=false",
               "save_freq_steps=0"]
    log_path = work_dir / f"{trial}.log"
    logger.info("probe %d, run %d of %d: allocation_mode=%s (%d steps; log %s)", index,
                repeat + 1, args.repeats, allocation_mode, args.steps, log_path)
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout_s)
    if result.returncode != 0:
        tail = log_path.read_text().splitlines()[-20:]
        raise RuntimeError(f"probe run with allocation_mode={allocation_mode} exited "
                           f"{result.returncode}; last lines of {log_path}:\n" + "\n".join(tail))
    return work_dir / "profile-plan" / trial / "metrics.jsonl"


def side_by_side_allocation(problem: SearchProblem) -> str | None:
    """The side-by-side probe's `allocation_mode` (`realrl.plan.contention`), or None."""
    layouts = side_by_side_layouts(problem)
    return ",".join(layout.text(name) for name, layout in layouts.items()) if layouts else None


def calibrate_from_runs(problem: SearchProblem, probes: list[str], side_by_side: str | None,
                        runs: list[list[Path]]) -> Calibration:
    """The fit to the runs (metrics.jsonl paths) of each of `probes` and then of the
    side-by-side probe, when there is one: per-MFC corrections, and the contention that the
    side-by-side probe's step shows."""
    names = list(problem.works)
    samples: dict[str, list[ProbeSample]] = {name: [] for name in names}
    for allocation_mode, paths in zip(probes, runs[:len(probes)], strict=True):
        layouts = probe_layouts(problem, allocation_mode)
        measured, _ = median_over_runs([measured_mfc_seconds(path, names) for path in paths])
        for name, value in measured.items():
            samples[name].append(ProbeSample(layouts[name], value))

    def corrections(cluster: Cluster) -> Calibration:
        return fit(problem.works, cluster, samples)

    if side_by_side is None:
        return corrections(problem.cluster)
    _, step = median_over_runs([measured_mfc_seconds(path, names) for path in runs[len(probes)]])
    return fit_contention(problem, corrections, probe_layouts(problem, side_by_side), step)


def profile(args: argparse.Namespace, config: Any, out: TextIO) -> tuple[Path, list[str]]:
    """Run the probes, fit, cache and print; (the calibration's path, the probes, the
    side-by-side one last)."""
    # The checks of a start, and the default model paths filled in (the model shapes are read
    # from their config.json); `auto` so that no search runs here.
    config.allocation_mode = "auto"
    launch = prepare_launch(config)
    problem = launch_problem(config, launch.spec, launch.graph, workers_without_gpus(config),
                             calibrated=False)
    probes = probe_allocations(problem)
    side_by_side = side_by_side_allocation(problem)
    allocations = probes + ([side_by_side] if side_by_side else [])
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="realrl-profile-plan-")).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    runs: list[list[Path]] = [[] for _ in allocations]
    try:
        for repeat in range(args.repeats):  # in rounds: a slow minute spreads over the probes
            for index, allocation_mode in enumerate(allocations):
                runs[index].append(run_probe(args, allocation_mode, index, repeat, work_dir))
        calibration = calibrate_from_runs(problem, probes, side_by_side, runs)
        names = list(problem.works)
        measured = [median_over_runs([measured_call_seconds(path, names) for path in paths])
                    for paths in runs]
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    path = save_calibration(problem.works, problem.cluster, calibration)
    out.write(report(problem, calibration, allocations, measured, args.repeats,
                     side_by_side is not None) +
              f"\ncalibration written to {path}; allocation_mode=search with the same keys uses "
              "it\n")
    return path, allocations


def report(problem: SearchProblem, calibration: Calibration, allocations: list[str],
           measured: list[tuple[dict[str, float], float]], repeats: int,
           contention_fitted: bool) -> str:
    """Per probe and call: the model alone, the measurement, the calibrated model (each call
    as the calibrated step simulates it, beside what runs with it); then the fit, with the
    contention when a side-by-side probe ran."""
    calibrated = Evaluator(dataclasses.replace(with_contention(problem, calibration.contention),
                                               calibration=calibration))
    uncalibrated = Evaluator(problem)
    runs = f", median of {repeats} runs per probe" if repeats > 1 else ""
    lines = [f"device: {problem.cluster.device.name}, {problem.cluster.size} worker(s){runs}",
             "",
             "| probe | call | layout | model s | measured s | calibrated s |",
             "|---|---|---|---|---|---|"]
    for allocation_mode, (seconds, step) in zip(allocations, measured, strict=True):
        layouts = probe_layouts(problem, allocation_mode)
        model = {entry.label: entry.realloc_s + entry.run_s
                 for entry in uncalibrated.timeline(layouts)}
        plan = calibrated.plan(layouts)
        for entry in plan.timeline:
            value = f"{seconds[entry.label]:.4f}" if entry.label in seconds else "-"
            lines.append(f"| `{allocation_mode}` | {entry.label} | "
                         f"{layouts[entry.name].strategy} | {model[entry.label]:.4f} | {value} | "
                         f"{entry.realloc_s + entry.run_s:.4f} |")
        lines.append(f"| `{allocation_mode}` | step | | "
                     f"{uncalibrated.plan(layouts).step_seconds:.4f} | {step:.4f} | "
                     f"{plan.step_seconds:.4f} |")
    lines += ["", "per MFC: seconds = scale x compute + offset (by tensor size) + communication"]
    for name, correction in calibration.corrections:
        tensor = "".join(f", t{t} {o:.4f}" for t, o in correction.tensor_offsets_s)
        lines.append(f"  {name:<14} scale {correction.scale:.3f}, offset {correction.offset_s:.4f}"
                     f" s{tensor}")
    if contention_fitted:
        lines.append(f"contention {calibration.contention:.3f}: with k of a machine's workers "
                     f"busy, each call runs 1 + {calibration.contention:.3f} x (k - 1) times "
                     "slower (the side-by-side probe)")
    return "\n".join(lines) + "\n"


def resolve(args: argparse.Namespace) -> Any:
    """The experiment's config from the arguments, as `realrl.apps.quickstart` resolves it."""
    import realrl.experiments  # noqa: F401  (registers the built-in experiments)

    load_plugins()
    for module in args.imports:
        import_user_module(module)
    entry = get_experiment(args.experiment)
    config = resolve_config(entry.config_class, _user_overrides(args.overrides), args.config,
                            defaults={"experiment_name": entry.name})
    if args.steps < 2:
        raise ConfigError(["--steps must be at least 2: the first step is a warm-up and is not "
                           "measured"])
    if args.repeats < 1:
        raise ConfigError([f"--repeats {args.repeats}: give at least 1 run per probe"])
    return config


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(levelname)s %(message)s")
    args = parse_arguments(argv)
    try:
        profile(args, resolve(args), out)
        return 0
    except (ConfigError, RegistryError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return USAGE_EXIT_CODE
    except RuntimeError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
