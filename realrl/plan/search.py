"""Search over per-MFC layouts for the shortest predicted step (ReaLHF's search, Mei et al.
2024, section 5: a step simulated over the dataflow graph, Metropolis moves over one MFC's
allocation at a time).

A plan gives every MFC one `Layout`. Its step is simulated in graph order: an MFC starts once
the MFCs it reads from have finished and every device of its mesh is free (a device runs one
call at a time; MFCs on disjoint meshes overlap), first moves its role's newest weights onto
its layout when the role is trained elsewhere (`realrl.plan.costs.realloc_seconds`), then runs
for `mfc_seconds` (corrected by the problem's `calibration`, fitted to real runs, when it has
one). A train call whose first forward the master sends ahead (`MFCWork.forward_ahead_after`,
`MFCDef.forward_keys`) is two calls: that forward, a third of the call besides its gradient
reduce (a backward costs two forwards), once the calls it reads from have finished and before
the other calls they make ready (the master wakes the forwards first), and the rest after all
its inputs. A plan whose peak memory on any device exceeds the limit is never returned. Where a
node's devices slow each other (CPU workers that outnumber its cores,
`Cluster.parallel_devices_per_node`, or that contend for its caches, memory and the master's
core, `Cluster.contention`), the step is simulated event by event instead, each running call at
`Cluster.speed` of what runs beside it.

Small spaces are enumerated; larger ones get simulated annealing from the best symmetric plan
for 60% of the time budget, then a coordinate-descent polish (each MFC's best layout with the
others fixed, until nothing improves) for the rest. The budget counts this process's CPU
seconds, so that a search on a loaded machine looks as far as on a quiet one (and takes longer).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

from realrl.plan.calibration import Calibration, corrected_seconds
from realrl.plan.candidates import candidate_layouts
from realrl.plan.costs import Cluster, Layout, MFCWork, WorkKind, gradient_seconds, realloc_seconds
from realrl.plan.memory import peak_bytes_array, peak_bytes_per_device


@dataclasses.dataclass(frozen=True)
class SearchProblem:
    works: dict[str, MFCWork]  # in the graph's (topological) order
    dependencies: dict[str, tuple[str, ...]]  # MFC -> the MFCs whose outputs it reads
    cluster: Cluster
    allow_pipeline: bool = False  # the torch backend runs no pipeline parallelism
    shard_optimizer: bool = False  # megatron-core's distributed optimizer
    microbatch_choices: tuple[int, ...] = (1, 2, 4, 8)
    memory_limit_bytes: float | None = None  # None: the device's memory
    calibration: Calibration | None = None  # per-MFC corrections from real runs

    @property
    def memory_limit(self) -> float:
        return self.memory_limit_bytes or self.cluster.device.memory_bytes


def call_label(name: str, part: str) -> str:
    """``actor_train/forward`` for a part of an MFC's call, the MFC's name for the call."""
    return f"{name}/{part}" if part else name


@dataclasses.dataclass(frozen=True)
class TimelineEntry:
    name: str
    start_s: float
    realloc_s: float  # weights moved onto this layout before the call
    run_s: float  # the call itself (compute and communication)
    part: str = ""  # "forward": a train call's forward sent ahead; "": the (rest of the) call

    @property
    def label(self) -> str:
        return call_label(self.name, self.part)

    @property
    def finish_s(self) -> float:
        return self.start_s + self.realloc_s + self.run_s


@dataclasses.dataclass(frozen=True)
class Plan:
    layouts: dict[str, Layout]
    step_seconds: float  # inf when over the memory limit
    timeline: tuple[TimelineEntry, ...]
    peak_bytes: float  # the largest device's

    def allocation_mode(self) -> str:
        return ",".join(layout.text(name) for name, layout in self.layouts.items())


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of the timeline: an MFC, or the forward a train MFC sends ahead (`part`)."""

    name: str
    part: str
    after: tuple[str, ...]  # the calls (keys) whose outputs it reads
    realloc_s: float
    run_s: float

    @property
    def key(self) -> str:
        return call_label(self.name, self.part)


class Evaluator:
    """Predicts plans of one problem; caches each MFC's per-layout seconds."""

    def __init__(self, problem: SearchProblem):
        self.problem = problem
        self._seconds: dict[tuple[str, Layout], float] = {}
        self._trainer = {work.role: name for name, work in problem.works.items()
                         if work.kind == WorkKind.train_step}
        self.evaluations = 0

    def seconds(self, name: str, layout: Layout) -> float:
        key = (name, layout)
        if key not in self._seconds:
            calibration = self.problem.calibration
            self._seconds[key] = corrected_seconds(
                self.problem.works[name], layout, self.problem.cluster,
                calibration.correction(name) if calibration else None)
        return self._seconds[key]

    def realloc(self, name: str, layouts: dict[str, Layout]) -> float:
        work = self.problem.works[name]
        trainer = self._trainer.get(work.role)
        if trainer is None or trainer == name or work.model is None:
            return 0.0
        return realloc_seconds(work.model, work.dtype, layouts[trainer], layouts[name],
                               self.problem.cluster)

    def forward_seconds(self, name: str, layout: Layout) -> float:
        """The forward a train call sends ahead: one of its ``3 x epochs`` passes (a backward
        costs two forwards) of what it costs besides the gradient reduce, which follows the
        backward."""
        work = self.problem.works[name]
        rest = self.seconds(name, layout) - gradient_seconds(work, layout, self.problem.cluster)
        return rest / (3 * work.epochs)

    def calls(self, layouts: dict[str, Layout]) -> list[_Call]:
        """The step's calls in the order the master hands out ranks: the MFCs in graph order,
        each train call's forward sent ahead right after the last call it reads from."""
        works = self.problem.works
        calls: list[_Call] = []
        for name, work in works.items():
            after = tuple(self.problem.dependencies.get(name, ()))
            run_s = self.seconds(name, layouts[name])
            if work.forward_ahead_after:
                forward = _Call(name, "forward", work.forward_ahead_after, 0.0,
                                self.forward_seconds(name, layouts[name]))
                position = 1 + max(index for index, call in enumerate(calls)
                                   if call.key in work.forward_ahead_after)
                calls.insert(position, forward)
                after, run_s = after + (forward.key,), run_s - forward.run_s
            calls.append(_Call(name, "", after, self.realloc(name, layouts), run_s))
        return calls

    def timeline(self, layouts: dict[str, Layout]) -> tuple[TimelineEntry, ...]:
        if self.problem.cluster.devices_interfere:
            return self._shared_timeline(layouts)
        finished: dict[str, float] = {}
        device_free: dict[int, float] = {}
        entries = []
        for call in self.calls(layouts):
            ranks = layouts[call.name].mesh.ranks
            start = max([finished[key] for key in call.after]
                        + [device_free.get(rank, 0.0) for rank in ranks] + [0.0])
            entry = TimelineEntry(call.name, start, call.realloc_s, call.run_s, call.part)
            finished[call.key] = entry.finish_s
            for rank in ranks:
                device_free[rank] = entry.finish_s
            entries.append(entry)
        return tuple(entries)

    def _shared_timeline(self, layouts: dict[str, Layout]) -> tuple[TimelineEntry, ...]:
        """The same order of calls on devices that slow each other: an event simulation in
        which every running call progresses at `Cluster.speed` of the calls running beside it.
        `seconds` are full-speed seconds (a calibration divides out each probe's own slowdown),
        so a call alone on few enough devices takes exactly them."""
        cluster, calls = self.problem.cluster, self.calls(layouts)
        by_key = {call.key: call for call in calls}
        before: dict[str, set[str]] = {}  # the calls that must finish first
        last_on: dict[int, str] = {}
        for call in calls:
            ranks = layouts[call.name].mesh.ranks
            before[call.key] = set(call.after)
            before[call.key] |= {last_on[rank] for rank in ranks if rank in last_on}
            for rank in ranks:
                last_on[rank] = call.key
        left = {call.key: call.realloc_s + call.run_s for call in calls}
        start: dict[str, float] = {}
        finish: dict[str, float] = {}
        now = 0.0
        while len(finish) < len(calls):
            for call in calls:
                if call.key not in start and before[call.key] <= finish.keys():
                    start[call.key] = now
            running = [key for key in start if key not in finish]
            meshes = {key: layouts[by_key[key].name].mesh.ranks for key in running}
            busy = cluster.devices_per_node(rank for key in running for rank in meshes[key])
            speed = {key: cluster.speed(busy, meshes[key]) for key in running}
            step = min(left[key] / speed[key] for key in running)
            now += step
            for key in running:
                left[key] -= step * speed[key]
                call = by_key[key]
                if left[key] <= 1e-12 * max(1.0, call.realloc_s + call.run_s):
                    finish[key] = now
        entries = []
        for call in calls:
            full = call.realloc_s + call.run_s
            stretch = (finish[call.key] - start[call.key]) / full if full else 1
            entries.append(TimelineEntry(call.name, start[call.key], call.realloc_s * stretch,
                                         call.run_s * stretch, call.part))
        return tuple(entries)

    def plan(self, layouts: dict[str, Layout]) -> Plan:
        self.evaluations += 1
        peak = float(peak_bytes_array(self.problem.works, layouts,
                                      self.problem.shard_optimizer).max())
        timeline = self.timeline(layouts)
        step = max(entry.finish_s for entry in timeline)
        if peak > self.problem.memory_limit:
            step = math.inf
        return Plan(dict(layouts), step, timeline, peak)


@dataclasses.dataclass
class SearchResult:
    plans: list[Plan]  # the best first, distinct, all within the memory limit
    symmetric: Plan | None  # the best plan with one layout for every MFC on the whole cluster
    space_size: int
    evaluations: int
    exhaustive: bool
    elapsed_s: float  # CPU seconds


def candidates_of(problem: SearchProblem) -> dict[str, list[Layout]]:
    """Each MFC's layouts that fit in memory on their own (the plan's check adds the rest)."""
    found = {}
    for name, work in problem.works.items():
        layouts = candidate_layouts(work, problem.cluster, problem.allow_pipeline,
                                    problem.microbatch_choices)
        fitting = [layout for layout in layouts
                   if max(peak_bytes_per_device({name: work}, {name: layout},
                                                problem.shard_optimizer).values(), default=0.0)
                   <= problem.memory_limit]
        found[name] = fitting
    return found


def best_symmetric(evaluator: Evaluator, candidates: dict[str, list[Layout]]) -> Plan | None:
    """Every MFC on the whole cluster with one data x tensor x pipeline split (each MFC's best
    micro-batch count): the layout a system without per-MFC allocation would use."""
    size = evaluator.problem.cluster.size
    by_strategy: dict = {}
    for name, layouts in candidates.items():
        for layout in layouts:
            if layout.mesh.size == size:
                by_strategy.setdefault(layout.strategy, {}).setdefault(name, []).append(layout)
    best = None
    for per_mfc in by_strategy.values():
        if len(per_mfc) != len(candidates):
            continue
        choice = {name: min(per_mfc[name], key=lambda lay, n=name: evaluator.seconds(n, lay))
                  for name in candidates}
        plan = evaluator.plan(choice)
        if best is None or plan.step_seconds < best.step_seconds:
            best = plan
    return best


def _plan_key(layouts: dict[str, Layout]) -> tuple:
    """The plan up to renumbering devices (ranks numbered by first use, MFC by MFC) and
    micro-batch counts: two plans with one key are the same plan on swapped devices."""
    numbering: dict[int, int] = {}
    key = []
    for name, layout in layouts.items():
        for rank in layout.mesh.ranks:
            numbering.setdefault(rank, len(numbering))
        key.append((name, tuple(sorted(numbering[rank] for rank in layout.mesh.ranks)),
                    layout.strategy))
    return tuple(key)


class _Keeper:
    """The `keep` best feasible plans seen that differ in more than micro-batch counts or a
    renumbering of the devices (`_plan_key`); of plans with one key the fastest is kept."""

    def __init__(self, keep: int):
        self.keep = keep
        self.plans: dict[tuple, Plan] = {}

    def offer(self, plan: Plan) -> None:
        if math.isinf(plan.step_seconds):
            return
        key = _plan_key(plan.layouts)
        if key not in self.plans or plan.step_seconds < self.plans[key].step_seconds:
            self.plans[key] = plan
        if len(self.plans) > 4 * self.keep:
            self.plans = dict(sorted(self.plans.items(),
                                     key=lambda item: item[1].step_seconds)[: self.keep])

    def best(self) -> list[Plan]:
        return sorted(self.plans.values(), key=lambda plan: plan.step_seconds)[: self.keep]


def _polish(evaluator: Evaluator, candidates: dict[str, list[Layout]], plan: Plan,
            keeper: _Keeper, deadline: float) -> Plan:
    """Coordinate descent: give each MFC its best layout with the others fixed, until none
    improves or the deadline passes."""
    improved = True
    while improved:
        improved = False
        for name, layouts in candidates.items():
            if time.process_time() > deadline:
                return plan
            for layout in layouts:
                trial = evaluator.plan({**plan.layouts, name: layout})
                keeper.offer(trial)
                if trial.step_seconds < plan.step_seconds * (1 - 1e-9):
                    plan, improved = trial, True
    return plan


def _anneal(evaluator: Evaluator, candidates: dict[str, list[Layout]], start: Plan,
            keeper: _Keeper, time_budget_s: float, max_evaluations: int, seed: int) -> Plan:
    """Metropolis moves (one MFC's layout at a time) at a temperature, relative to the current
    step time, cooling from 0.3 to 0.003 over the budget."""
    generator = random.Random(seed)
    names = list(candidates)
    current = best = start
    deadline = time.process_time() + time_budget_s
    for iteration in range(max_evaluations):
        progress = max(iteration / max_evaluations,
                       1 - (deadline - time.process_time()) / max(time_budget_s, 1e-9))
        if progress >= 1:
            break
        temperature = 0.3 * (0.01 ** progress)
        name = generator.choice(names)
        trial = evaluator.plan({**current.layouts, name: generator.choice(candidates[name])})
        keeper.offer(trial)
        if math.isinf(trial.step_seconds):
            continue
        delta = (trial.step_seconds - current.step_seconds) / current.step_seconds
        if delta <= 0 or generator.random() < math.exp(-delta / temperature):
            current = trial
            if current.step_seconds < best.step_seconds:
                best = current
    return best


def _feasible_start(evaluator: Evaluator, candidates: dict[str, list[Layout]],
                    seed: int) -> Plan | None:
    generator = random.Random(seed)
    for _ in range(2000):
        plan = evaluator.plan({n: generator.choice(c) for n, c in candidates.items()})
        if not math.isinf(plan.step_seconds):
            return plan
    return None


def search(problem: SearchProblem, time_budget_s: float = 3.0, keep: int = 5,
           exhaustive_limit: int = 20000, max_evaluations: int = 200000,
           seed: int = 0) -> SearchResult:
    """The `keep` fastest plans found (see the module docstring). Raises ValueError when no
    plan fits in memory, naming the MFCs with no layout that fits on its own."""
    started = time.process_time()
    evaluator = Evaluator(problem)
    candidates = candidates_of(problem)
    empty = [name for name, layouts in candidates.items() if not layouts]
    if empty:
        raise ValueError(f"no layout of MFC(s) {', '.join(empty)} fits in "
                         f"{problem.memory_limit / 2**30:.1f} GiB per device on "
                         f"{problem.cluster.size} device(s); use more devices, bfloat16, or "
                         "pipeline parallelism")
    space_size = math.prod(len(layouts) for layouts in candidates.values())
    keeper = _Keeper(keep)
    symmetric = best_symmetric(evaluator, candidates)
    if symmetric is not None:
        keeper.offer(symmetric)
    exhaustive = space_size <= exhaustive_limit
    if exhaustive:
        names = list(candidates)
        for choice in itertools.product(*candidates.values()):
            keeper.offer(evaluator.plan(dict(zip(names, choice))))
    else:
        start = symmetric if symmetric and not math.isinf(symmetric.step_seconds) else \
            _feasible_start(evaluator, candidates, seed)
        if start is not None:
            annealed = _anneal(evaluator, candidates, start, keeper, 0.6 * time_budget_s,
                               max_evaluations, seed)
            _polish(evaluator, candidates, annealed, keeper, started + time_budget_s)
    if symmetric is not None and math.isinf(symmetric.step_seconds):
        symmetric = None
    plans = keeper.best()
    if not plans:
        raise ValueError(f"no plan fits in {problem.memory_limit / 2**30:.1f} GiB per device "
                         f"on {problem.cluster.size} device(s) (every MFC fits alone, but not "
                         "together); use more devices, bfloat16, or more micro-batches")
    return SearchResult(plans, symmetric, space_size, evaluator.evaluations, exhaustive,
                        time.process_time() - started)
