"""Run an experiment: the launcher's front door, which hands the run to the local or the SLURM
runner.

The launcher imports one way. Each module imports only modules of the layers below its own
(`tests/launcher/test_import_graph.py` reads every import, function-level ones included), and
none imports the CLI (`realrl.apps`) or the experiments, which sit above it:

    run             run_experiment: mode=local or mode=slurm (called by realrl.apps.quickstart)
      |
    local, slurm    the runners: start and follow the processes, report how the run ended
      |
    prepare         the run both runners start from: checks, plan, run directory, .secret;
      |             how to resume after a graceful stop
    preflight       every check before a process starts; fills default model paths, builds the plan
      |
    plan, warm_start, slurm_checks -> slurm_script, processes -> console, checkpoint_files,
    defaults        the parts. warm_start builds a missing default actor by running the CLI in
                    a child process, not by importing the runners that call it.

    entry -> processes, slurm_task
                    the master's and the workers' own processes: started by the runners as
                    `python -m realrl.launcher.entry`, imported by none of them.
"""

from __future__ import annotations

from realrl.api.config import BaseExperimentConfig, LaunchMode
from realrl.launcher.local import run_locally
from realrl.launcher.slurm import run_on_slurm


def run_experiment(config: BaseExperimentConfig) -> int:
    """Run `config` to completion; returns the process exit code.

    Both runners start from `realrl.launcher.prepare.prepare_run`, which checks everything that
    can be checked before a process starts (as `--dry-run` does) and builds the plan once.
    """
    if config.mode == LaunchMode.slurm:
        return run_on_slurm(config)
    return run_locally(config)
