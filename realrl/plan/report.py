"""A search result as text: the best plans with their predicted step, each MFC's timeline and
memory, the symmetric layout for comparison, and why the runner-up lost."""

from __future__ import annotations

from realrl.api.allocation import format_ranks
from realrl.plan.costs import Layout
from realrl.plan.memory import held_bytes, transient_bytes
from realrl.plan.search import Plan, SearchProblem, SearchResult

GIB = 2**30


def _memory_text(num_bytes: float) -> str:
    if num_bytes >= 0.1 * GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def timeline_table(problem: SearchProblem, plan: Plan) -> str:
    """One line per MFC: layout, ranks, start, weight move, run, finish, its own memory."""
    header = (f"  {'MFC':<19} {'layout':<12} {'ranks':<8} {'start s':>8} {'realloc s':>9} "
              f"{'run s':>8} {'end s':>8}  memory/device")
    lines = [header]
    trained = {(work.role, plan.layouts[name].mesh, plan.layouts[name].strategy)
               for name, work in problem.works.items() if work.kind.value == "train_step"}
    for entry in plan.timeline:
        layout, work = plan.layouts[entry.name], problem.works[entry.name]
        key = (work.role, layout.mesh, layout.strategy)
        memory = (held_bytes(work, layout, key in trained, problem.shard_optimizer)
                  + transient_bytes(work, layout))
        micro = f" mb{layout.num_microbatches}" if layout.num_microbatches > 1 else ""
        lines.append(
            f"  {entry.label:<19} {str(layout.strategy) + micro:<12} "
            f"{format_ranks(layout.mesh.ranks):<8} {entry.start_s:8.3f} {entry.realloc_s:9.3f} "
            f"{entry.run_s:8.3f} {entry.finish_s:8.3f}  {_memory_text(memory)}")
    return "\n".join(lines)


def _layout_text(layout: Layout) -> str:
    micro = f" mb{layout.num_microbatches}" if layout.num_microbatches > 1 else ""
    return f"{layout.strategy}@{format_ranks(layout.mesh.ranks)}{micro}"


def why_runner_up_lost(best: Plan, runner_up: Plan) -> str:
    """The MFCs whose layout differs, with the seconds each one gained or lost, and which of
    them finishes later on the runner-up's critical path."""
    gap = runner_up.step_seconds - best.step_seconds
    parts = []
    best_entries = {entry.label: entry for entry in best.timeline}
    for entry in runner_up.timeline:
        ours, theirs = best.layouts[entry.name], runner_up.layouts[entry.name]
        mine = best_entries[entry.label]
        if ours == theirs and abs(entry.finish_s - mine.finish_s) < 1e-12:
            continue
        if ours != theirs:
            change = f"{_layout_text(theirs)} instead of {_layout_text(ours)}"
        else:
            change = "same layout"
        parts.append(
            f"{entry.label}: {change}: run {mine.run_s:.3f} -> {entry.run_s:.3f} s, realloc "
            f"{mine.realloc_s:.3f} -> {entry.realloc_s:.3f} s, ends {mine.finish_s:.3f} -> "
            f"{entry.finish_s:.3f} s")
    share = gap / best.step_seconds if best.step_seconds else 0.0
    gap_text = f"{gap:.3f} s" if gap >= 1 else f"{gap * 1000:.2f} ms"
    verdict = (f"the runner-up is {gap_text} ({share:.2%}) slower:" if gap > 1e-9 * best.step_seconds
               else "the runner-up ties (what it changes is off the critical path):")
    return verdict + "\n    " + "\n    ".join(parts or ["(no MFC differs)"])


def describe(problem: SearchProblem, result: SearchResult, show: int = 3) -> str:
    cluster = problem.cluster
    how = ("enumerated" if result.exhaustive else
           f"simulated annealing + coordinate descent, {result.evaluations:,} evaluated")
    best = result.plans[0]
    lines = [
        f"device: {cluster.device.name}, {cluster.n_nodes} node(s) x "
        f"{cluster.n_devices_per_node}, memory limit {_memory_text(problem.memory_limit)} "
        f"per device",
        f"plans: {result.space_size:.3g} ({how}) in {result.elapsed_s:.1f} CPU s",
    ]
    if problem.calibration is not None:
        lines.append(f"per-MFC costs calibrated by real runs: {problem.calibration.source}")
    elif not cluster.device.is_gpu:
        lines.append("per-MFC costs not calibrated (FLOPs and kernel costs only: on a CPU they "
                     "miss most of a call's time); `python -m realrl.apps.profile_plan "
                     "<experiment> <the same key=value ...>` measures them")
    if result.symmetric is not None:
        speedup = result.symmetric.step_seconds / best.step_seconds
        strategy = next(iter(result.symmetric.layouts.values())).strategy
        lines.append(f"symmetric layout ({strategy} for every MFC on all devices): "
                     f"{result.symmetric.step_seconds:.3f} s per step; best plan {speedup:.2f}x")
    for rank, plan in enumerate(result.plans[:show], start=1):
        lines += ["", f"#{rank}: {plan.step_seconds:.3f} s per step, peak "
                  f"{_memory_text(plan.peak_bytes)} per device",
                  f"  allocation_mode='{plan.allocation_mode()}'",
                  timeline_table(problem, plan)]
    if len(result.plans) > 1:
        lines += ["", "why #2 lost: " + why_runner_up_lost(best, result.plans[1])]
    return "\n".join(lines)
