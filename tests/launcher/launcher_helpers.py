"""Shared by the launcher tests that send Ctrl-C to a child process."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """`preexec_fn` for a child that must see Ctrl-C as a terminal delivers it.

    A non-interactive shell makes its background jobs ignore SIGINT, children inherit that,
    and Python then installs no KeyboardInterrupt handler: a test run started with `&` would
    otherwise find the child deaf to the SIGINT it sends.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
