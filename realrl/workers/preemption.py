"""Graceful preemption: a signal asks the master to finish its step, checkpoint and exit.

Why: a run that is about to lose its machine (a SLURM time limit or preemption ahead, a
container being stopped, a user's `kill`) should lose no work, so it must not die mid-step the
way SIGKILL ends it. The master is the only process that knows where a step ends, so the
signal is meant for it:

- the local launcher turns the SIGTERM or SIGUSR1 it receives into SIGUSR1 to the master
  (`realrl.launcher.processes`); under SLURM the sbatch script asks for USR1 ahead of the time
  limit (`slurm.preempt_lead_s`) and forwards it to the master step
  (`realrl.launcher.slurm_script`);
- the master (`realrl.workers.master_main`) installs `PreemptionRequest` before anything slow
  happens, so that a signal during start-up is not fatal either; its step loop checks the
  request between steps: it finishes the step in flight (with `pipeline_rollout=true` also
  the rollout already running for the next step, so that the data position stays exact),
  writes a checkpoint, lets the workers exit and exits with `PREEMPTED_EXIT_CODE`;
- model workers ignore SIGUSR1 (`ignore_preemption_signal`): `scancel --signal=USR1 JOB`
  reaches every task of a job, and only the master acts on it.

The exit code is 75 (`EX_TEMPFAIL`: "a temporary failure; the user is invited to retry"), the
same from the master, the launcher and the SLURM job, so a wrapper script can tell a run that
stopped with a checkpoint to resume from from a run that failed.

This module imports nothing heavy: `realrl.launcher.entry` installs the handler before torch is
imported.
"""

from __future__ import annotations

import signal

PREEMPT_SIGNAL = signal.SIGUSR1
PREEMPTED_EXIT_CODE = 75


class PreemptionRequest:
    """Whether (and by which signal) this process was asked to checkpoint and stop."""

    def __init__(self) -> None:
        self.signal_number: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal_number).name if self.requested else "none"

    def install(self) -> None:
        """Record `PREEMPT_SIGNAL` instead of dying of it (main thread only)."""
        signal.signal(PREEMPT_SIGNAL, self._record)

    def _record(self, signal_number: int, frame: object) -> None:
        if self.signal_number is None:
            self.signal_number = signal_number


def ignore_preemption_signal() -> None:
    """A model worker: `PREEMPT_SIGNAL` is the master's business (see the module docstring)."""
    signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)
