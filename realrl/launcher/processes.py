"""Start, watch and stop the processes of a local run, leaving no orphans behind.

Why: a run is one master plus N model workers. If any of them dies, the others must stop
within seconds and the user must see which one died and why, instead of a hang. And
however the supervisor itself ends (an error, Ctrl-C, SIGTERM, even SIGKILL) no child may
outlive it holding memory, ports or devices.

How, in layers:
1. Each child runs in its own session (`start_new_session=True`), so its whole process
   group (the child and any grandchildren it forks) can be signalled at once, and a Ctrl-C
   in the terminal reaches only the supervisor, which then stops the children in order.
2. On Linux each child asks the kernel for SIGKILL when the supervisor dies
   (`prctl(PR_SET_PDEATHSIG)`), which covers SIGKILL of the supervisor. The signal fires
   when the *thread* that spawned the child exits, so call `start()` from the main thread.
3. Children call `watch_parent()` as a second line of defence (other kernels, launches
   through wrappers); it also takes down the child's grandchildren.

Stopping sends SIGTERM (and SIGCONT, so that a stopped process acts on it) to every process
group, waits `grace_s`, then SIGKILLs every group, including groups whose leader already exited
but whose grandchildren linger.

A process that stops the run on purpose and says why in a file (the master's hang watchdog,
`ProcessSpec.report_path`) has that file shown in place of its log tail.

Lines for the log file only: a child's line that starts with `LOG_ONLY_PREFIX` goes to its log
file but neither to the console nor into the log tail of a failure report. The children's
logging (`install_worker_logging`) marks so every line of the traceback of an error written for
the user (`realrl.api.errors.UserFacingError`), whose one-line message is all the user needs to
see; the SLURM runner drops the same lines from what it shows (`is_log_only`).

Graceful stop: a process whose spec names a `graceful_stop_signal` (the master: SIGUSR1) can
be asked to checkpoint and exit. SIGTERM or SIGUSR1 to the supervisor is then forwarded to it
as that signal instead of stopping everything; when it exits with `PREEMPTED_EXIT_CODE`, the
supervisor lets the others finish and raises `RunPreempted`. A second SIGTERM, or Ctrl-C,
stops everything at once as before.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from realrl.api import environment
from realrl.api.errors import UserFacingError
from realrl.launcher.console import Console
from realrl.launcher.forkserver import (
    ForkedProcess,
    ForkServer,
    ForkServerError,
    forkable,
    parent_death_signal_setter,
)
from realrl.workers.preemption import PREEMPTED_EXIT_CODE

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0
DEFAULT_LOG_TAIL_LINES = 30
LOG_ONLY_PREFIX = "(log only) "  # see the module docstring


def is_log_only(line: str) -> bool:
    """Whether a child's output line is for its log file only (not the console, not a tail)."""
    return line.startswith(LOG_ONLY_PREFIX)


@dataclass
class ProcessSpec:
    """One process to run. `console_prefix` is put in front of each line it prints."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    console_prefix: str = ""
    num_threads: int = 1
    # A file in which the process explains why it stopped the run; written after it started,
    # it is what a failure report shows instead of the process's last log lines.
    report_path: Path | None = None
    # The signal that asks this process to checkpoint and exit with PREEMPTED_EXIT_CODE.
    graceful_stop_signal: int | None = None


class ProcessFailure(RuntimeError):
    """A supervised process exited non-zero or was killed; the others have been stopped."""

    def __init__(self, name: str, pid: int, returncode: int, log_path: Path, log_tail: list[str],
                 report: str | None = None, log_only_lines: int = 0):
        self.name = name
        self.pid = pid
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail  # without the lines for the log file only
        self.report = report  # the process's own account of why it stopped (`report_path`)
        self.log_only_lines = log_only_lines  # in its log file, left out of the tail
        super().__init__(self._describe())

    @property
    def exit_code(self) -> int | None:
        return self.returncode if self.returncode >= 0 else None

    @property
    def signal_name(self) -> str | None:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def _describe(self) -> str:
        how = f"exited with code {self.exit_code}"
        if self.signal_name is not None:
            how = f"was killed by {self.signal_name}"
        headline = (f"process {self.name!r} (pid {self.pid}) {how}; all other processes were "
                    "stopped.")
        if self.report is not None:
            return f"{headline}\n{self.report}"
        tail = "\n".join(f"    {line}" for line in self.log_tail) or "    (no output)"
        kept = (f" ({self.log_only_lines} lines of traceback, left out here, are in that file)"
                if self.log_only_lines else "")
        return f"{headline}\n  last {len(self.log_tail)} lines of {self.log_path}{kept}:\n{tail}"


class SupervisorInterrupted(RuntimeError):
    """The supervisor got SIGINT/SIGTERM and stopped every child; exit with `exit_code`."""

    def __init__(self, signal_number: int):
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number
        name = signal.Signals(signal_number).name
        super().__init__(f"supervisor received {name}; all processes were stopped")


class RunPreempted(RuntimeError):
    """A process asked to stop gracefully (`graceful_stop_signal`) did: it wrote a checkpoint
    and exited with `PREEMPTED_EXIT_CODE`; the others have finished or been stopped."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, name: str, signal_number: int | None):
        self.name = name
        self.signal_number = signal_number
        asked = (f"the supervisor received {signal.Signals(signal_number).name}"
                 if signal_number is not None else "it was signalled directly")
        super().__init__(f"process {name!r} stopped gracefully ({asked})")


class _RunningProcess:
    """One child, its log file and the thread that copies its output."""

    def __init__(self, spec: ProcessSpec, console: Console, tail_lines: int,
                 fork_server: ForkServer | None = None):
        self.spec = spec
        self.log_tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.log_only_lines = 0  # lines written to the log file only (`is_log_only`)
        self.started_at = time.time()
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(spec.log_path, "a", encoding="utf-8")
        threads = str(spec.num_threads)
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        env |= {
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            environment.NUM_THREADS: threads,
        }
        # torch.compile's C++ compile workers (gen.compile, <role>.compile) get the same share unless
        # the user chose: by default inductor starts one per core in every process.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", threads)
        self.forked = fork_server is not None and forkable(spec.argv)
        self.popen: subprocess.Popen | ForkedProcess
        try:
            if self.forked:
                assert fork_server is not None
                self.popen = fork_server.spawn(spec.name, spec.argv[1:], env)
            else:
                self.popen = subprocess.Popen(
                    spec.argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=parent_death_signal_setter(os.getpid()),
                )
        except ForkServerError:
            self._log_file.close()
            raise
        except OSError as error:
            self._log_file.close()
            raise RuntimeError(
                f"cannot start process {spec.name!r} ({spec.argv}): {error}"
            ) from None
        self._console = console
        self._reader = threading.Thread(
            target=self._copy_output, name=f"log {spec.name}", daemon=True
        )
        self._reader.start()

    def _copy_output(self) -> None:
        assert self.popen.stdout is not None
        prefix = f"{self.spec.console_prefix} " if self.spec.console_prefix else ""
        for raw_line in self.popen.stdout:
            line = raw_line.decode("utf-8", errors="replace").rstrip("\r\n")
            self._log_file.write(line + "\n")
            self._log_file.flush()
            if is_log_only(line):
                self.log_only_lines += 1
                continue
            self.log_tail.append(line)
            self._console.write_line(prefix, line)

    def signal_group(self, signal_number: int) -> None:
        try:
            os.killpg(self.popen.pid, signal_number)  # the pgid is the child's pid
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already

    def report(self) -> str | None:
        """The text of `spec.report_path` if this process wrote it (a file from an earlier
        run, older than this process, is not its report)."""
        path = self.spec.report_path
        try:
            if path is None or path.stat().st_mtime < self.started_at:
                return None
            return path.read_text(errors="replace").rstrip()
        except OSError:
            return None

    def finish_output(self, timeout_s: float = 5.0) -> None:
        """Wait for the last lines to be copied, then close the log file."""
        self._reader.join(timeout=timeout_s)
        if self._reader.is_alive():
            logger.warning("output of %r is still open (a lingering grandchild?)", self.spec.name)
            return
        self._log_file.close()


class ProcessSupervisor:
    """Runs a set of processes; any failure stops all of them.

    Use as a context manager, or call `stop()` in a `finally`:

        with ProcessSupervisor(specs) as supervisor:
            supervisor.start()
            supervisor.wait()   # 0, or raises ProcessFailure / SupervisorInterrupted
    """

    def __init__(
        self,
        specs: list[ProcessSpec],
        console: IO[str] | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        log_tail_lines: int = DEFAULT_LOG_TAIL_LINES,
        preload: tuple[str, ...] = (),
    ):
        """`console` defaults to sys.stdout (on a terminal the master's progress line is
        redrawn in place, see `realrl.launcher.console`); a failure report shows
        `log_tail_lines` lines. With modules to `preload`, the processes whose `argv` is this
        interpreter with `-m` or `-c` are forked from one process that imported those modules
        (`realrl.launcher.forkserver`) instead of each starting an interpreter."""
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.specs = list(specs)
        self.grace_s = grace_s
        self._console = Console(sys.stdout if console is None else console)
        self._log_tail_lines = log_tail_lines
        self._running: list[_RunningProcess] = []
        self._stopped = False
        self._stop_requested_by: int | None = None  # the signal that asked for a graceful stop
        self._preload = preload if any(forkable(spec.argv) for spec in specs) else ()
        self._fork_server: ForkServer | None = None

    @property
    def pids(self) -> dict[str, int]:
        return {process.spec.name: process.popen.pid for process in self._running}

    def start(self) -> None:
        """Spawn every process. If one cannot be started, the ones already started are stopped."""
        try:
            if self._preload:
                env = self._fork_server_environment()
                self._fork_server = ForkServer(env, self._preload, env.get(environment.RUN_DIR))
                logger.info("started the fork server (pid %d)", self._fork_server.pid)
            for spec in self.specs:
                process = _RunningProcess(spec, self._console, self._log_tail_lines,
                                          self._fork_server)
                self._running.append(process)
                logger.info("started %s (pid %d): %s", spec.name, process.popen.pid, spec.argv)
        except BaseException:
            self.stop()
            raise

    def _fork_server_environment(self) -> dict[str, str]:
        """The environment every forked process shares (see `realrl.launcher.forkserver`)."""
        shared = dict(os.environ)
        envs = [spec.env for spec in self.specs if forkable(spec.argv)]
        shared |= {key: value for key, value in envs[0].items()
                   if all(env.get(key) == value for env in envs)}
        threads = str(min(spec.num_threads for spec in self.specs))
        return shared | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads,
                         "MKL_NUM_THREADS": threads}

    def wait(self, poll_interval_s: float = 0.2) -> int:
        """Return 0 once every process exited 0; on the first failure stop all and raise.

        Raises `ProcessFailure` naming the failed process with its last log lines,
        `SupervisorInterrupted` on SIGINT (Ctrl-C) or SIGTERM to the supervisor, or, when a
        process has a `graceful_stop_signal`, `RunPreempted` once it stopped gracefully (asked
        by SIGTERM or SIGUSR1 to the supervisor; see the module docstring).
        """
        previous_handlers = self._install_stop_handlers()
        try:
            while True:
                returncodes = [process.popen.poll() for process in self._running]
                for process, returncode in zip(self._running, returncodes):
                    if returncode is None or returncode == 0:
                        continue
                    if self._stopped_gracefully(process, returncode):
                        raise self._preempted(process, poll_interval_s)
                    raise self._fail(process, returncode)
                if all(returncode == 0 for returncode in returncodes):
                    self.stop()  # reaps lingering grandchildren, closes logs
                    return 0
                time.sleep(poll_interval_s)
        except KeyboardInterrupt:
            self.stop()
            raise SupervisorInterrupted(signal.SIGINT) from None
        except SupervisorInterrupted:
            self.stop()
            raise
        finally:
            for signal_number, handler in previous_handlers.items():
                signal.signal(signal_number, handler)

    def _install_stop_handlers(self) -> dict[int, object]:
        """SIGTERM stops everything, unless a process can stop gracefully: then SIGTERM and
        SIGUSR1 ask it to (`_ask_to_stop`). Returns the handlers to put back."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        if not any(spec.graceful_stop_signal is not None for spec in self.specs):
            return {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_interrupted)}
        return {number: signal.signal(number, self._ask_to_stop)
                for number in (signal.SIGTERM, signal.SIGUSR1)}

    def _ask_to_stop(self, signal_number: int, frame: object) -> None:
        """Forward the first SIGTERM or SIGUSR1 as each process's graceful stop signal; a
        second SIGTERM stops everything at once."""
        if self._stop_requested_by is not None:
            if signal_number == signal.SIGTERM:
                raise SupervisorInterrupted(signal_number)
            return
        self._stop_requested_by = signal_number
        self._console.end_progress()
        logger.warning("received %s: asking the run to finish its step, write a checkpoint and "
                       "exit (SIGTERM again stops it at once)", signal.Signals(signal_number).name)
        for process in self._running:
            stop_signal = process.spec.graceful_stop_signal
            if stop_signal is not None and process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.popen.pid, stop_signal)  # the process, not its group

    def _stopped_gracefully(self, process: _RunningProcess, returncode: int) -> bool:
        """It exited as asked, or died of the stop signal before it could catch it."""
        stop_signal = process.spec.graceful_stop_signal
        if stop_signal is None:
            return False
        return returncode == PREEMPTED_EXIT_CODE or (
            self._stop_requested_by is not None and returncode == -stop_signal)

    def _preempted(self, process: _RunningProcess, poll_interval_s: float) -> RunPreempted:
        """Give the other processes `grace_s` to exit by themselves, then stop the rest."""
        deadline = time.monotonic() + self.grace_s
        while (time.monotonic() < deadline
               and any(other.popen.poll() is None for other in self._running)):
            time.sleep(poll_interval_s)
        self.stop()
        return RunPreempted(process.spec.name, self._stop_requested_by)

    def _fail(self, process: _RunningProcess, returncode: int) -> ProcessFailure:
        self._console.end_progress()
        server = self._fork_server
        server_code = server.exited_early() if server is not None else None
        if process.forked and server is not None and server_code is not None:
            logger.error("the fork server (pid %d) exited with %d, and its children with it",
                         server.pid, server_code)
        logger.error("%s exited with %d; stopping all processes", process.spec.name, returncode)
        self.stop()
        return ProcessFailure(
            process.spec.name,
            process.popen.pid,
            returncode,
            process.spec.log_path,
            list(process.log_tail),
            process.report(),
            process.log_only_lines,
        )

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every process group, SIGKILL what is left after `grace_s`, reap all."""
        if self._stopped:
            return
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread:  # a second Ctrl-C must not cut the cleanup short
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._console.end_progress()  # the reports that follow start on a line of their own
            self._terminate_then_kill(self.grace_s if grace_s is None else grace_s)
            if self._fork_server is not None:
                self._fork_server.close()
            self._stopped = True
        finally:
            if in_main_thread:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _terminate_then_kill(self, grace_s: float) -> None:
        for process in self._running:
            if process.popen.poll() is None:
                process.signal_group(signal.SIGTERM)
                process.signal_group(signal.SIGCONT)  # a stopped process acts on SIGTERM only now
        deadline = time.monotonic() + grace_s
        for process in self._running:
            try:
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s ignored SIGTERM for %.1f s; killing it", process.spec.name, grace_s
                )
        for process in self._running:
            process.signal_group(signal.SIGKILL)  # also grandchildren of exited leaders
        for process in self._running:
            process.popen.wait()
            process.finish_output()

    def __enter__(self) -> ProcessSupervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _raise_interrupted(signal_number: int, frame: object) -> None:
    raise SupervisorInterrupted(signal_number)


# ---------------------------------------------------------------- helpers for children


def watch_parent(poll_interval_s: float = 1.0) -> threading.Thread:
    """Exit this process (and its process group, if it leads one) when its parent dies.

    Call at the start of a child. A daemon thread polls `os.getppid()`; when it changes, the
    parent is gone and this process was re-parented, so nobody would ever stop it.
    """
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_interval_s)
        logger.error("parent process %d is gone; exiting", parent_pid)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)  # takes grandchildren along, and us
        os._exit(1)

    thread = threading.Thread(target=watch, name="watch parent", daemon=True)
    thread.start()
    return thread


def apply_thread_limit() -> int:
    """Call `torch.set_num_threads` with the share the supervisor gave this process."""
    import torch

    num_threads = int(os.environ.get(environment.NUM_THREADS, "1"))
    torch.set_num_threads(num_threads)
    return num_threads


def install_worker_logging(prefix: str = "", level: int | str = logging.INFO) -> None:
    """Root logging for a child: time, level, logger name, message.

    Under `ProcessSupervisor` leave `prefix` empty: the supervisor adds the console prefix.
    Where nothing adds one (e.g. srun output), pass it here, e.g. "[worker 3 actor dp1 tp0]".
    """
    leading = f"{prefix} " if prefix else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        ChildLogFormatter(
            f"{leading}%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    )
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)


class ChildLogFormatter(logging.Formatter):
    """Marks each line of a `UserFacingError`'s traceback for the log file only
    (`LOG_ONLY_PREFIX`): the message says what the user needs, the traceback is for whoever
    reads the log. Other tracebacks, a bug's, are left for the console too."""

    def formatException(self, exc_info) -> str:  # noqa: N802  (logging's name)
        text = super().formatException(exc_info)
        if not isinstance(exc_info[1], UserFacingError):
            return text
        return "\n".join(LOG_ONLY_PREFIX + line for line in text.splitlines())
