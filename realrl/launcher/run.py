"""Launch a run locally: prepare the run directory, start the master and the model workers.

The launcher resolves everything once (config, default model paths, graph, allocations),
writes it to the run directory (`config.yaml`, `plan.json`, the graph as Mermaid and DOT, an
owner-only `.secret`), then starts one master and N model-worker processes under a
`ProcessSupervisor`: per-process log files, prefixed console lines, each process its share of
the CPU threads, and any failure or Ctrl-C stops all of them. SIGTERM or SIGUSR1 stops the
run gracefully instead (`realrl.workers.preemption`): the master finishes its step and writes a
checkpoint, and the launcher exits with code 75 and prints the command that resumes the run.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from realrl.api import environment
from realrl.api.config import BaseExperimentConfig, RecoverMode, to_yaml, usable_cores
from realrl.launcher.plan import LaunchPlan
from realrl.launcher.preflight import prepare_launch
from realrl.launcher.processes import (
    ProcessFailure,
    ProcessSpec,
    ProcessSupervisor,
    RunPreempted,
    SupervisorInterrupted,
)
from realrl.workers.core_share import CoreShareSpec, create_share_file
from realrl.workers.preemption import PREEMPT_SIGNAL, PREEMPTED_EXIT_CODE
from realrl.workers.recovery import latest_complete_checkpoint
from realrl.workers.run_plan import RunPlan, base_settings
from realrl.workers.run_secret import create_run_secret

logger = logging.getLogger(__name__)

_RECOVER_OVERRIDE = re.compile(r"\+{0,2}recover_mode=")


def prepare_run_dir(config: BaseExperimentConfig) -> Path:
    """Create the run directory. With `recover_mode=disabled` an existing one is renamed to
    `<name>.old-<time>` (never overwritten, never merged into another old run)."""
    run_dir = config.run_dir
    if run_dir.exists() and config.recover_mode == RecoverMode.disabled:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        previous = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
        suffix = 1
        while previous.exists():  # two runs within one second
            previous = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{suffix}")
            suffix += 1
        logger.warning("recover_mode=disabled: moving the previous run to %s", previous)
        run_dir.rename(previous)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return run_dir


def write_run_files(config: BaseExperimentConfig, plan: LaunchPlan) -> RunPlan:
    run_dir = plan.run_dir
    (run_dir / "config.yaml").write_text(to_yaml(config))
    (run_dir / "graph.mmd").write_text(plan.graph.to_mermaid() + "\n")
    (run_dir / "graph.dot").write_text(plan.graph.to_dot() + "\n")
    run_plan = RunPlan(
        base=base_settings(config), dataset=config.dataset, dataset_kind=plan.spec.dataset_kind,
        models=plan.spec.models, mfcs=[plan.graph.mfcs[name] for name in plan.graph.order],
        allocations=plan.allocations, rollout_filter=plan.spec.rollout_filter,
    )
    (run_dir / "plan.json").write_text(run_plan.to_json())
    if not (run_dir / ".secret").exists():
        create_run_secret(run_dir)
    return run_plan


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def run_experiment(config: BaseExperimentConfig) -> int:
    """Run `config` to completion; returns the process exit code.

    The launch plan is built once, by `prepare_launch`, which checks everything that can be
    checked before a process starts (as `--dry-run` does).
    """
    if config.mode.value == "slurm":
        from realrl.launcher.slurm import run_on_slurm

        return run_on_slurm(config)
    plan = prepare_launch(config)
    prepare_run_dir(config)
    write_run_files(config, plan)
    sys.stdout.write(f"run directory: {plan.run_dir}\n")
    sys.stdout.flush()
    core_share = create_share_file(len(plan.workers)) if config.share_idle_cores else None
    try:
        supervisor = ProcessSupervisor(process_specs(config, plan, free_port(), core_share))
        return _supervise(supervisor, plan.run_dir)
    finally:
        if core_share is not None:
            core_share.unlink(missing_ok=True)


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


def preemption_message(run_dir: Path, how: str) -> str:
    """What a run stopped with a checkpoint (`how`: "the run stopped at SIGTERM ") left, and the
    exact command that resumes it: the command that started it, with `recover_mode=auto`."""
    checkpoint = latest_complete_checkpoint(run_dir)
    if checkpoint is None:
        left = "before its first checkpoint; starting it again starts from step 0"
    else:
        left = f"with checkpoint {checkpoint}"
    return (f"{how}{left} (exit code {PREEMPTED_EXIT_CODE}).\n"
            f"resume with: {resume_command()}")


def resume_command(argv: list[str] | None = None) -> str:
    """`argv` (default: this process's command line as typed, `sys.orig_argv`) with every
    `recover_mode=` override replaced by `recover_mode=auto` at the end."""
    argv = list(sys.orig_argv if argv is None else argv)
    kept = [token for token in argv if not _RECOVER_OVERRIDE.match(token)]
    return shlex.join([*kept, "recover_mode=auto"])
