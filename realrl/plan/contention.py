"""How much calls side by side on one machine's CPU workers slow each other, from a probe run.

Two one-core workers and the master on a two-core machine are not two independent devices: a
call runs slower while a different call runs on the other worker (they share the caches and the
memory bandwidth, and the master's work for either takes a core from one of them). The probes
that run every MFC on one worker or on all of them cannot see it: a call on all the workers
slows itself the same way in every plan, and the per-MFC fit absorbs that. So
`python -m realrl.apps.profile_plan` adds a *side-by-side probe* where the graph has calls that
can overlap: the graph's roles alternate between the two halves of the workers (the first
role's MFCs on the first half, the second's on the other, ...), and `fit_contention` chooses the
`Cluster.contention` under which the simulated step takes as long as that probe's did. The
per-MFC corrections are fitted again for each value tried, since a probe on all workers is
itself slowed by the contention it is fitted with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from realrl.api.allocation import DeviceMesh, ParallelStrategy
from realrl.plan.calibration import Calibration
from realrl.plan.costs import Cluster, Layout
from realrl.plan.search import Evaluator, SearchProblem

# The values tried: 0 (no slowdown) to 2 (a call beside another takes three times as long).
CONTENTION_GRID = tuple(index / 200 for index in range(401))


def side_by_side_layouts(problem: SearchProblem) -> dict[str, Layout] | None:
    """The side-by-side probe: the graph's roles in order of their first MFC, alternately on the
    first and the second half of the workers, each MFC data-parallel over its half (with its
    configured micro-batch count); None on an odd number of workers or when no two of the
    probe's calls can run at once (one model and a rule reward after it, as GRPO without a
    reference)."""
    cluster = problem.cluster
    if cluster.size < 2 or cluster.size % 2:
        return None
    half = cluster.size // 2
    halves = (tuple(range(half)), tuple(range(half, cluster.size)))
    roles = list(dict.fromkeys(work.role for work in problem.works.values()))
    layouts = {
        name: Layout(DeviceMesh(cluster.n_nodes, cluster.n_devices_per_node,
                                halves[roles.index(work.role) % 2]),
                     ParallelStrategy(data=half),
                     work.microbatch_choices[0] if work.microbatch_choices else 1)
        for name, work in problem.works.items()}
    return layouts if overlapping(problem, layouts) else None


def overlapping(problem: SearchProblem, layouts: dict[str, Layout]) -> bool:
    """Whether two calls of the plan run at once: its step grows with the contention."""
    steps = [Evaluator(with_contention(problem, contention)).plan(layouts).step_seconds
             for contention in (0.0, 1.0)]
    return steps[1] > steps[0] * (1 + 1e-9)


def with_contention(problem: SearchProblem, contention: float) -> SearchProblem:
    return dataclasses.replace(
        problem, cluster=dataclasses.replace(problem.cluster, contention=contention))


def fit_contention(problem: SearchProblem, fit_corrections: Callable[[Cluster], Calibration],
                   layouts: dict[str, Layout], measured_step_s: float) -> Calibration:
    """The calibration whose contention makes the side-by-side probe's simulated step closest
    to `measured_step_s` (the smallest such value: 0 when even no slowdown is too slow);
    `fit_corrections(cluster)` fits the per-MFC corrections on a cluster with a given
    contention. The step, not each call: besides running slower, calls side by side make the
    master dispatch the next ones later (measured on 2 workers: 38 ms of a 0.28 s step between
    the calls on its critical path, against 14 ms of 0.35 s with every call on one worker), and
    the step is what the search minimises."""
    best: tuple[float, Calibration] | None = None
    for contention in CONTENTION_GRID:
        contended = with_contention(problem, contention)
        calibration = dataclasses.replace(fit_corrections(contended.cluster),
                                          contention=contention)
        step_s = Evaluator(dataclasses.replace(contended, calibration=calibration)
                           ).plan(layouts).step_seconds
        error = abs(math.log(step_s / measured_step_s))
        if best is None or error < best[0] - 1e-12:
            best = (error, calibration)
    assert best is not None
    return best[1]
