"""What the hang watchdog says about each late or silent model worker, and where it writes it.

For every rank it describes (`describe_rank`): the call it is in and for how long, whether it
still answers heartbeats, its Python stacks, and the end of its log. The stacks come, in order
of preference, from:
1. the worker's heartbeat thread (`realrl.workers.heartbeat`), over ZeroMQ, from any node;
2. faulthandler on SIGUSR2, written to the worker's log and read back from there, when the
   thread cannot answer but the process runs on the master's machine (its interpreter lock
   held for ever, say);
3. nothing, said plainly: a stopped process (state T, SIGSTOP or a debugger) cannot dump its
   stack, an exited one has none, and a process on another machine is out of the master's
   sight (its log names it).

Log files are read where the launchers put them, `<run_dir>/logs/worker<rank>.log` (locally
and under SLURM on a shared filesystem). The report goes to `<run_dir>/logs/watchdog.txt`
(`report_path`), which the local launcher shows when the master stops the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from realrl.api.config import WatchdogConfig
from realrl.workers.heartbeat import STACK_DUMP_SIGNAL, process_stat
from realrl.workers.transport import AsyncClient
from realrl.workers.wire import Message, TransportError

if TYPE_CHECKING:
    from realrl.workers.watchdog import Call

STACKS_TIMEOUT_S = 10.0  # for a heartbeat thread to send the stacks
LOG_DUMP_WAIT_S = 5.0  # for faulthandler's SIGUSR2 dump to reach the log
LOG_TAIL_LINES = 20
_TAIL_BYTES = 64 * 1024
PROCESS_STATES = {
    "R": "running", "S": "sleeping", "D": "in uninterruptible sleep (usually a disk or a network "
    "filesystem)", "T": "stopped", "t": "stopped by a debugger", "Z": "exited, not yet reaped",
    "X": "dead", "I": "idle",
}


@dataclass(frozen=True)
class WorkerProcess:
    """A model worker as its heartbeat publication names it."""

    heartbeat_address: str
    pid: int
    host: str
    start_ticks: int | None  # from /proc/<pid>/stat; None where there is no /proc

    @classmethod
    def from_publication(cls, text: str) -> WorkerProcess:
        data = json.loads(text)
        return cls(data["address"], int(data["pid"]), data["host"], data["start_ticks"])


def report_path(run_dir: Path) -> Path:
    return run_dir / "logs" / "watchdog.txt"


def worker_log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"worker{rank}.log"


def write(run_dir: Path, report: str) -> Path:
    path = report_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")
    return path


def compose(headline: str, sections: list[str], config: WatchdogConfig) -> str:
    advice = (
        "A rank waiting in a collective usually waits for a stopped or silent partner: look at "
        "that one first. If the call is only slow (long generations, a compilation, a slow "
        "filesystem), give it more time: watchdog.deadline_multiple="
        f"{config.deadline_multiple:g}, watchdog.min_deadline_s={config.min_deadline_s:g}, "
        f"watchdog.warmup_deadline_s={config.warmup_deadline_s:g} (first calls), "
        f"watchdog.heartbeat_timeout_s={config.heartbeat_timeout_s:g}; watchdog.enabled=false "
        "turns the watchdog off."
    )
    return "\n\n".join([headline, *sections, advice])


async def describe_rank(rank: int, worker: WorkerProcess, client: AsyncClient, calls: list[Call],
                        now: float, quiet_s: float, silent: bool, run_dir: Path) -> str:
    """One rank's section: what it is doing, since when, its stacks and its log's end.
    `calls` are its calls in flight, `quiet_s` the time since its last heartbeat, `silent`
    whether that is past the timeout."""
    doing = "; ".join(f"in {call.describe()} for {now - call.started:.1f} s" for call in calls)
    liveness = (f"no heartbeat for {quiet_s:.1f} s" if silent
                else f"alive (last heartbeat {quiet_s:.1f} s ago)")
    lines = [f"rank {rank} (pid {worker.pid} on {worker.host}): "
             f"{doing or 'idle (no request in flight)'}; {liveness}"]
    log_path = worker_log_path(run_dir, rank)
    tail = log_tail(log_path)  # before a SIGUSR2 dump lands in it
    lines += await _stacks(worker, client, silent, log_path)
    if tail is None:
        lines.append(f"  its log {log_path} is not readable here (no shared filesystem?)")
    else:
        lines.append(f"  last {len(tail)} lines of {log_path}:")
        lines += [f"    {line}" for line in tail] or ["    (empty)"]
    return "\n".join(lines)


async def _stacks(worker: WorkerProcess, client: AsyncClient, silent: bool,
                  log_path: Path) -> list[str]:
    if not silent:
        try:
            reply = await client.request(Message("stacks"), timeout_s=STACKS_TIMEOUT_S)
            return ["  its Python stacks (from its heartbeat thread):",
                    *_indent(str(reply.header.get("stacks", "")))]
        except (TimeoutError, TransportError):
            pass
    if worker.host != socket.gethostname():
        return [f"  it runs on {worker.host}, out of the master's sight: `kill -USR2 "
                f"{worker.pid}` there writes its stacks to its log"]
    state = local_process_state(worker)
    if state is None:
        return [f"  there is no process {worker.pid} on this machine any more (it exited, or it "
                "runs in another container)"]
    described = f"process state {state}: {PROCESS_STATES.get(state, 'unknown')}"
    if state in ("T", "t"):
        return [f"  STOPPED ({described}): someone sent it SIGSTOP, or a debugger holds it; a "
                "stopped process cannot dump its stack. It is killed with the run."]
    if state in ("Z", "X"):
        return [f"  it has exited ({described}); its log may say why"]
    dump = await _dump_to_log(worker.pid, log_path)
    return [f"  its heartbeat thread does not answer ({described}); on SIGUSR2 faulthandler "
            "wrote its stacks to its log:", *_indent(dump or "(nothing arrived in its log)")]


def local_process_state(worker: WorkerProcess) -> str | None:
    """The state letter (R, S, D, T, t, Z, ...) of `worker`'s process on this machine; None
    when this machine has no process of its pid that started when it did (it exited, or the
    pid belongs to another container's process)."""
    stat = process_stat(worker.pid)
    if stat is None or worker.start_ticks is None or int(stat[19]) != worker.start_ticks:
        return None
    return stat[0]


async def _dump_to_log(pid: int, log_path: Path) -> str:
    """Send SIGUSR2 and return what the worker's log gained meanwhile (faulthandler's dump)."""
    try:
        offset = log_path.stat().st_size
        os.kill(pid, STACK_DUMP_SIGNAL)
    except OSError:
        return ""
    text, waited_s, unchanged_polls = "", 0.0, 0
    while waited_s < LOG_DUMP_WAIT_S:
        await asyncio.sleep(0.5)
        waited_s += 0.5
        with open(log_path, "rb") as log:
            log.seek(offset)
            grown = log.read().decode(errors="replace")
        unchanged_polls = unchanged_polls + 1 if grown and grown == text else 0
        if unchanged_polls == 2:  # nothing more for a second: the dump is complete (a loaded
            break  # machine can pause the writer between threads for half a second)
        text = grown
    return text


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str] | None:
    """The last `lines` lines of `path`, or None when it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - _TAIL_BYTES))
            data = log.read()
    except OSError:
        return None
    return data.decode(errors="replace").splitlines()[-lines:]


def _indent(text: str, spaces: int = 4) -> list[str]:
    return [" " * spaces + line for line in text.rstrip().splitlines()]
