"""The soak test's arithmetic: per process and quantity, the peak and the late-run trend.

`summarise(result)` reads the samples that `soak.py` writes (each: `step`, machine-wide
quantities, and `processes: {name: {quantity: value}}`) and returns, per series, the peak over
the whole run and a least-squares line over the second half of the training steps (samples
with `final_step / 2 <= step < steps`: the first half holds warm-up, first-touch allocations
and the allocator settling; samples at the last step hold the final checkpoint and plot).

The line is fitted on the step, so its slope is "per 1000 steps" whatever the sampling rate or
the machine's speed. Noise, two ways: the slope's standard error (`slope_stderr`, from the
residuals, as if independent) and the residuals' standard deviation (`residual_std`, the
scatter around the line, in the quantity's unit). `growing` is set when the fitted rise over
the window (`rise` = slope x window steps) exceeds 3 standard errors and twice the residual
spread, and is material: for counts (fds, threads, segments) at least one whole unit, for
memory a slope of at least `min_slope_mib` per 1000 steps (default 0.1 MiB, 100 bytes a
step). A leak is a steady rise; a sawtooth of the allocator or a pool's worker coming and going
is scatter around a flat line. The floor is there because resident memory is so steady that
the statistics alone call a few pages significant: the model workers' RSS creeps up in steps
of a few hundred KiB when a batch larger than any before arrives (glibc keeps freed memory,
`realrl.workers.malloc`), 0.02 MiB per 1000 steps over a 5000-step run's second half.
"""

from __future__ import annotations

import math

PROCESS_QUANTITIES = ("rss_mib", "anon_mib", "shmem_mib", "fds", "sockets", "threads", "shm_mib")
MACHINE_QUANTITIES = ("run_shm_mib", "run_shm_segments", "run_shm_named_files",
                      "dev_shm_used_mib", "step_s")
COUNTS = {"fds", "sockets", "threads", "run_shm_segments", "run_shm_named_files"}
# Reported, never flagged: /dev/shm as a whole holds every user's files, and a step time is not
# a resource (it follows the machine's load).
NOT_FLAGGED = {"dev_shm_used_mib", "step_s"}
MIN_SLOPE_MIB = 0.1  # per 1000 steps; smaller memory slopes are never called growth


def fit_line(steps: list[float], values: list[float]) -> dict | None:
    """Least squares `value = intercept + slope * step`; slope and its noise per 1000 steps.
    None with fewer than 4 points or a single step (no slope to fit)."""
    n = len(steps)
    if n < 4:
        return None
    mean_step, mean_value = sum(steps) / n, sum(values) / n
    spread = sum((s - mean_step) ** 2 for s in steps)
    if spread == 0:
        return None
    slope = sum((s - mean_step) * (v - mean_value) for s, v in zip(steps, values)) / spread
    intercept = mean_value - slope * mean_step
    squared = sum((v - intercept - slope * s) ** 2 for s, v in zip(steps, values))
    residual_std = math.sqrt(squared / (n - 2))
    width = max(steps) - min(steps)
    return {"slope_per_1000_steps": 1000 * slope,
            "slope_stderr": 1000 * residual_std / math.sqrt(spread),
            "residual_std": residual_std, "window_steps": [min(steps), max(steps)],
            "rise": slope * width, "points": n}


def is_growing(fit: dict | None, quantity: str, min_slope_mib: float = MIN_SLOPE_MIB) -> bool:
    if fit is None or quantity in NOT_FLAGGED:
        return False
    width = fit["window_steps"][1] - fit["window_steps"][0]
    material = (fit["rise"] >= 1.0 if quantity in COUNTS
                else fit["slope_per_1000_steps"] >= min_slope_mib)
    return (material and fit["rise"] > 3 * fit["slope_stderr"] * width / 1000
            and fit["rise"] > 2 * fit["residual_std"])


def _series(samples: list[dict], read) -> list[tuple[int, float]]:
    points = []
    for sample in samples:
        value = read(sample)
        if value is not None:
            points.append((sample["step"], value))
    return points


def _describe(points: list[tuple[int, float]], quantity: str, window: tuple[float, float],
              min_slope_mib: float) -> dict:
    inside = [(step, value) for step, value in points if window[0] <= step < window[1]]
    fit = fit_line([float(s) for s, _ in inside], [float(v) for _, v in inside])
    return {"peak": max((v for _, v in points), default=None), "fit": fit,
            "growing": is_growing(fit, quantity, min_slope_mib)}


def summarise(result: dict, min_slope_mib: float = MIN_SLOPE_MIB) -> dict:
    """{"window_steps", "processes": {name: {"pids", quantity: {peak, fit, growing}}},
    "machine": {quantity: ...}, "growing": ["name quantity", ...]}."""
    samples = result["samples"]
    final_step = max((s["step"] for s in samples), default=0)
    # Up to, not including, the requested last step; all of it if the run stopped short.
    first, last = final_step / 2, result["steps"] if final_step >= result["steps"] else math.inf
    names = sorted({name for s in samples for name in s["processes"]})
    processes = {}
    for name in names:
        entry = {"pids": sorted({s["processes"][name]["pid"] for s in samples
                                 if name in s["processes"]})}
        for quantity in PROCESS_QUANTITIES:
            points = _series(samples, lambda s, n=name, q=quantity: s["processes"].get(n, {}).get(q))
            entry[quantity] = _describe(points, quantity, (first, last), min_slope_mib)
        processes[name] = entry
    machine = {quantity: _describe(_series(samples, lambda s, q=quantity: s.get(q)), quantity,
                                   (first, last), min_slope_mib)
               for quantity in MACHINE_QUANTITIES}
    growing = [f"{name} {q}" for name, entry in processes.items() for q in PROCESS_QUANTITIES
               if entry[q]["growing"]] + [q for q in MACHINE_QUANTITIES if machine[q]["growing"]]
    return {"window_steps": [first, min(last, final_step)], "min_slope_mib": min_slope_mib,
            "processes": processes, "machine": machine, "growing": growing}


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def _row(name: str, quantity: str, described: dict) -> str:
    fit = described["fit"]
    trend = "-" if fit is None else (f"{fit['slope_per_1000_steps']:+.3f} ± "
                                     f"{fit['slope_stderr']:.3f} (scatter {fit['residual_std']:.3f})")
    flag = "**GROWING**" if described["growing"] else "flat"
    return f"| {name} | {quantity} | {_number(described['peak'])} | {trend} | {flag} |"


def format_summary(result: dict) -> str:
    """A markdown table (one row per process and quantity) and a verdict."""
    summary = result["summary"]
    first, last = summary["window_steps"]
    lines = [f"soak: {result['final_step']}/{result['steps']} steps in {result['wall_s']:.0f} s, "
             f"exit {result['returncode']}, {len(result['samples'])} samples every "
             f"{result['interval_s']} s, load {result['load_1m_start']:.1f} -> "
             f"{result['load_1m_end']:.1f}; slopes fitted over steps {first:.0f}-{last:.0f}"
             + (f"; stopped early: {result['stopped']}" if result.get("stopped") else ""),
             "", "| process | quantity | peak | slope per 1000 steps ± stderr (scatter) | trend |",
             "|---|---|---|---|---|"]
    for name, entry in summary["processes"].items():
        for quantity in PROCESS_QUANTITIES:
            lines.append(_row(f"{name} (pids {len(entry['pids'])})", quantity, entry[quantity]))
    for quantity, described in summary["machine"].items():
        lines.append(_row("machine", quantity, described))
    lines.append("")
    lines.append(f"orphans after exit: {result['orphans'] or 'none'}; realrl files left in "
                 f"/dev/shm: {result['realrl_shm_files_left'] or 'none'}")
    lines.append("growth beyond noise: " + (", ".join(summary["growing"]) or "none"))
    return "\n".join(lines)
