"""The sbatch script of a run: one allocation, a master step and a model-worker step.

Why one script with two srun steps: SLURM then owns placement, signalling and clean-up of
every task, and the whole run is one job that one `scancel` ends. The script

1. asks for `n_nodes` nodes with `n_devices_per_node` tasks each (GPUs, CPUs and memory per
   task, partition, account, QoS, time, exclusive, node list and extra arguments from
   `slurm.*`);
2. writes the run plan, embedded in the script, into the run directory on the first node, and
   creates the log directory on every node, so no shared filesystem is needed;
3. finds the master's address from SLURM itself: the first host of `$SLURM_JOB_NODELIST`
   (`scontrol show hostnames`) and its `NodeAddr` (`scontrol show node`), plus the port the
   launcher chose; workers connect to the master's TCPStore there;
4. starts the master (1 task on the first node, `--overlap` so it needs no CPU of its own) and
   the workers (`--distribution=block`: rank r on node r // D as local task r % D; each task
   checks this) with `--kill-on-bad-exit=1`, each task logging to `logs/master.log` or
   `logs/worker<R>.log` like local mode;
5. watches both steps and ends the job (so SLURM kills every task) as soon as either fails,
   writing `realrl: step <name> failed with exit code <N>` to the job output;
6. traps USR1, which SLURM sends `slurm.preempt_lead_s` seconds before the time limit
   (`--signal=B:USR1@N`), and forwards it to the master step: the master finishes its step,
   writes a checkpoint and exits 75, and so does the job (`realrl.workers.preemption`).

The run secret is exported in the script as `$REALRL_RUN_SECRET`; the launcher writes the
script owner-only (0600). Everything SLURM-specific goes under `<run_dir>/slurm/`: the scripts
(`attempt<N>.sbatch`), the job output (`job-<id>.out`) and each srun's own messages
(`job-<id>-<step>.srun`, where srun names the failed task).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from realrl.api import environment
from realrl.api.config import BaseExperimentConfig
from realrl.workers.preemption import PREEMPT_SIGNAL, PREEMPTED_EXIT_CODE

GPU_REQUEST_KINDS = ("auto", "gres", "gpus", "none")
MAX_SIGNAL_LEAD_S = 65535  # sbatch --signal's sig_time
PLAN_DELIMITER = "REALRL_PLAN_JSON"
SECRET_PLACEHOLDER = "<64 hex digits: the run secret, written at submission>"


class Raw(str):
    """A script token that must not be quoted (it expands a shell variable)."""


@dataclass
class SlurmJob:
    """What differs between submissions of one run."""

    attempt: int
    port: int | None  # None: a dry run, the launcher picks the port at submission
    secret_hex: str | None  # None: a dry run, the secret is not shown
    plan_json: str | None  # None: a dry run, the plan is elided


def slurm_problems(config: BaseExperimentConfig) -> list[str]:
    """Every problem with the `slurm.*` keys, each naming the key and the fix."""
    slurm = config.slurm
    problems = []
    if slurm.gpu_request not in GPU_REQUEST_KINDS:
        problems.append(f"`slurm.gpu_request={slurm.gpu_request}` must be one of "
                        f"{', '.join(GPU_REQUEST_KINDS)}.")
    if slurm.container_image and slurm.singularity_image:
        problems.append("set at most one of `slurm.container_image` (pyxis) and "
                        "`slurm.singularity_image`.")
    for key in ("cpus_per_task", "mem_per_task_mb"):
        value = getattr(slurm, key)
        if value is not None and value < 1:
            problems.append(f"`slurm.{key}={value}` must be at least 1 (or null for the default).")
    if slurm.poll_interval_s <= 0:
        problems.append(f"`slurm.poll_interval_s={slurm.poll_interval_s}` must be positive.")
    if not 0 <= slurm.preempt_lead_s <= MAX_SIGNAL_LEAD_S:
        problems.append(f"`slurm.preempt_lead_s={slurm.preempt_lead_s}` must be between 0 (no "
                        f"signal) and {MAX_SIGNAL_LEAD_S} (SLURM's limit), e.g. 300.")
    return problems


def run_paths(config: BaseExperimentConfig) -> tuple[Path, Path, Path]:
    """(run directory, logs directory, slurm directory), absolute."""
    run_dir = config.run_dir.resolve()
    return run_dir, run_dir / "logs", run_dir / "slurm"


def sbatch_options(config: BaseExperimentConfig) -> list[str]:
    """The `#SBATCH` options of the run's allocation, in a fixed order."""
    slurm, devices = config.slurm, config.n_devices_per_node
    _, _, slurm_dir = run_paths(config)
    options = [
        f"--job-name=realrl-{config.experiment_name}-{config.trial_name}",
        f"--nodes={config.n_nodes}",
        f"--ntasks-per-node={devices}",
    ]
    if slurm.cpus_per_task is not None:
        options.append(f"--cpus-per-task={slurm.cpus_per_task}")
    if slurm.mem_per_task_mb is not None:
        options.append(f"--mem={slurm.mem_per_task_mb * devices}M")
    # The launcher resolves auto from sinfo (`slurm_checks`); left unresolved it is gres.
    if slurm.gpu_request in ("gres", "auto"):
        options.append(f"--gres=gpu:{devices}")
    elif slurm.gpu_request == "gpus":
        options.append(f"--gpus-per-node={devices}")
    for key, flag in (("partition", "partition"), ("account", "account"), ("qos", "qos"),
                      ("time_limit", "time"), ("nodelist", "nodelist"), ("exclude", "exclude")):
        value = getattr(slurm, key)
        if value:
            options.append(f"--{flag}={value}")
    if slurm.exclusive:
        options.append("--exclusive")
    if slurm.preempt_lead_s:  # B: the batch script only; it forwards USR1 to the master step
        options.append(f"--signal=B:{PREEMPT_SIGNAL.name.removeprefix('SIG')}@{slurm.preempt_lead_s}")
    options += [f"--output={slurm_dir}/job-%j.out", "--open-mode=append",
                f"--chdir={Path.cwd()}"]
    return options + list(slurm.extra_sbatch_args)


def _container_args(config: BaseExperimentConfig) -> tuple[list[str], list[str]]:
    """(extra srun options, command prefix) for the configured container, if any."""
    run_dir, _, _ = run_paths(config)
    cwd = Path.cwd()
    mounts = [str(cwd)] + ([] if run_dir.is_relative_to(cwd) else [str(run_dir)])
    if config.slurm.container_image:
        return [f"--container-image={config.slurm.container_image}",
                f"--container-mounts={','.join(mounts)}", f"--container-workdir={cwd}"], []
    if config.slurm.singularity_image:
        gpu_flag = [] if config.slurm.gpu_request == "none" else ["--nv"]
        return [], ["singularity", "exec", *gpu_flag, "--bind", ",".join(mounts), "--pwd",
                    str(cwd), config.slurm.singularity_image]
    return [], []


def _python(config: BaseExperimentConfig) -> str:
    if config.slurm.python:
        return config.slurm.python
    in_container = config.slurm.container_image or config.slurm.singularity_image
    return "python3" if in_container else sys.executable


def _entry(config: BaseExperimentConfig) -> list[str]:
    run_dir, _, _ = run_paths(config)
    return [_python(config), "-m", "realrl.launcher.entry", "--run-dir", str(run_dir),
            "--store", Raw('"$REALRL_STORE"'), "--world-size", str(config.n_workers),
            "--no-watch-parent"]


def master_srun(config: BaseExperimentConfig) -> list[str]:
    """The master step: one task on the first node, sharing the workers' resources."""
    _, logs, _ = run_paths(config)
    srun_options, prefix = _container_args(config)
    return ["srun", "--nodes=1", "--ntasks=1", Raw('--nodelist="$MASTER_NODE"'), "--overlap",
            "--kill-on-bad-exit=1", f"--output={logs}/master.log", "--open-mode=append",
            *srun_options, *config.slurm.extra_srun_args, *prefix, *_entry(config), "master"]


def worker_srun(config: BaseExperimentConfig) -> list[str]:
    """The model-worker step: rank r = $SLURM_PROCID on node r // D, local task r % D."""
    _, logs, _ = run_paths(config)
    devices = config.n_devices_per_node
    srun_options, prefix = _container_args(config)
    return ["srun", f"--nodes={config.n_nodes}", f"--ntasks={config.n_workers}",
            f"--ntasks-per-node={devices}", "--distribution=block",
            Raw('--cpus-per-task="$WORKER_CPUS"'), "--kill-on-bad-exit=1",
            f"--output={logs}/worker%t.log", "--open-mode=append",
            *srun_options, *config.slurm.extra_srun_args, *prefix, *_entry(config),
            "worker", "--devices-per-node", str(devices)]


def shell_join(tokens: list[str]) -> str:
    return " ".join(token if isinstance(token, Raw) else shlex.quote(token) for token in tokens)


# OMP_WAIT_POLICY=PASSIVE: see realrl.launcher.run.openmp_environment (a user's choice wins).
_THREADS = ("OMP_NUM_THREADS={0} MKL_NUM_THREADS={0} REALRL_NUM_THREADS={0} "
            "OMP_WAIT_POLICY=${{OMP_WAIT_POLICY:-PASSIVE}}")

# Graceful preemption: SLURM sends USR1 `slurm.preempt_lead_s` before the time limit (`--signal=B:`
# signals this script only), and so does `scancel --batch --signal=USR1 <job>` (the launcher's
# graceful stop). The master step gets it (srun forwards it to its task), finishes its step,
# writes a checkpoint and exits 75.
_PREEMPTION_TRAP = """\
PREEMPT_ASKED=""
forward_preemption() {
  PREEMPT_ASKED=1
  echo "realrl: got SIGUSR1 (time limit or preemption ahead): asking the master to checkpoint"
  if [ -n "${MASTER_PID:-}" ]; then kill -USR1 "$MASTER_PID" 2>/dev/null; fi
}
trap forward_preemption USR1
"""

_SUPERVISE = """\
if [ -n "$PREEMPT_ASKED" ]; then kill -USR1 "$MASTER_PID" 2>/dev/null; fi  # asked before it started
# End the job as soon as either step fails: SLURM then kills every remaining task. The workers
# step is checked first: when a worker dies the master fails too, often within the same second,
# and the worker is the cause to report. The master's exit code PREEMPTED means it stopped as
# asked with a checkpoint: the job ends with that code for the launcher to resubmit.
declare -A STEP_PIDS=([master]=$MASTER_PID [workers]=$WORKERS_PID)
MASTER_DONE_AT=""
while [ ${#STEP_PIDS[@]} -gt 0 ]; do
  for step in workers master; do
    [ -n "${STEP_PIDS[$step]:-}" ] || continue
    if ! kill -0 "${STEP_PIDS[$step]}" 2>/dev/null; then
      wait "${STEP_PIDS[$step]}"; status=$?
      unset "STEP_PIDS[$step]"
      if [ "$step" = master ] && [ "$status" -eq PREEMPTED ]; then
        echo "realrl: step master stopped with a checkpoint (preempted); ending the job"
        exit PREEMPTED
      fi
      if [ "$status" -ne 0 ]; then
        echo "realrl: step $step failed with exit code $status; ending the job"
        exit "$status"
      fi
      echo "realrl: step $step finished"
      [ "$step" = master ] && MASTER_DONE_AT=$SECONDS
    fi
  done
  if [ -n "$MASTER_DONE_AT" ] && [ $((SECONDS - MASTER_DONE_AT)) -gt 120 ]; then
    echo "realrl: workers still running 120 s after the master finished; ending the job"
    exit 0
  fi
  sleep 1
done
echo "realrl: all steps finished"
""".replace("PREEMPTED", str(PREEMPTED_EXIT_CODE))


def render_batch_script(config: BaseExperimentConfig, job: SlurmJob) -> str:
    """The complete sbatch script for one submission of `config`'s run."""
    run_dir, logs, slurm_dir = run_paths(config)
    devices = config.n_devices_per_node
    header = ["#!/bin/bash",
              f"# realrl run {config.experiment_name}/{config.trial_name}, attempt {job.attempt}"
              f" (written by realrl.launcher.slurm; {config.n_nodes} node(s) x {devices} "
              f"worker task(s) + 1 master task)"]
    header += [f"#SBATCH {option}" for option in sbatch_options(config)]
    env = {environment.RUN_DIR: str(run_dir), "PYTHONUNBUFFERED": "1", **config.slurm.env}
    lines = [f"export {name}={shlex.quote(str(value))}" for name, value in env.items()]
    secret = job.secret_hex if job.secret_hex is not None else SECRET_PLACEHOLDER
    lines.append(f"export REALRL_RUN_SECRET={shlex.quote(secret)}  # this file is owner-only")
    lines += ["", "# The run plan travels inside this script: the master needs no shared filesystem.",
              f"mkdir -p {shlex.quote(str(logs))} {shlex.quote(str(slurm_dir))}"]
    if job.plan_json is None:
        lines.append("# (dry run: the run plan, plan.json, is embedded here at submission)")
    else:
        lines += [f"printf '%s' \"$(cat <<'{PLAN_DELIMITER}'",  # byte-exact: no trailing newline
                  job.plan_json.rstrip("\n"), PLAN_DELIMITER,
                  f')" > {shlex.quote(str(run_dir / "plan.json"))}']
    port = str(job.port) if job.port is not None else "PORT_CHOSEN_AT_SUBMISSION"
    cpus = (str(config.slurm.cpus_per_task) if config.slurm.cpus_per_task is not None
            else f"$(( SLURM_CPUS_ON_NODE / {devices} ))")
    lines += ["", _PREEMPTION_TRAP.rstrip("\n")]
    lines += [
        "",
        "# Rendezvous: the master's address comes from SLURM, the port from the launcher.",
        'MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(scontrol show node \"$MASTER_NODE\" -o "
        "| sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "export REALRL_STORE=\"${MASTER_ADDR:-$MASTER_NODE}:" + port + '"',
        f"WORKER_CPUS={cpus}",
        '[ "$WORKER_CPUS" -ge 1 ] || WORKER_CPUS=1',
        'echo "realrl: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; master on $MASTER_NODE, '
        'store $REALRL_STORE; $WORKER_CPUS CPU(s) per worker"',
        "",
        "# Every node gets the log directory (srun --output needs it there).",
        f"srun --nodes={config.n_nodes} --ntasks={config.n_nodes} --ntasks-per-node=1 "
        f"mkdir -p {shlex.quote(str(logs))} || exit 1",
        "",
        _THREADS.format(1) + " \\",
        f"  {shell_join(master_srun(config))} \\",
        f'  2>>"{slurm_dir}/job-$SLURM_JOB_ID-master.srun" &',
        "MASTER_PID=$!",
        _THREADS.format('"$WORKER_CPUS"') + " \\",
        f"  {shell_join(worker_srun(config))} \\",
        f'  2>>"{slurm_dir}/job-$SLURM_JOB_ID-workers.srun" &',
        "WORKERS_PID=$!",
        "",
    ]
    return "\n".join(header) + "\n\n" + "\n".join(lines) + "\n" + _SUPERVISE


def write_batch_script(config: BaseExperimentConfig, job: SlurmJob) -> Path:
    """Write the script owner-only (it holds the run secret) and return its path."""
    _, _, slurm_dir = run_paths(config)
    slurm_dir.mkdir(parents=True, exist_ok=True)
    path = slurm_dir / f"attempt{job.attempt}.sbatch"
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as script:
        script.write(render_batch_script(config, job))
    return path
