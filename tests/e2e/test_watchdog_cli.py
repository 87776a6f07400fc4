"""Hangs through the real CLI (issue 26 item 1): the watchdog stops the run with a diagnosis.

A worker stopped with SIGSTOP answers no heartbeat: the run must end non-zero soon after
`watchdog.heartbeat_timeout_s`, naming the rank, the MFC it was in and that it is stopped, and
leave no process behind (a stopped process ignores SIGTERM until it is continued). A worker
that is alive but stuck inside an MFC (a sleep injected by `stall_injection/sitecustomize.py`)
overruns its deadline: the diagnosis shows its Python stack at the stuck line.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from e2e_helpers import (
    describe,
    kill_leftovers,
    processes_mentioning,
    read_metrics,
    run_cli,
    start_cli,
    wait_until,
    worker_pid,
)

STALL_INJECTION = Path(__file__).parent / "stall_injection"
HEARTBEAT = ["watchdog.heartbeat_interval_s=0.5", "watchdog.heartbeat_timeout_s=4"]
# Heartbeat timeout, the diagnosis and stopping every process, with room for a loaded machine;
# without the watchdog the master waited 24 hours.
STOP_BOUND_S = 120


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_stopped_worker_ends_the_run_with_a_diagnosis_and_no_orphans(
    tiny_model, cli_env, tmp_path
):
    run_dir = tmp_path / "runs" / "ppo-math" / "trial0"
    launcher = start_cli(
        "ppo-math",
        [f"actor.path={tiny_model}", f"output_root={tmp_path / 'runs'}", "n_devices_per_node=2",
         "dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=8",
         "total_train_steps=500", *HEARTBEAT],
        cli_env,
        tmp_path / "launcher",
    )
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").is_file(), 240, "the first step", launcher)
        run_pids = processes_mentioning(str(run_dir))
        worker1 = worker_pid(run_dir, 1)
        assert worker1 is not None, run_pids
        os.kill(worker1, signal.SIGSTOP)
        returncode = launcher.wait(timeout=STOP_BOUND_S)
        leftovers = processes_mentioning(str(run_dir))
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(str(run_dir))

    stderr = (tmp_path / "launcher" / "stderr.txt").read_text()
    assert returncode != 0
    assert len(read_metrics(run_dir)) < 500
    # Where rank 1 was stopped: in an MFC, or in a weight transfer between two of them.
    match = re.search(r"the hang watchdog stopped the run: rank 1, in (MFC|weight transfer) "
                      r"(\S+) \(step (\d+)\), answered no heartbeat for [\d.]+ s "
                      r"\(watchdog.heartbeat_timeout_s=4\)", stderr)
    assert match, stderr[-3000:]
    kind, name, step = match.groups()
    section = stderr[stderr.index(f"rank 1 (pid {worker1} on "):]
    assert f"in {kind} {name} (step {step}) for " in section.splitlines()[0]
    assert "STOPPED (process state T: stopped): someone sent it SIGSTOP" in section
    assert "logs/worker1.log:\n    " in section  # the end of its log
    assert stderr.count("the hang watchdog stopped the run") == 1  # one diagnosis
    assert (run_dir / "logs" / "watchdog.txt").read_text().strip() in stderr
    assert leftovers == {}, f"processes left behind: {leftovers}"
    assert all(_gone(pid) for pid in run_pids), {pid: _gone(pid) for pid in run_pids}


def test_a_worker_stuck_inside_an_mfc_is_stopped_at_its_deadline_with_its_stack(
    tiny_model, cli_env, tmp_path
):
    python_path = [str(STALL_INJECTION), *filter(None, [cli_env.get("PYTHONPATH")])]
    env = {**cli_env, "PYTHONPATH": os.pathsep.join(python_path),
           "REALRL_TEST_STALL": "trainDefault@0"}
    result = run_cli(
        "sft",
        [f"model.path={tiny_model}", f"output_root={tmp_path}", "n_devices_per_node=1",
         "dataset.batch_size=4", "total_train_steps=2", "watchdog.warmup_deadline_s=3"],
        env,
        timeout_s=STOP_BOUND_S + 120,
    )
    assert result.returncode != 0, describe(result)
    assert re.search(r"the hang watchdog stopped the run: MFC trainDefault \(step 1\) has run "
                     r"[\d.]+ s on rank 0, past its deadline of 3 s \(watchdog.warmup_deadline_s"
                     r"=3: the rank's call 1, ", result.stderr), describe(result)
    section = result.stderr[result.stderr.index("rank 0 (pid "):]
    assert "in MFC trainDefault (step 1) for " in section.splitlines()[0]
    assert "; alive (last heartbeat " in section.splitlines()[0]
    stack = section[section.index("Thread MainThread (most recent call last):"):]
    assert re.search(r"in _run_mfc\n.*\n.*in stall_inside_mfc\n\s+time.sleep\(seconds\)", stack)
    assert processes_mentioning(str(tmp_path / "sft" / "trial0")) == {}
