"""Real child processes: success, failure propagation, SIGKILL escalation, no orphans.

Each supervision test runs twice: with children started as their own interpreters, and with
children forked from a fork server (`preload`, `realrl.launcher.forkserver`), which must not
change what the supervisor sees or does."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launcher_helpers import default_sigint

from realrl.launcher.processes import (
    LOG_ONLY_PREFIX,
    ProcessFailure,
    ProcessSpec,
    ProcessSupervisor,
)

PYTHON = sys.executable
REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD_ENV = {"PYTHONPATH": str(REPO_ROOT)}


def _spec(tmp_path: Path, name: str, code: str, num_threads: int = 1) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        argv=[PYTHON, "-c", textwrap.dedent(code)],
        env=CHILD_ENV,
        log_path=tmp_path / "logs" / f"{name}.log",
        console_prefix=f"[{name}]",
        num_threads=num_threads,
    )


def _is_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (a container's init may not reap)."""
    try:
        stat_text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat_text.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _read_when_written(path: Path, timeout_s: float = 30.0) -> str:
    assert _wait_until(path.exists, timeout_s), f"{path} never appeared"
    return path.read_text()


def _wait_for_file_code(path: Path) -> str:
    """Python source (unindented) that blocks until `path` exists."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.02)\n"


# Children started as interpreters, or forked from a server that imported these modules.
START_MODES = [pytest.param((), id="exec"), pytest.param(("json",), id="forked")]


@pytest.fixture(params=START_MODES)
def supervise(request):
    """Start a ProcessSupervisor; whatever a test does, its children are stopped at teardown."""
    started: list[ProcessSupervisor] = []

    def start(specs: list[ProcessSpec], **options) -> ProcessSupervisor:
        options.setdefault("console", io.StringIO())
        options.setdefault("preload", request.param)
        supervisor = ProcessSupervisor(specs, **options)
        started.append(supervisor)
        supervisor.start()
        return supervisor

    yield start
    for supervisor in started:
        supervisor.stop(grace_s=0.5)


@pytest.mark.parametrize("preload", START_MODES)
def test_all_processes_succeeding_returns_zero_with_logs_and_prefixed_console(
    tmp_path, monkeypatch, preload
):
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    code = """
        import os, sys
        print("hello from", sys.argv[0] or "child")
        print("threads", os.environ["OMP_NUM_THREADS"], os.environ["MKL_NUM_THREADS"],
              os.environ["REALRL_NUM_THREADS"], os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
        print("a warning on stderr", file=sys.stderr)
    """
    specs = [_spec(tmp_path, "master", code, 1), _spec(tmp_path, "worker 0", code, 2)]
    console = io.StringIO()
    with ProcessSupervisor(specs, console=console, preload=preload) as supervisor:
        supervisor.start()
        assert supervisor.wait(poll_interval_s=0.05) == 0

    lines = console.getvalue().splitlines()
    assert "[master] threads 1 1 1 1" in lines
    assert "[worker 0] threads 2 2 2 2" in lines
    assert "[worker 0] a warning on stderr" in lines
    assert all(line.startswith(("[master] ", "[worker 0] ")) for line in lines)
    worker_log = (tmp_path / "logs" / "worker 0.log").read_text().splitlines()
    assert worker_log == ["hello from -c", "threads 2 2 2 2", "a warning on stderr"]


def test_one_failure_stops_the_others_and_reports_its_last_log_lines(tmp_path, supervise):
    sleeper = _spec(tmp_path, "sleeper", "import time; print('up', flush=True); time.sleep(60)")
    failer = _spec(
        tmp_path,
        "failer",
        """
        import sys, time
        for index in range(50):
            print(f"step {index}")
        print("Traceback: something broke", file=sys.stderr)
        time.sleep(0.5)
        sys.exit(3)
        """,
    )
    supervisor = supervise([sleeper, failer])
    start = time.monotonic()
    with pytest.raises(ProcessFailure) as failure:
        supervisor.wait(poll_interval_s=0.05)
    elapsed_s = time.monotonic() - start

    assert elapsed_s < 10
    assert not _is_alive(supervisor.pids["sleeper"])
    assert failure.value.name == "failer" and failure.value.exit_code == 3
    text = str(failure.value)
    assert "'failer'" in text and "exited with code 3" in text
    assert "step 49" in text and "Traceback: something broke" in text
    assert "step 5\n" not in text, "only the last lines are shown"
    assert str(tmp_path / "logs" / "failer.log") in text


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, supervise):
    ready = tmp_path / "ignorer_ready"
    ignorer = _spec(
        tmp_path,
        "ignorer",
        f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        """,
    )
    failer = _spec(tmp_path, "failer", _wait_for_file_code(ready) + "raise SystemExit(1)")
    supervisor = supervise([ignorer, failer], grace_s=1.0)
    start = time.monotonic()
    with pytest.raises(ProcessFailure, match="'failer'"):
        supervisor.wait(poll_interval_s=0.05)

    assert 1.0 <= time.monotonic() - start < 10
    assert not _is_alive(supervisor.pids["ignorer"])


def test_a_stopped_child_acts_on_sigterm_at_once(tmp_path, supervise):
    # SIGTERM stays pending in a stopped (SIGSTOP) process; the supervisor continues it, so it
    # ends on SIGTERM (its handler runs) instead of SIGKILL after the grace period.
    stopped = _spec(
        tmp_path,
        "stopped",
        """
        import signal, sys, time
        def on_sigterm(number, frame):
            print("stopping on SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_sigterm)
        print("up", flush=True)
        time.sleep(60)
        """,
    )
    supervisor = supervise([stopped], grace_s=2.0)
    log = tmp_path / "logs" / "stopped.log"
    assert _wait_until(lambda: log.exists() and "up" in log.read_text(), 30)
    os.kill(supervisor.pids["stopped"], signal.SIGSTOP)
    supervisor.stop()

    assert not _is_alive(supervisor.pids["stopped"])
    assert log.read_text().splitlines() == ["up", "stopping on SIGTERM"]


def test_a_failure_shows_the_report_the_process_wrote_instead_of_its_log_tail(tmp_path,
                                                                              supervise):
    stale, fresh = tmp_path / "stale.txt", tmp_path / "fresh.txt"
    stale.write_text("an old report")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # from an earlier run
    reporter = _spec(tmp_path, "reporter", f"""
        from pathlib import Path
        print("a log line")
        Path({str(fresh)!r}).write_text("why I stopped the run\\nwith details\\n")
        raise SystemExit(3)
        """)
    reporter.report_path = fresh
    quiet = _spec(tmp_path, "quiet", "print('a log line'); raise SystemExit(4)")
    quiet.report_path = stale

    with pytest.raises(ProcessFailure) as failure:
        supervise([reporter]).wait(poll_interval_s=0.05)
    assert failure.value.report == "why I stopped the run\nwith details"
    assert str(failure.value).endswith("were stopped.\nwhy I stopped the run\nwith details")
    with pytest.raises(ProcessFailure) as failure:
        supervise([quiet]).wait(poll_interval_s=0.05)
    assert failure.value.report is None and "a log line" in str(failure.value)


def test_grandchildren_are_killed_with_their_process_group(tmp_path, supervise):
    grandchild_pid_file = tmp_path / "grandchild.pid"
    grandchild_code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(grandchild_pid_file) + '.tmp'!r}, 'w').write(str(os.getpid()))\n"
        f"os.rename({str(grandchild_pid_file) + '.tmp'!r}, {str(grandchild_pid_file)!r})\n"
        "time.sleep(60)\n"
    )
    parent = _spec(
        tmp_path,
        "parent",
        f"import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild_code!r}])\n"
        "time.sleep(60)\n",
    )
    failer = _spec(
        tmp_path, "failer", _wait_for_file_code(grandchild_pid_file) + "raise SystemExit(2)"
    )
    supervisor = supervise([parent, failer], grace_s=1.0)
    with pytest.raises(ProcessFailure, match="exited with code 2"):
        supervisor.wait(poll_interval_s=0.05)

    grandchild_pid = int(grandchild_pid_file.read_text())
    assert _wait_until(lambda: not _is_alive(grandchild_pid), timeout_s=5)
    assert not _is_alive(supervisor.pids["parent"])


SUPERVISOR_SCRIPT = """
import json, os, sys
from pathlib import Path
from realrl.launcher.processes import ProcessSpec, ProcessSupervisor, SupervisorInterrupted

out, preload = Path(sys.argv[1]), tuple(filter(None, sys.argv[2].split(",")))
specs = [
    ProcessSpec(f"sleeper {index}", [sys.executable, "-c", "import time; time.sleep(60)"],
                {}, out / f"sleeper{index}.log", f"[sleeper {index}]", 1)
    for index in range(2)
]
with ProcessSupervisor(specs, grace_s=2.0, preload=preload) as supervisor:
    supervisor.start()
    (out / "pids.tmp").write_text(json.dumps(supervisor.pids))
    os.rename(out / "pids.tmp", out / "pids.json")
    try:
        sys.exit(supervisor.wait(poll_interval_s=0.05))
    except SupervisorInterrupted as interrupted:
        sys.exit(interrupted.exit_code)
"""


@pytest.fixture(params=START_MODES)
def supervisor_process(tmp_path, request):
    """A supervisor in its own process (killed at teardown) and its children's pids."""
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR_SCRIPT)
    supervisor = subprocess.Popen(
        [PYTHON, str(script), str(tmp_path), ",".join(request.param)],
        env={**os.environ, **CHILD_ENV},
        preexec_fn=default_sigint,
    )
    try:
        child_pids = list(json.loads(_read_when_written(tmp_path / "pids.json")).values())
        assert all(_is_alive(pid) for pid in child_pids)
        yield supervisor, child_pids
    finally:
        supervisor.kill()  # its children then die of PR_SET_PDEATHSIG
        supervisor.wait()


def test_sigkill_of_the_supervisor_leaves_no_children_alive(supervisor_process):
    supervisor, child_pids = supervisor_process
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=10)
    assert _wait_until(lambda: not any(_is_alive(pid) for pid in child_pids), timeout_s=5)


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_supervisor_stops_everything_and_exits_non_zero(
    supervisor_process, signal_number
):
    supervisor, child_pids = supervisor_process
    time.sleep(0.3)  # let it enter wait(), where the SIGTERM handler is installed
    supervisor.send_signal(signal_number)
    assert supervisor.wait(timeout=15) == 128 + signal_number
    assert not any(_is_alive(pid) for pid in child_pids)


def test_watch_parent_exits_a_child_whose_parent_died(tmp_path):
    ready = tmp_path / "leaf_ready"
    leaf_pid_file = tmp_path / "leaf.pid"
    leaf_code = textwrap.dedent(f"""
        import time
        from realrl.launcher.processes import watch_parent
        watch_parent(poll_interval_s=0.05)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    middle_code = textwrap.dedent(f"""
        import subprocess, sys
        leaf = subprocess.Popen([sys.executable, "-c", {leaf_code!r}])
        open({str(leaf_pid_file)!r}, "w").write(str(leaf.pid))
    """) + _wait_for_file_code(ready)
    middle = subprocess.run(
        [PYTHON, "-c", middle_code], env={**os.environ, **CHILD_ENV}, timeout=60
    )
    assert middle.returncode == 0
    leaf_pid = int(leaf_pid_file.read_text())
    assert _wait_until(lambda: not _is_alive(leaf_pid), timeout_s=5)


def test_worker_logging_and_thread_limit_helpers_configure_the_child(tmp_path, supervise):
    code = """
        import logging, torch
        from realrl.launcher.processes import apply_thread_limit, install_worker_logging
        install_worker_logging()
        logging.getLogger("realrl.demo").info("threads=%d", apply_thread_limit())
        logging.getLogger("realrl.demo").debug("hidden")
        print("torch threads", torch.get_num_threads())
    """
    console = io.StringIO()
    supervisor = supervise([_spec(tmp_path, "worker 3", code, 2)], console=console)
    assert supervisor.wait(poll_interval_s=0.05) == 0
    lines = console.getvalue().splitlines()
    assert "[worker 3] torch threads 2" in lines
    log_line_pattern = r"\[worker 3\] \d\d:\d\d:\d\d INFO realrl\.demo: threads=2"
    assert any(re.fullmatch(log_line_pattern, line) for line in lines), lines
    assert not any("hidden" in line for line in lines)


def test_a_user_facing_errors_traceback_goes_to_the_log_file_only(tmp_path, supervise):
    code = """
        import logging, sys
        from realrl.api.errors import UserFacingError
        from realrl.launcher.processes import install_worker_logging
        install_worker_logging()
        for error in (UserFacingError("the service is down: start it"), KeyError("a bug")):
            try:
                raise error
            except Exception as caught:
                logging.getLogger("realrl.demo").error("failed: %s", caught, exc_info=caught)
        sys.exit(1)
    """
    console = io.StringIO()
    supervisor = supervise([_spec(tmp_path, "master", code)], console=console)
    with pytest.raises(ProcessFailure) as failure:
        supervisor.wait(poll_interval_s=0.05)
    report = str(failure.value)
    for shown in (console.getvalue(), report):
        assert "failed: the service is down: start it" in shown
        # A bug keeps its traceback; the error written for the user shows its message alone.
        assert shown.count("Traceback (most recent call last)") == 1, shown
        assert "KeyError: 'a bug'" in shown and "UserFacingError" not in shown
    assert "lines of traceback, left out here, are in that file" in report
    log = (tmp_path / "logs" / "master.log").read_text()
    assert log.count("Traceback (most recent call last)") == 2
    assert (f"{LOG_ONLY_PREFIX}realrl.api.errors.UserFacingError: the service is down: start it"
            in log.splitlines())


GRACEFUL_SUPERVISOR_SCRIPT = """
import json, os, signal, sys
from pathlib import Path
from realrl.launcher.processes import (ProcessSpec, ProcessSupervisor, RunPreempted,
                                       SupervisorInterrupted)

out, on_usr1 = Path(sys.argv[1]), sys.argv[2]
preload = tuple(filter(None, sys.argv[3].split(",")))
master = (
    "import signal, sys, time\\n"
    "def stop(number, frame):\\n"
    "    print('master got', signal.Signals(number).name, flush=True)\\n"
    + ("    sys.exit(75)\\n" if on_usr1 == "checkpoint" else "    pass\\n")
    + "signal.signal(signal.SIGUSR1, stop)\\n"
    "open(sys.argv[1], 'w').close()\\n"
    "time.sleep(60)\\n"
)
specs = [
    ProcessSpec("master", [sys.executable, "-c", master, str(out / "master_ready")], {},
                out / "master.log", "[master]", 1, graceful_stop_signal=signal.SIGUSR1),
    ProcessSpec("worker", [sys.executable, "-c", "import time; time.sleep(60)"], {},
                out / "worker.log", "[worker]", 1),
]
with ProcessSupervisor(specs, grace_s=0.5, preload=preload) as supervisor:
    supervisor.start()
    (out / "pids.tmp").write_text(json.dumps(supervisor.pids))
    os.rename(out / "pids.tmp", out / "pids.json")
    try:
        sys.exit(supervisor.wait(poll_interval_s=0.05))
    except RunPreempted as preempted:
        print("preempted:", preempted, flush=True)
        sys.exit(preempted.exit_code)
    except SupervisorInterrupted as interrupted:
        sys.exit(interrupted.exit_code)
"""


def _start_graceful_supervisor(tmp_path, on_usr1: str, preload: tuple[str, ...]):
    script = tmp_path / "supervisor.py"
    script.write_text(GRACEFUL_SUPERVISOR_SCRIPT)
    supervisor = subprocess.Popen(
        [PYTHON, str(script), str(tmp_path), on_usr1, ",".join(preload)],
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.PIPE, text=True, preexec_fn=default_sigint,
    )
    child_pids = list(json.loads(_read_when_written(tmp_path / "pids.json")).values())
    _read_when_written(tmp_path / "master_ready")  # its SIGUSR1 handler is installed
    return supervisor, child_pids


@pytest.mark.parametrize("preload", START_MODES)
def test_sigterm_asks_a_graceful_process_to_stop_and_its_exit_75_ends_the_run(tmp_path,
                                                                               preload):
    supervisor, child_pids = _start_graceful_supervisor(tmp_path, "checkpoint", preload)
    try:
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=15) == 75
        output = supervisor.stdout.read()
    finally:
        supervisor.kill()
        supervisor.wait()
    assert "preempted: process 'master' stopped gracefully (the supervisor received SIGTERM)" \
        in output
    # The master was asked with SIGUSR1 (the worker, which was not, was stopped after it).
    assert "master got SIGUSR1" in (tmp_path / "master.log").read_text()
    assert not any(_is_alive(pid) for pid in child_pids)


@pytest.mark.parametrize("preload", START_MODES)
def test_a_second_sigterm_stops_a_run_that_does_not_stop_by_itself(tmp_path, preload):
    supervisor, child_pids = _start_graceful_supervisor(tmp_path, "ignore", preload)
    try:
        supervisor.send_signal(signal.SIGTERM)
        assert _wait_until(lambda: "master got SIGUSR1" in
                           (tmp_path / "master.log").read_text(), timeout_s=10)
        assert supervisor.poll() is None  # still waiting for the master's checkpoint
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM
    finally:
        supervisor.kill()
        supervisor.wait()
    assert not any(_is_alive(pid) for pid in child_pids)
