"""Run an experiment on this machine (`mode=local`): the master and the model workers as
child processes of the launcher.

The run is prepared as for SLURM (`realrl.launcher.prepare`: checks, plan, run directory,
`.secret`); then one master and N model-worker processes start under a `ProcessSupervisor`:
per-process log files, prefixed console lines, each process its share of the CPU threads,
and any failure or Ctrl-C stops all of them. SIGTERM or SIGUSR1 stops the run gracefully
instead (`realrl.workers.preemption`): the master finishes its step and writes a checkpoint,
and the launcher exits with code 75 and prints the command that resumes the run.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from realrl.api import environment
from realrl.api.config import BaseExperimentConfig, usable_cores
from realrl.api.ports import free_port
from realrl.launcher.forkserver import ENTRY_MODULES
from realrl.launcher.plan import LaunchPlan, workers_without_gpus
from realrl.launcher.prepare import preemption_message, prepare_run
from realrl.launcher.processes import (
    ProcessFailure,
    ProcessSpec,
    ProcessSupervisor,
    RunPreempted,
    SupervisorInterrupted,
)
from realrl.workers.core_share import CoreShareSpec, create_share_file
from realrl.workers.preemption import PREEMPT_SIGNAL


def run_locally(config: BaseExperimentConfig) -> int:
    """Run `config` to completion on this machine; returns the process exit code."""
    prepared = prepare_run(config)
    plan = prepared.plan
    core_share = create_share_file(len(plan.workers)) if config.share_idle_cores else None
    try:
        # Not where the workers have GPUs yet: CUDA breaks in a process forked after it was
        # touched, and this path has not run on a GPU.
        forked = environment.fork_server_enabled() and workers_without_gpus(config)
        preload = ENTRY_MODULES if forked else ()
        supervisor = ProcessSupervisor(process_specs(config, plan, free_port(), core_share),
                                       preload=preload)
        return _supervise(supervisor, prepared.run_dir)
    finally:
        if core_share is not None:
            core_share.unlink(missing_ok=True)


def openmp_environment() -> dict[str, str]:
    """`OMP_WAIT_POLICY=PASSIVE` unless the user set a policy.

    OpenMP's default lets a thread that reaches a barrier first spin for a while. Our
    processes share the cores with each other (and, on a shared machine, with other users),
    so a spinning thread takes the core its late sibling needs: on the 2-core machine under a
    load average of ~7, one `actor_gen` took 9.5 s with spinning threads and 1.4 s with
    sleeping ones (`benchmarks/profile_rl_step.py --clock wall`). Sleeping costs a wake-up
    per parallel region when the machine is idle, a few percent of a decode step here.
    """
    if "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def process_specs(config: BaseExperimentConfig, plan: LaunchPlan, port: int,
                  core_share: Path | None = None) -> list[ProcessSpec]:
    """The master's and the workers' processes; with `core_share` (a file from
    `create_share_file`) the workers lend each other idle threads."""
    run_dir = plan.run_dir.resolve()
    worker_threads = max(1, usable_cores() // config.n_workers)
    common = [sys.executable, "-m", "realrl.launcher.entry", "--run-dir", str(run_dir),
              "--store", f"127.0.0.1:{port}", "--world-size", str(config.n_workers)]
    env = {environment.RUN_DIR: str(run_dir), "PYTHONUNBUFFERED": "1", **openmp_environment()}
    master_env = env if core_share is None else env | {environment.CORE_SHARE_FILE: str(core_share)}
    specs = [ProcessSpec("master", common + ["master"], master_env,
                         run_dir / "logs" / "master.log", "[master]", num_threads=1,
                         # The hang watchdog's diagnosis (`realrl.workers.hang_report.report_path`;
                         # not imported: it pulls in torch, which the launcher does without).
                         report_path=run_dir / "logs" / "watchdog.txt",
                         graceful_stop_signal=PREEMPT_SIGNAL)]
    for worker in plan.workers:
        roles = " ".join(worker.roles) or "idle"
        worker_env = env
        if core_share is not None:
            share = CoreShareSpec(core_share, worker.rank, len(plan.workers), worker_threads)
            worker_env = env | {environment.CORE_SHARE: share.to_env()}
        specs.append(ProcessSpec(
            f"worker{worker.rank}", common + ["worker", "--rank", str(worker.rank)], worker_env,
            run_dir / "logs" / f"worker{worker.rank}.log", f"[worker {worker.rank} {roles}]",
            num_threads=worker_threads,
        ))
    return specs


def _supervise(supervisor: ProcessSupervisor, run_dir: Path) -> int:
    try:
        supervisor.start()
        return supervisor.wait()
    except ProcessFailure as failure:
        sys.stderr.write(f"error: {failure}\n")
        return 1
    except SupervisorInterrupted as interrupted:
        sys.stderr.write(f"{interrupted}\n")
        return interrupted.exit_code
    except RunPreempted as preempted:
        asked = ("" if preempted.signal_number is None
                 else f"at {signal.Signals(preempted.signal_number).name} ")
        sys.stderr.write(f"{preemption_message(run_dir, f'the run stopped {asked}')}\n")
        return preempted.exit_code
    finally:
        supervisor.stop()
