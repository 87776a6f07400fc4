"""Errors whose message is written for the user, and how a run reports them.

Why: a user who set a key wrong, whose model produces a NaN, or whose reward service answers
garbage needs one line saying what happened, where, and what to do. A Python traceback above
that line tells them nothing, and pushes the line itself out of the log tail the launcher
prints. A bug in realrl is the opposite case: its traceback is what a maintainer needs.

So an error whose message is complete for the user derives from `UserFacingError`
(`ConfigError`, `DatasetError`, `NonFiniteError`, `RemoteRewardError`, `CheckpointWriteError`,
...). When one ends a master or a model worker (`realrl.launcher.entry`), the process logs its
message as one ERROR line and exits 1; its traceback still goes to the process's log file, but
with every line marked for the log only (`realrl.launcher.processes.LOG_ONLY_PREFIX`), and the
launcher keeps marked lines off the console and out of the log tails it prints. A model worker
that fails a request on one adds the step, MFC, role and rank to the message and answers the
master with it, marked user-facing; the master then stops the run on it in the same way,
naming the worker (`realrl.workers.wire.RemoteUserFacingError`). Any other exception keeps
its traceback everywhere.
"""

from __future__ import annotations


class UserFacingError(Exception):
    """An error whose message says what happened, where, and the fix (see the module docstring)."""

    def add_context(self, where: str) -> None:
        """Put where it happened in front of the message, e.g. "step 3, MFC actor_train, role
        actor, rank 1: ...", keeping the exception's type and traceback."""
        self.args = (f"{where}: {self}",)
