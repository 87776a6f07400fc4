"""The master's hang watchdog: deadlines for every call, heartbeats from every model worker.

Why: a worker that dies ends the run within seconds (`realrl.launcher.processes`), but one that
stops without dying (SIGSTOP, a frozen node, a collective whose peer never comes, an interpreter
lock held for ever) used to leave the master waiting for its reply for a day. Now:

- The master records every request it sends, per rank: which call (an MFC, a weight transfer,
  a checkpoint save), at which step, since when (`InFlightCalls`, filled by
  `realrl.workers.master.Master`). A call that returns adds its duration to its name's history.
- Each call has a deadline (`DeadlinePolicy`): `watchdog.deadline_multiple` times the median of
  the last `MEDIAN_WINDOW` durations of the same call, at least `watchdog.min_deadline_s`; each
  rank's first `watchdog.warmup_calls` calls of each name (compilation, CUDA graph capture, NCCL
  set-up) get `watchdog.warmup_deadline_s`.
- Every `watchdog.heartbeat_interval_s` the master pings each worker's heartbeat thread
  (`realrl.workers.heartbeat`), which answers while the worker is busy; a worker that answers
  nothing for `watchdog.heartbeat_timeout_s` is hung whatever it was doing.

When a call outlives its deadline or a worker falls silent, `Watchdog.run` cancels the step loop
and raises `HangError` with one diagnosis (`realrl.workers.hang_report`): the call, the late
ranks, what each was doing and its Python stack (or why there is none: a stopped process), and
the end of its log. The master writes it to `<run_dir>/logs/watchdog.txt` and exits with
`HANG_EXIT_CODE`; the launcher then stops every process and shows that file.

The clock is the master's monotonic clock minus the time the master itself could not run (a
suspended SLURM job stops the master with its workers: on resumption nothing has overrun).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from realrl.api.config import WatchdogConfig
from realrl.workers import hang_report
from realrl.workers.hang_report import WorkerProcess
from realrl.workers.transport import AsyncClient
from realrl.workers.wire import Message, TransportError

T = TypeVar("T")

HANG_EXIT_CODE = 3  # the master's exit code after the watchdog stopped the run
MEDIAN_WINDOW = 100  # durations per call name that the median is taken over
_TICK_S = 1.0  # how often the watchdog looks (at most; less with faster heartbeats)
_PAUSE_SLACK_S = 2.0  # a tick this much later than due: the master itself did not run


class HangError(RuntimeError):
    """The watchdog stopped the run; `report` is the whole diagnosis, `report_path` its file."""

    def __init__(self, headline: str, report: str, report_path: Path):
        super().__init__(f"{headline}; the full diagnosis is in {report_path}")
        self.headline, self.report, self.report_path = headline, report, report_path


class WatchdogClock:
    """`time.monotonic()` minus the time during which the master's event loop did not run."""

    def __init__(self) -> None:
        self._paused_s = 0.0

    def now(self) -> float:
        return time.monotonic() - self._paused_s

    def skip(self, seconds: float) -> None:
        self._paused_s += seconds


@dataclass
class Call:
    """One request in flight on one rank. `kind` is the message kind ("mfc", "transfer",
    "save", "load", "exit"); `name` the MFC ("actor_gen", "actor_train/forward") or the
    transfer ("realloc/actor_gen", "ema/actor_train"); both kind and name if no other."""

    kind: str
    name: str
    step: int | None
    started: float  # WatchdogClock time

    def describe(self) -> str:
        what = {"mfc": f"MFC {self.name}", "transfer": f"weight transfer {self.name}"}.get(
            self.kind, f"the {self.name} request")
        return what if self.step is None else f"{what} (step {self.step})"


class DeadlinePolicy:
    """How long a call may run on a rank: `watchdog.deadline_multiple` x the median of its
    name's last `MEDIAN_WINDOW` durations (every rank's), at least `watchdog.min_deadline_s`;
    `watchdog.warmup_deadline_s` while that rank has finished fewer than `watchdog.warmup_calls`
    calls of the name (each rank compiles on its own first calls)."""

    def __init__(self, config: WatchdogConfig):
        self.config = config
        self._durations: dict[str, deque[float]] = {}
        self._finished: collections.Counter[tuple[str, int]] = collections.Counter()

    def observe(self, name: str, rank: int, seconds: float) -> None:
        self._durations.setdefault(name, deque(maxlen=MEDIAN_WINDOW)).append(seconds)
        self._finished[name, rank] += 1

    def deadline_s(self, name: str, rank: int) -> float:
        if self._finished[name, rank] < self.config.warmup_calls:
            return self.config.warmup_deadline_s
        return max(self.config.min_deadline_s,
                   self.config.deadline_multiple * statistics.median(self._durations[name]))

    def explain(self, name: str, rank: int) -> str:
        """Where `deadline_s(name, rank)` comes from, in the keys a user would change."""
        finished = self._finished[name, rank]
        if finished < self.config.warmup_calls:
            return (f"watchdog.warmup_deadline_s={self.config.warmup_deadline_s:g}: the rank's "
                    f"call {finished + 1}, within watchdog.warmup_calls={self.config.warmup_calls}")
        durations = self._durations[name]
        return (f"watchdog.deadline_multiple={self.config.deadline_multiple:g} x the median "
                f"{statistics.median(durations):.3g} s of its last {len(durations)} calls, at "
                f"least watchdog.min_deadline_s={self.config.min_deadline_s:g}")


class InFlightCalls:
    """Which calls each rank is in and since when; finished calls feed the `DeadlinePolicy`."""

    def __init__(self, clock: WatchdogClock, policy: DeadlinePolicy):
        self.clock, self.policy = clock, policy
        self.by_rank: dict[int, list[Call]] = {}
        self.exited: set[int] = set()  # ranks that answered "exit": their silence is expected

    @contextlib.contextmanager
    def track(self, rank: int, kind: str, name: str, step: int | None) -> Iterator[Call]:
        """Record a request to `rank` while it is in flight; a reply records its duration (a
        failed or cancelled request records none)."""
        call = Call(kind, name, step, self.clock.now())
        self.by_rank.setdefault(rank, []).append(call)
        try:
            yield call
        finally:
            self.by_rank[rank].remove(call)
        self.policy.observe(name, rank, self.clock.now() - call.started)
        if kind == "exit":
            self.exited.add(rank)


@dataclass
class Silence:
    rank: int
    seconds: float  # since the last heartbeat
    calls: list[Call]  # what it was doing


@dataclass
class Overrun:
    rank: int
    call: Call
    seconds: float  # the call's age
    deadline_s: float


@dataclass
class Watchdog:
    """Guards the master's step loop (`run`); `calls` is what the `Master` records into."""

    config: WatchdogConfig
    run_dir: Path
    workers: dict[int, WorkerProcess]  # from each worker's heartbeat publication
    secret: bytes
    clock: WatchdogClock = field(default_factory=WatchdogClock)
    calls: InFlightCalls = field(init=False)
    last_heard: dict[int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.calls = InFlightCalls(self.clock, DeadlinePolicy(self.config))
        self.last_heard = {rank: self.clock.now() for rank in self.workers}

    async def run(self, work: Awaitable[T]) -> T:
        """Await `work`; on a hang cancel it and raise `HangError`. Without `watchdog.enabled`
        just await it."""
        if not self.config.enabled:
            return await work
        clients = {rank: AsyncClient(worker.heartbeat_address, self.secret)
                   for rank, worker in self.workers.items()}
        main = asyncio.ensure_future(work)
        monitor = asyncio.create_task(self._monitor(clients))
        try:
            await asyncio.wait({main, monitor}, return_when=asyncio.FIRST_COMPLETED)
            if main.done():
                return main.result()
            main.cancel()
            await asyncio.wait({main}, timeout=10.0)  # its `finally`s flush metrics and logs
            raise monitor.exception() or RuntimeError("the watchdog stopped without a reason")
        finally:
            for task in (main, monitor):
                task.cancel()
            for client in clients.values():
                client.close()

    async def _monitor(self, clients: dict[int, AsyncClient]) -> None:
        """Ping every worker and check deadlines and heartbeats until one fails: raise
        `HangError` then (this coroutine never returns otherwise)."""
        pings = [asyncio.create_task(self._ping(rank, client)) for rank, client in clients.items()]
        tick_s = min(_TICK_S, self.config.heartbeat_interval_s)
        last_tick = time.monotonic()
        try:
            while True:
                await asyncio.sleep(tick_s)
                late_by = time.monotonic() - last_tick - tick_s
                if late_by > _PAUSE_SLACK_S:
                    self.clock.skip(late_by)  # suspended or starved: nobody could answer
                last_tick = time.monotonic()
                silences, overruns = self.silences(), self.overruns()
                if silences or overruns:
                    raise await self._diagnose(clients, silences, overruns)
        finally:
            for ping in pings:
                ping.cancel()

    async def _ping(self, rank: int, client: AsyncClient) -> None:
        timeout_s = self.config.heartbeat_timeout_s
        while True:
            with contextlib.suppress(TimeoutError, TransportError):
                await client.request(Message("ping"), timeout_s=timeout_s)
                self.last_heard[rank] = self.clock.now()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def silences(self) -> list[Silence]:
        now = self.clock.now()
        return [Silence(rank, now - heard, list(self.calls.by_rank.get(rank, [])))
                for rank, heard in sorted(self.last_heard.items())
                if rank not in self.calls.exited
                and now - heard > self.config.heartbeat_timeout_s]

    def overruns(self) -> list[Overrun]:
        now, policy = self.clock.now(), self.calls.policy
        return [Overrun(rank, call, now - call.started, policy.deadline_s(call.name, rank))
                for rank, calls in sorted(self.calls.by_rank.items()) for call in calls
                if now - call.started > policy.deadline_s(call.name, rank)]

    async def _diagnose(self, clients: dict[int, AsyncClient], silences: list[Silence],
                        overruns: list[Overrun]) -> HangError:
        headline = describe_hang(silences, overruns, self.config, self.calls.policy)
        silent = {silence.rank for silence in silences}
        names = {overrun.call.name for overrun in overruns}
        names |= {call.name for rank in silent for call in self.calls.by_rank.get(rank, [])}
        # The late ranks, the silent ones, and their partners in the same calls (often waiting
        # for them in a collective).
        ranks = sorted(silent | {rank for rank, calls in self.calls.by_rank.items()
                                 if any(call.name in names for call in calls)})
        now = self.clock.now()
        sections = await asyncio.gather(*(hang_report.describe_rank(
            rank, self.workers[rank], clients[rank], self.calls.by_rank.get(rank, []), now,
            now - self.last_heard[rank], rank in silent, self.run_dir) for rank in ranks))
        report = hang_report.compose(headline, sections, self.config)
        path = hang_report.write(self.run_dir, report)
        return HangError(headline, report, path)


def describe_hang(silences: list[Silence], overruns: list[Overrun], config: WatchdogConfig,
                  policy: DeadlinePolicy) -> str:
    """The diagnosis's first line: which calls overran on which ranks, which ranks fell silent."""
    problems = []
    by_call: dict[tuple, list[Overrun]] = {}  # ranks of one call with one deadline together
    for overrun in overruns:
        call = overrun.call
        by_call.setdefault((call.kind, call.name, call.step, overrun.deadline_s),
                           []).append(overrun)
    for late in by_call.values():
        call = late[0].call
        problems.append(
            f"{call.describe()} has run {_seconds(max(o.seconds for o in late))} on "
            f"{_ranks(o.rank for o in late)}, past its deadline of {_seconds(late[0].deadline_s)} "
            f"({policy.explain(call.name, late[0].rank)})"
        )
    for silence in silences:
        doing = "".join(f", in {call.describe()}," for call in silence.calls[:1])
        problems.append(
            f"rank {silence.rank}{doing} answered no heartbeat for {_seconds(silence.seconds)} "
            f"(watchdog.heartbeat_timeout_s={config.heartbeat_timeout_s:g})"
        )
    return "the hang watchdog stopped the run: " + "; ".join(problems)


def _ranks(ranks) -> str:
    ranks = sorted(set(ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _seconds(seconds: float) -> str:
    """3 significant digits below 100 s (a 1.04 s call is past a 1 s deadline), tenths above."""
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.1f} s"
