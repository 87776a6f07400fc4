"""Prepare a run before any process starts: what the local and the SLURM runner share.

`prepare_run(config)` is the one way a run is set up, whichever runner starts its processes:

1. every check a run can pass before a process starts (`realrl.launcher.preflight`), which also
   resolves what the launcher decides for the user (empty model paths, length limits,
   `slurm.gpu_request=auto`) and builds the launch plan once;
2. the run directory: a previous one is renamed with `recover_mode=disabled`, and `logs/` made;
3. the files every process reads from it: the resolved `config.yaml`, `plan.json` (the
   `RunPlan` the master publishes to the workers), the graph as Mermaid and DOT, and an
   owner-only `.secret` that signs every message of the run (kept when resuming).

The result, a `PreparedRun`, is what `realrl.launcher.local` and `realrl.launcher.slurm` start
processes from. After a graceful stop both tell the user how to resume (`preemption_message`).
This module sits below both runners and imports neither (the layers are drawn in
`realrl.launcher.run`).
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from realrl.api.config import BaseExperimentConfig, RecoverMode, to_yaml
from realrl.launcher.plan import LaunchPlan
from realrl.launcher.preflight import prepare_launch
from realrl.workers.preemption import PREEMPTED_EXIT_CODE
from realrl.workers.recovery import latest_complete_checkpoint
from realrl.workers.run_plan import RunPlan, base_settings
from realrl.workers.run_secret import create_run_secret, load_run_secret

logger = logging.getLogger(__name__)

_RECOVER_OVERRIDE = re.compile(r"\+{0,2}recover_mode=")


@dataclass
class PreparedRun:
    """A checked, planned run whose directory holds everything its processes read. (The config
    itself was resolved in place: model paths and length limits filled in.)"""

    plan: LaunchPlan  # the launch plan: graph, allocations, workers
    run_plan: RunPlan  # what the master publishes to the workers (`plan.json`)
    secret: bytes  # the run's message-signing key (`.secret`)

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir


def prepare_run(config: BaseExperimentConfig) -> PreparedRun:
    """Check, plan and write the run directory of `config` (see the module docstring).
    Raises `ConfigError` with every problem found before anything is written."""
    plan = prepare_launch(config)
    prepare_run_dir(config)
    run_plan = write_run_files(config, plan)
    sys.stdout.write(f"run directory: {plan.run_dir}\n")
    sys.stdout.flush()
    return PreparedRun(plan, run_plan, load_run_secret(plan.run_dir))


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
    """Write `config.yaml`, the graph, `plan.json` and (unless it exists) `.secret`."""
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
