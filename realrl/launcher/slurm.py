"""Run an experiment on SLURM (`mode=slurm`): submit, follow, fail fast, cancel, resubmit.

Why SLURM does the heavy lifting: it already places tasks, forwards signals, and kills every
task of a job that ends. realrl writes one sbatch script per submission (see
`realrl.launcher.slurm_script`), submits it, and follows the job:

- the run is prepared by the same code as in local mode (`realrl.launcher.prepare`: checks,
  plan, `config.yaml`, `plan.json`, the graph, `.secret`, `logs/`), plus `slurm/` with the
  scripts and SLURM's own output;
- while the job runs, the launcher polls `squeue` (then `scontrol show job`, then `sacct`
  once the job has left the queue) every `slurm.poll_interval_s` and streams
  `logs/master.log` to the console when the run directory is shared;
- when any task fails the script ends the job (so no half-dead run keeps its allocation) and
  the launcher exits 1 naming the failed task (from srun's own report), its node, and the
  last lines of its log (what a task marked for its log file only, the traceback of an error
  written for the user, is not shown: `realrl.launcher.processes.is_log_only`);
- Ctrl-C cancels the job (`scancel`) and waits until it has left the queue; SIGTERM or SIGUSR1
  stops it gracefully instead (`scancel --batch --signal=USR1`, as SLURM itself does
  `slurm.preempt_lead_s` before the time limit): the master finishes its step, writes a
  checkpoint and the job ends with exit code 75; the launcher prints the command that resumes
  the run and exits 75. A second SIGTERM cancels at once;
- with `recover_mode=auto` a failed job is resubmitted up to `recover_retries` times, and a job
  that SLURM stopped with a checkpoint (time limit or preemption) is resubmitted whenever that
  checkpoint is newer than the one it started from (otherwise it counts as a retry); the
  master resumes from the last complete checkpoint.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from realrl.api.config import BaseExperimentConfig, ConfigError, RecoverMode
from realrl.api.ports import free_port
from realrl.launcher.prepare import preemption_message, prepare_run
from realrl.launcher.processes import is_log_only
from realrl.launcher.slurm_checks import sbatch_fix
from realrl.launcher.slurm_script import (
    SlurmJob,
    master_srun,
    render_batch_script,
    run_paths,
    shell_join,
    slurm_problems,
    worker_srun,
    write_batch_script,
)
from realrl.workers.preemption import PREEMPT_SIGNAL, PREEMPTED_EXIT_CODE
from realrl.workers.recovery import latest_complete_checkpoint

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 30
CANCEL_WAIT_S = 60.0
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}
_STEP_FAILED = re.compile(r"^realrl: step (?P<step>master|workers) failed with exit code "
                          r"(?P<code>\d+)", re.MULTILINE)
_SRUN_TASK_ERROR = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): "
                              r"(?P<reason>.+)")


class SlurmError(RuntimeError):
    """A SLURM command failed; the message holds the command and its output."""


class _Interrupted(Exception):
    def __init__(self, signal_number: int):
        self.signal_number = signal_number


class _GracefulStop:
    """SIGTERM or SIGUSR1 to the launcher: ask the running job to checkpoint and stop (once,
    from `follow_job`'s loop); a second SIGTERM cancels it (`_Interrupted`)."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self.forwarded = False

    def __call__(self, signal_number: int, frame: object) -> None:
        if self.signal_number is None:
            self.signal_number = signal_number
        elif signal_number == signal.SIGTERM:
            raise _Interrupted(signal_number)

    def forward(self, job_id: str, status: JobStatus) -> None:
        """Signal a running job's batch script (it forwards to the master); cancel the job if
        it has not started, as there is nothing to checkpoint."""
        if self.signal_number is None or self.forwarded:
            return
        self.forwarded = True
        if status.state != "RUNNING":
            raise _Interrupted(self.signal_number)
        sys.stderr.write(f"received {signal.Signals(self.signal_number).name}: asking SLURM job "
                         f"{job_id} to finish its step, write a checkpoint and stop (SIGTERM "
                         "again cancels it)\n")
        _slurm(["scancel", "--batch", f"--signal={PREEMPT_SIGNAL.name.removeprefix('SIG')}",
                job_id], check=False)


@dataclass
class JobStatus:
    state: str  # e.g. RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL
    exit_code: str = ""  # "code:signal" as SLURM writes it
    reason: str = ""
    nodes: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass
class FailedTask:
    name: str  # "master" or "worker<R>", as the log files are named
    node: str
    how: str  # srun's words: "Killed", "Exited with exit code 1", ...


# ------------------------------------------------------------------ SLURM commands


def _slurm(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which(args[0]) is None:
        raise SlurmError(f"`{args[0]}` is not on PATH: mode=slurm needs the SLURM client "
                         "commands (sbatch, squeue, scontrol, scancel) on this machine.")
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise SlurmError(f"`{shell_join(args)}` failed with exit code {result.returncode}: "
                         f"{(result.stderr or result.stdout).strip()}")
    return result


def submit(script_path: Path) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id. A refusal names the fix."""
    try:
        output = _slurm(["sbatch", "--parsable", str(script_path)]).stdout.strip()
    except SlurmError as error:
        raise SlurmError(f"{error}\n{sbatch_fix(str(error))}") from None
    return output.split(";")[0]  # "<id>" or "<id>;<cluster>"


def query_job(job_id: str) -> JobStatus | None:
    """The job's state from squeue while queued, else scontrol, else sacct; None if unknown."""
    queued = _slurm(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"], check=False)
    if queued.returncode == 0 and queued.stdout.strip():
        state, reason, nodes = (queued.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        if state != "COMPLETING":
            return JobStatus(state, "", reason, nodes)
    shown = _slurm(["scontrol", "show", "job", "-o", job_id], check=False)
    if shown.returncode == 0 and "JobState=" in shown.stdout:
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        return JobStatus(fields["JobState"], fields.get("ExitCode", ""), fields.get("Reason", ""),
                         fields.get("NodeList", ""))
    if shutil.which("sacct") is not None:
        accounted = _slurm(["sacct", "-n", "-P", "-X", "-j", job_id, "-o",
                            "State,ExitCode,NodeList"], check=False)
        rows = [line for line in accounted.stdout.splitlines() if "|" in line]
        if accounted.returncode == 0 and rows:
            state, exit_code, nodes = (rows[0].split("|") + ["", ""])[:3]
            return JobStatus(state.split()[0], exit_code, "", nodes)
    return None


def cancel(job_id: str) -> None:
    """`scancel` the job and wait (up to a minute) until it has left the queue."""
    _slurm(["scancel", job_id], check=False)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        status = query_job(job_id)
        if status is None or not status.active:
            return
        time.sleep(0.5)
    logger.warning("SLURM job %s is still listed %.0f s after scancel", job_id, CANCEL_WAIT_S)


# ------------------------------------------------------------------ failure reports


def find_failed_task(job_output: str, srun_messages: dict[str, str]) -> FailedTask | None:
    """The task that failed first, from the script's `realrl: step ... failed` line and that
    step's srun messages (`srun: error: NODE: task R: Killed`)."""
    step_failure = _STEP_FAILED.search(job_output)
    if step_failure is None:
        return None
    step = step_failure["step"]
    task_error = _SRUN_TASK_ERROR.search(srun_messages.get(step, ""))
    how = f"exited with code {step_failure['code']}"
    if step == "master":
        return FailedTask("master", task_error["node"] if task_error else "?",
                          task_error["reason"] if task_error else how)
    if task_error is None:
        return FailedTask("workers", "?", how)
    first_rank = re.split(r"[,\-]", task_error["tasks"])[0]
    return FailedTask(f"worker{first_rank}", task_error["node"], task_error["reason"])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str] | None:
    """The last `lines` lines of a task's log, without those for the log file only (a
    `UserFacingError`'s traceback; `realrl.launcher.processes.is_log_only`)."""
    if not path.is_file():
        return None
    return [line for line in _read(path).splitlines() if not is_log_only(line)][-lines:]


def describe_failure(config: BaseExperimentConfig, job_id: str, status: JobStatus) -> str:
    """What failed, where, and the last lines of its log (or where to find them)."""
    _, logs, slurm_dir = run_paths(config)
    job_output = slurm_dir / f"job-{job_id}.out"
    srun_files = {step: slurm_dir / f"job-{job_id}-{step}.srun" for step in ("master", "workers")}
    failed = find_failed_task(_read(job_output), {s: _read(p) for s, p in srun_files.items()})
    headline = f"SLURM job {job_id} ended {status.state} (exit code {status.exit_code or '?'})"
    if failed is None:
        return (f"{headline}, reason {status.reason or 'none given'}; no task reported a "
                f"failure.\n  job output: {job_output}\n  task logs: {logs}/")
    log_path = logs / f"{failed.name}.log"
    tail = _tail(log_path)
    if tail is None:
        body = (f"  its log {log_path} is not readable here (no shared filesystem?): it is on "
                f"node {failed.node}.")
    else:
        shown = "\n".join(f"    {line}" for line in tail) or "    (no output)"
        body = f"  last {len(tail)} lines of {log_path}:\n{shown}"
    return (f"{headline}: task {failed.name!r} on node {failed.node}: {failed.how}; the job was "
            f"ended, so every other task was stopped.\n{body}\n  job output: {job_output}; srun "
            f"messages: {srun_files['workers' if failed.name != 'master' else 'master']}")


# ------------------------------------------------------------------ following a job


class _LogFollower:
    """Copies new lines of one log file to the console, with a prefix (but not the lines for
    the log file only)."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix = path, prefix
        self.offset = path.stat().st_size if path.is_file() else 0

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as log_file:
            log_file.seek(self.offset)
            data = log_file.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            if not is_log_only(line):
                sys.stdout.write(f"{self.prefix} {line}\n")
        sys.stdout.flush()


def follow_job(job_id: str, config: BaseExperimentConfig,
               stop: _GracefulStop | None = None) -> JobStatus:
    """Poll until the job has ended; returns its final status. Passes a graceful `stop` asked
    for meanwhile on to the job."""
    _, logs, _ = run_paths(config)
    follower = _LogFollower(logs / "master.log", "[master]")
    last_state = ""
    while True:
        status = query_job(job_id)
        if status is None:
            raise SlurmError(f"SLURM job {job_id} is unknown to squeue, scontrol and sacct; "
                             f"see {run_paths(config)[2]}/job-{job_id}.out")
        if status.state != last_state:
            where = f" on {status.nodes}" if status.nodes and status.state == "RUNNING" else ""
            reason = (f" ({status.reason})" if status.state == "PENDING"
                      and status.reason not in ("", "None") else "")
            sys.stdout.write(f"SLURM job {job_id}: {status.state}{where}{reason}\n")
            last_state = status.state
        follower.poll()
        if not status.active:
            return status
        if stop is not None:
            stop.forward(job_id, status)
        time.sleep(config.slurm.poll_interval_s)


def _run_one_attempt(config: BaseExperimentConfig, job: SlurmJob,
                     stop: _GracefulStop) -> tuple[str, JobStatus]:
    script = write_batch_script(config, job)
    job_id = submit(script)
    sys.stdout.write(f"submitted SLURM job {job_id} (attempt {job.attempt}): {script}\n")
    sys.stdout.flush()
    try:
        return job_id, follow_job(job_id, config, stop)
    except (KeyboardInterrupt, _Interrupted):
        sys.stderr.write(f"interrupted: cancelling SLURM job {job_id}\n")
        cancel(job_id)
        raise


def _newest_step(run_dir: Path) -> int:
    checkpoint = latest_complete_checkpoint(run_dir)
    return -1 if checkpoint is None else int(checkpoint.name.removeprefix("step"))


def run_on_slurm(config: BaseExperimentConfig) -> int:
    """Run `config` as a SLURM job (resubmitting per `recover_mode`); returns the exit code."""
    prepared = prepare_run(config)
    run_dir, plan_json = prepared.run_dir, prepared.run_plan.to_json()
    auto = config.recover_mode == RecoverMode.auto
    retries = config.recover_retries if auto else 0
    retries_used, attempt, stop = 0, 0, _GracefulStop()
    previous_handlers = _install_handlers(stop)
    try:
        while True:
            attempt += 1
            started_from = _newest_step(run_dir)
            job = SlurmJob(attempt, free_port(), prepared.secret.hex(), plan_json)
            job_id, status = _run_one_attempt(config, job, stop)
            if status.state == "COMPLETED" and status.exit_code in ("", "0:0"):
                sys.stdout.write(f"SLURM job {job_id} completed; run directory {run_dir}\n")
                return 0
            if status.exit_code.startswith(f"{PREEMPTED_EXIT_CODE}:"):
                progressed = _newest_step(run_dir) > started_from
                if stop.signal_number is None and auto and (progressed or retries_used < retries):
                    retries_used += 0 if progressed else 1
                    sys.stderr.write(f"SLURM job {job_id} stopped with a checkpoint (time limit "
                                     "or preemption); recover_mode=auto: resubmitting\n")
                    continue
                how = f"SLURM job {job_id} stopped "
                sys.stderr.write(f"{preemption_message(run_dir, how)}\n")
                return PREEMPTED_EXIT_CODE
            sys.stderr.write(f"error: {describe_failure(config, job_id, status)}\n")
            if retries_used == retries or stop.signal_number is not None:
                return 1  # no retries left, or the user asked the run to stop
            retries_used += 1
            sys.stderr.write(f"recover_mode=auto: resubmitting (retry {retries_used} of "
                             f"{retries})\n")
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except _Interrupted as interrupted:
        return 128 + interrupted.signal_number
    except SlurmError as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    finally:
        for signal_number, handler in previous_handlers.items():
            signal.signal(signal_number, handler)


def _install_handlers(stop: _GracefulStop) -> dict[int, object]:
    """SIGTERM and SIGUSR1 go to `stop` (main thread only); returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGUSR1)}


def describe_dry_run(config: BaseExperimentConfig) -> str:
    """The sbatch script and srun commands `mode=slurm` would submit (secret and plan elided)."""
    problems = slurm_problems(config)
    if problems:
        raise ConfigError(problems)
    _, _, slurm_dir = run_paths(config)
    script = render_batch_script(config, SlurmJob(1, None, None, None))
    return (f"# sbatch script ({slurm_dir}/attempt1.sbatch, submitted with `sbatch --parsable`)\n"
            f"{script}\n# srun steps\nmaster:  {shell_join(master_srun(config))}\n"
            f"workers: {shell_join(worker_srun(config))}\n")
