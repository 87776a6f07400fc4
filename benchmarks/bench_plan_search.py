"""Predicted against measured step time for `allocation_mode=search` and other allocations.

Issue 27's validation. For `ppo-math` PPO (actor, critic, reference, rule reward) and GRPO
(`ppo.disable_value=true ppo.adv_estimator=grpo ppo.kl_ctl=0`) on `--workers` CPU model
workers, each allocation in `--plans` (the searched one, `auto`, and hand-written ones that
the test suite and the benchmarks use) runs `--steps` steps through the real CLI; the
measured step is the median of `timing/step_s` over the steps after the first (warm-up). The
prediction is `realrl.plan`'s for the same allocation, on the same machine profile the
launcher uses (`$REALRL_CACHE/plan/cpu-*.json`), calibrated first (unless `--no-profile`) by
`python -m realrl.apps.profile_plan` with the same keys: its probe runs (`*:d1@0`, `dN`,
`d(N/2)t2`, and the side-by-side probe where calls can overlap) fit each MFC's costs and the
contention between workers, and the table marks the allocations that are probes. With
`--repeats N` every allocation (and every probe) runs N times, in rounds (each plan once, then
again, so that the machine's drift over minutes spreads over all of them), and the measured
step is the median of the runs' medians. After the rounds the calibration is fitted again to
every run of each probe's allocation, the profile's and the ones here (the machine runs the
same allocation up to 25% apart a few minutes later: CPU time stolen by other guests, shown
per run), every plan is priced again with it, and the search is made again with it; the table
shows both predictions. Responses are forced to
`gen.max_new_tokens` tokens (`gen.min_new_tokens` equal to it), and each worker keeps its own
core (`share_idle_cores=false`: a call alone on the machine does not borrow the idle
workers' threads), as the cost model assumes.

    .venv/bin/python benchmarks/bench_plan_search.py --experiments ppo,grpo --steps 8 --repeats 3

Prints one markdown table per experiment and writes `results.json` in `--work-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
from pathlib import Path

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api.allocation_mode import parse_allocation_mode
from realrl.apps import profile_plan
from realrl.apps.quickstart import get_experiment, resolve_config
from realrl.launcher.preflight import prepare_launch
from realrl.plan.calibration import ProbeSample, fit, save_calibration
from realrl.plan.choose import launch_problem
from realrl.plan.costs import Layout
from realrl.plan.search import Evaluator, SearchProblem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import StealMeter, run_quickstart  # noqa: E402

logger = logging.getLogger("bench_plan_search")
GRPO = ["ppo.disable_value=true", "ppo.adv_estimator=grpo", "ppo.kl_ctl=0"]
PLANS = {  # (experiment, workers) -> the allocations measured by default
    ("ppo", 2): ["search", "auto", "d2", "*:d1@0", "actor_gen:d2,actor_train:d1@0,*:d2",
                 "actor_train:d1@1,*:d1@0", "actor_gen:d2,actor_train:d1@1,critic_train:d1@0,*:d2",
                 "d1t2", "actor_gen:d1@1,*:d2", "actor_gen:d1t2,*:d2"],
    ("grpo", 2): ["search", "auto", "d2", "*:d1@0", "actor_gen:d2,actor_train:d1@0,*:d2",
                  "actor_train:d1@1,*:d1@0", "actor_gen:d1@0,*:d2", "d1t2", "actor_gen:d1t2,*:d2",
                  "actor_train:d1t2,*:d2"],
    ("ppo", 4): ["search", "auto", "d4", "*:d1@0", "d2t2", "*:d2@0-1",
                 "actor_gen:d4,actor_train:d2@0-1,critic_train:d2@2-3,*:d4",
                 "actor_train:d2@0-1,ref_inf:d2@0-1,critic_inf:d2@2-3,critic_train:d2@2-3,*:d4",
                 "actor_gen:d2@0-1,*:d4", "actor_gen:d2t2,*:d4"],
    ("grpo", 4): ["search", "auto", "d4", "*:d1@0", "d2t2", "*:d2@0-1",
                  "actor_gen:d4,actor_train:d2@0-1,*:d4", "actor_gen:d2@0-1,*:d4",
                  "actor_train:d2t2,*:d4", "actor_gen:d2t2,*:d4"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench-plan-search")
    parser.add_argument("--experiments", default="ppo,grpo")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--plans", default="", help="comma-free ';'-separated list; default: "
                        "PLANS of the experiment and worker count (2 or 4)")
    parser.add_argument("--overrides", default="", help="more key=value overrides, space-"
                        "separated (e.g. allow_oversubscribe=true for --workers 4 on 2 cores)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per plan and per probe, in rounds; measured: the median")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--no-profile", action="store_true",
                        help="predict with the cost model alone (no calibration runs)")
    parser.add_argument("--reprice", action="store_true",
                        help="runs nothing: price the plans of --work-dir's results.json again "
                        "(same keys) with the cost model and calibration now on disk")
    return parser.parse_args(argv)


def calibrate(args: argparse.Namespace, experiment: str) -> list[str]:
    """Run `realrl.apps.profile_plan` for the experiment's keys; the probes' allocations."""
    options = profile_plan.parse_arguments(
        ["ppo-math", *overrides(args, experiment, "auto", "profile"), "--steps", str(args.steps),
         "--repeats", str(args.repeats), "--work-dir", str(args.work_dir / "profile" / experiment)])
    _, probes = profile_plan.profile(options, profile_plan.resolve(options), sys.stdout)
    return probes


def overrides(args: argparse.Namespace, experiment: str, plan: str, trial: str) -> list[str]:
    return [
        "dataset.batch_size=" + str(args.batch_size), f"group_size={args.group_size}",
        f"gen.max_new_tokens={args.max_new_tokens}", f"gen.min_new_tokens={args.max_new_tokens}",
        f"n_devices_per_node={args.workers}", f"allocation_mode='{plan}'",
        f"total_train_steps={args.steps}", "wandb.mode=disabled", "tensorboard=false",
        f"output_root={args.work_dir / 'runs'}", "experiment_name=plan-search",
        f"trial_name={trial}", "share_idle_cores=false",
        *(GRPO if experiment == "grpo" else []), *args.overrides.split(),
    ]


def unshared(args: argparse.Namespace, problem: SearchProblem,
             probe_dir: Path) -> SearchProblem | None:
    """Where the workers share cores: the same problem as if each had its own, calibrated
    from the same probe runs (in `probe_dir`) without dividing out their sharing or their
    contention, as the model did before `Cluster.parallel_devices_per_node`; None otherwise
    or without probe runs."""
    probes = profile_plan.probe_allocations(problem)
    runs = [[probe_dir / "profile-plan" / profile_plan.probe_trial(index, repeat) / "metrics.jsonl"
             for repeat in range(args.repeats)] for index in range(len(probes))]
    if problem.cluster.parallel_devices_per_node is None or not all(
            path.is_file() for paths in runs for path in paths):
        return None
    cluster = dataclasses.replace(problem.cluster, parallel_devices_per_node=None, contention=0.0)
    samples: dict[str, list[ProbeSample]] = {name: [] for name in problem.works}
    for allocation_mode, paths in zip(probes, runs, strict=True):
        layouts = profile_plan.probe_layouts(problem, allocation_mode)
        seconds, _ = profile_plan.median_over_runs(
            [profile_plan.measured_mfc_seconds(path, list(problem.works)) for path in paths])
        for name, value in seconds.items():
            samples[name].append(ProbeSample(layouts[name], value))
    return dataclasses.replace(problem, cluster=cluster,
                               calibration=fit(problem.works, cluster, samples))


def problem_of(args: argparse.Namespace, experiment: str, plan: str,
               calibrated: bool = True) -> tuple[SearchProblem, dict[str, Layout]]:
    """The launcher's search problem for the experiment's keys and the layouts `plan`
    resolves to (a search runs for ``search``)."""
    entry = get_experiment("ppo-math")
    config = resolve_config(entry.config_class, overrides(args, experiment, plan, "predict"),
                            [], defaults={"experiment_name": entry.name})
    launch = prepare_launch(config)
    problem = launch_problem(config, launch.spec, launch.graph, cpu_workers=True,
                             calibrated=calibrated)
    layouts = {name: Layout(allocation.mesh, allocation.strategy,
                            problem.works[name].microbatch_choices[0])
               for name, allocation in launch.allocations.items()}
    return problem, {name: layouts[name] for name in problem.works}


def resolved_mode(layouts: dict[str, Layout]) -> str:
    return ",".join(layout.text(name) for name, layout in layouts.items())


def predicted(args: argparse.Namespace, experiment: str,
              plan: str) -> tuple[float, float | None, str]:
    """(predicted step seconds, the same without core sharing where workers share cores, the
    allocation_mode the plan resolves to)."""
    problem, layouts = problem_of(args, experiment, plan)
    plan_result = Evaluator(problem).plan(layouts)
    without_sharing = unshared(args, problem, args.work_dir / "profile" / experiment)
    unshared_s = Evaluator(without_sharing).plan(layouts).step_seconds if without_sharing else None
    resolved = resolved_mode(layouts)
    parse_allocation_mode(resolved, list(layouts), 1, args.workers)  # round-trips
    return plan_result.step_seconds, unshared_s, resolved


def measured_plan(row: dict) -> str:
    """The allocation a row's runs measured: a search is priced as the plan it chose then (a
    search now, with another calibration, may choose another)."""
    return row["resolved"] if row["plan"] == "search" else row["plan"]


def trial_metrics(args: argparse.Namespace, trial: str) -> Path:
    return args.work_dir / "runs" / "plan-search" / trial / "metrics.jsonl"


def measured(args: argparse.Namespace, experiment: str, plan: str,
             trial: str) -> tuple[float, float | None]:
    """(the run's median step, the fraction of CPU time stolen while it ran)."""
    with StealMeter() as steal:
        steps = run_quickstart("ppo-math", overrides(args, experiment, plan, trial),
                               trial_metrics(args, trial).parent,
                               args.work_dir / "logs" / f"{trial}.log", args.timeout_s)
    step_s = [record["timing/step_s"] for record in steps]
    return statistics.median(step_s[1:] or step_s), steal.fraction


def refit(args: argparse.Namespace, experiment: str, rows: list[dict]) -> Path:
    """Fit the calibration again to every run of each probe's allocation (the profile's runs
    and the runs here, which the machine's drift between the two phases would otherwise split),
    save it where the launcher reads it, and return its path."""
    problem, _ = problem_of(args, experiment, "auto", calibrated=False)
    probes = profile_plan.probe_allocations(problem)
    side_by_side = profile_plan.side_by_side_allocation(problem)
    allocations = probes + ([side_by_side] if side_by_side else [])
    profile_dir = args.work_dir / "profile" / experiment / "profile-plan"
    runs = []
    for index, allocation_mode in enumerate(allocations):
        resolved = resolved_mode(profile_plan.probe_layouts(problem, allocation_mode))
        runs.append([profile_dir / profile_plan.probe_trial(index, repeat) / "metrics.jsonl"
                     for repeat in range(args.repeats)]
                    + [trial_metrics(args, trial) for row in rows if row["resolved"] == resolved
                       for trial in row["trials"]])
    calibration = profile_plan.calibrate_from_runs(problem, probes, side_by_side, runs)
    logger.info("%s: calibration fitted again to %s runs of the probes' allocations "
                "(contention %.3f)", experiment, [len(paths) for paths in runs],
                calibration.contention)
    return save_calibration(problem.works, problem.cluster, calibration)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    args.work_dir = Path(args.work_dir).resolve()
    results = []
    if args.reprice:
        results = json.loads((args.work_dir / "results.json").read_text())
        for row in results:
            row["predicted_s"], row["predicted_unshared_s"], _ = predicted(
                args, row["experiment"], measured_plan(row))
    for experiment in args.experiments.split(",") if not args.reprice else ():
        if not args.plans and (experiment, args.workers) not in PLANS:
            raise SystemExit(f"no default plans for {experiment} on {args.workers} workers; "
                             "give --plans")
        plans = args.plans.split(";") if args.plans else PLANS[experiment, args.workers]
        probes = [] if args.no_profile else calibrate(args, experiment)
        rows = []
        for plan in plans:
            prediction, unshared_s, resolved = predicted(args, experiment, plan)
            rows.append({"experiment": experiment, "plan": plan, "resolved": resolved,
                         "predicted_s": prediction, "runs_s": [], "loads": [], "steals": [],
                         "trials": [], "predicted_unshared_s": unshared_s})
        probe_problem, _ = problem_of(args, experiment, "auto", calibrated=False)
        probe_modes = {resolved_mode(profile_plan.probe_layouts(probe_problem, probe))
                       for probe in probes}
        for row in rows:
            row["probe"] = row["resolved"] in probe_modes
        for repeat in range(args.repeats):  # in rounds, as the probes
            for index, row in enumerate(rows):
                trial = f"{experiment}-{index}" + (f"-run{repeat + 1}" if repeat else "")
                step_s, steal = measured(args, experiment, row["plan"], trial)
                row["trials"].append(trial)
                row["runs_s"].append(step_s)
                row["steals"].append(steal)
                row["loads"].append(os.getloadavg()[0])
                row["measured_s"] = statistics.median(row["runs_s"])
                row["load"] = max(row["loads"])
                logger.info("%s", row)
        if probes:
            refit(args, experiment, rows)
            for row in rows:
                row["predicted_profile_s"] = row["predicted_s"]
                row["predicted_s"], row["predicted_unshared_s"], _ = predicted(
                    args, experiment, measured_plan(row))
                if row["plan"] == "search":
                    row["searched_again_s"], _, row["searched_again"] = predicted(
                        args, experiment, "search")
        results += rows
    (args.work_dir / "results.json").write_text(json.dumps(results, indent=1))
    for experiment in args.experiments.split(","):
        sys.stdout.write(table([r for r in results if r["experiment"] == experiment]) + "\n")


def table(rows: list[dict]) -> str:
    """The markdown table of one experiment's rows, and the search's choice under the fit to
    every run when it was made again."""
    experiment = rows[0]["experiment"]
    shared = any(r.get("predicted_unshared_s") is not None for r in rows)
    refitted = any("predicted_profile_s" in r for r in rows)
    runs = " (median of runs)" if any(len(r.get("runs_s", [])) > 1 for r in rows) else ""
    steal = all(r.get("steals") and None not in r["steals"] for r in rows)
    header = (f"| allocation_mode | resolved | predicted s | measured s{runs} | error |"
              + (" from the profile's runs alone: predicted s | error |" if refitted else "")
              + (" steal |" if steal else " load |")
              + (" without core sharing: predicted s | error |" if shared else ""))
    lines = [f"{experiment}:", header, "|" + "---|" * header.count(" |")]
    for r in rows:
        probe = " (probe)" if r.get("probe") else ""
        each = ", ".join(f"{s:.3f}" for s in r.get("runs_s", [])) if runs else ""
        line = (f"| `{r['plan']}`{probe} | `{r['resolved']}` | {r['predicted_s']:.3f} | "
                f"{r['measured_s']:.3f}{f' ({each})' if each else ''} | "
                f"{r['predicted_s'] / r['measured_s'] - 1:+.0%} |")
        if refitted:
            line += (f" {r['predicted_profile_s']:.3f} | "
                     f"{r['predicted_profile_s'] / r['measured_s'] - 1:+.0%} |")
        line += (f" {max(r['steals']):.0%} |" if steal else f" {r['load']:.1f} |")
        if shared:
            alone = r["predicted_unshared_s"]
            line += f" {alone:.3f} | {alone / r['measured_s'] - 1:+.0%} |"
        lines.append(line)
    for r in rows:
        if "searched_again" in r:
            same = "the same plan" if r["searched_again"] == r["resolved"] else "a different plan"
            lines += ["", f"searched again with the fit to every run: {same}, "
                      f"`{r['searched_again']}` (predicted {r['searched_again_s']:.3f} s)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
