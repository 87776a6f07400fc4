"""A TCP port for a rendezvous store or a collective's store, chosen below the ephemeral range.

A port found free by binding port 0 comes from the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), and it is only bound again
seconds later, once the process that hosts the store has imported torch. In between, any
outgoing connection on the machine (gloo, ZeroMQ, a store client of another run) may be given
the same port as its local end, and the host then fails with EADDRINUSE: a CI run lost a test
that way while the other test process was busy with its ranks. Ports below the ephemeral range
are never handed out for outgoing connections, so only another explicit bind can take one, and
a random choice among ~12,000 of them, checked by a bind, makes that unlikely.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
LOWEST_PORT = 20000  # well above the registered services that a machine may run


def ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port free on `host` now, below the ephemeral range where it has room (else any)."""
    high = ephemeral_low() - 1
    low = min(LOWEST_PORT, max(1024, high - 4096))
    generator = random.SystemRandom()
    for _ in range(attempts if high > low else 0):
        port = generator.randint(low, high)
        if _bindable(port, host):
            return port
    with socket.socket() as probe:  # every candidate taken, or no room: the kernel's choice
        probe.bind((host, 0))
        return probe.getsockname()[1]
