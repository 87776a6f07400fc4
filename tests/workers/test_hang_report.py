"""What the hang watchdog's diagnosis says about a real worker-like process in each state.

Each child runs the worker's real heartbeat thread and SIGUSR2 handler
(`realrl.workers.heartbeat`), its stderr going to the log file where a launcher puts a worker's,
and then stays busy in a way a hung worker might: asleep in a long call (its heartbeat thread
answers), holding the interpreter lock in C code (its heartbeat thread cannot run), or stopped.
"""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from realrl.workers import hang_report
from realrl.workers.hang_report import WorkerProcess
from realrl.workers.transport import AsyncClient

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = b"h" * 32
CHILD = textwrap.dedent("""
    import ctypes, sys, time
    from realrl.workers.heartbeat import HeartbeatResponder, install_stack_dump_signal

    def announce():  # from inside the busy function, so any stack taken after it shows it
        print("up", file=sys.stderr, flush=True)
        print(responder.publication(), flush=True)

    def sleep_in_a_long_call():
        announce()
        time.sleep(600)

    def hold_the_interpreter_lock():
        announce()
        while True:  # libc's sleep through PyDLL keeps the lock; SIGUSR2 interrupts it
            ctypes.PyDLL(None).sleep(600)

    install_stack_dump_signal()
    responder = HeartbeatResponder("127.0.0.1", bytes.fromhex(sys.argv[1]))
    {busy}()
""")


@pytest.fixture
def start_worker(tmp_path):
    """Start a child busy in `busy` (a function of CHILD); returns its `WorkerProcess`."""
    children: list[subprocess.Popen] = []

    def start(busy: str) -> WorkerProcess:
        log_path = hang_report.worker_log_path(tmp_path, 0)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD.format(busy=busy), SECRET.hex()],
                stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            )
        children.append(child)
        return WorkerProcess.from_publication(child.stdout.readline())

    yield start
    for child in children:
        child.kill()
        child.wait()


def describe(worker: WorkerProcess, run_dir: Path, silent: bool) -> str:
    async def run() -> str:
        client = AsyncClient(worker.heartbeat_address, SECRET)
        try:
            return await hang_report.describe_rank(0, worker, client, [], now=0.0, quiet_s=130.0,
                                                   silent=silent, run_dir=run_dir)
        finally:
            client.close()

    return asyncio.run(run())


def test_a_busy_worker_sends_its_stacks_from_its_heartbeat_thread(start_worker, tmp_path):
    worker = start_worker("sleep_in_a_long_call")
    section = describe(worker, tmp_path, silent=False)
    assert section.startswith(f"rank 0 (pid {worker.pid} on {worker.host}): idle (no request "
                              "in flight); alive (last heartbeat 130.0 s ago)")
    assert "its Python stacks (from its heartbeat thread):" in section
    assert "Thread MainThread (most recent call last):" in section
    assert "in sleep_in_a_long_call" in section
    assert f"last 1 lines of {hang_report.worker_log_path(tmp_path, 0)}:\n    up" in section


def test_a_worker_holding_the_interpreter_lock_dumps_its_stacks_to_its_log_on_sigusr2(
    start_worker, tmp_path
):
    worker = start_worker("hold_the_interpreter_lock")
    section = describe(worker, tmp_path, silent=True)
    assert "no heartbeat for 130.0 s" in section
    assert "its heartbeat thread does not answer (process state " in section
    assert "on SIGUSR2 faulthandler wrote its stacks to its log:" in section
    assert "in hold_the_interpreter_lock" in section, section  # faulthandler's dump, read back
    assert hang_report.local_process_state(worker) not in (None, "Z")  # SIGUSR2 did not kill it


def test_a_stopped_worker_is_reported_stopped(start_worker, tmp_path):
    worker = start_worker("sleep_in_a_long_call")
    os.kill(worker.pid, signal.SIGSTOP)
    while hang_report.local_process_state(worker) != "T":  # the kernel stops it a moment later
        time.sleep(0.01)
    section = describe(worker, tmp_path, silent=True)
    assert "STOPPED (process state T: stopped): someone sent it SIGSTOP" in section, section


def test_a_pid_of_another_process_is_never_signalled(tmp_path):
    # This process's pid with another start time: the worker of that pid is gone (or lives in
    # another container); SIGUSR2 would kill a process that does not handle it.
    stranger = WorkerProcess("tcp://127.0.0.1:9", os.getpid(), os.uname().nodename, start_ticks=1)
    section = describe(stranger, tmp_path, silent=True)
    assert f"there is no process {os.getpid()} on this machine any more" in section
