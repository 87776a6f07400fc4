"""A model worker's side of the hang watchdog: it answers heartbeats and hands out its stacks.

Why a thread of its own: the master must tell a worker that is busy (a long generation, a
compilation, a collective waiting for a slow peer) from one that can no longer run (stopped
with SIGSTOP, its node frozen, its interpreter lock held for ever). The thread below answers
the master's pings on a ZeroMQ socket of its own while the main thread serves requests: torch
releases the interpreter lock inside its kernels, and pure-Python work hands it over every few
milliseconds, so a busy worker keeps answering, and a stopped one cannot.

On the master's request the same thread returns the Python stack of every other thread of the
process, the main thread first (`python_stacks`), which is how the watchdog shows what a late
worker was doing, on any node. A worker whose thread cannot answer may still be made to write
its stacks to its log by SIGUSR2 (`install_stack_dump_signal`: faulthandler, whose handler needs
no interpreter lock), which the master does where it can see the process, and anyone can do by
hand: `kill -USR2 <pid>`.

The worker publishes `{"address", "pid", "host", "start_ticks"}` under `heartbeat_key(rank)` in
the rendezvous store before it says it is ready (`start_ticks`, the process's start time from
/proc, lets the master make sure that the pid it sees on its machine is this process); the
master's side is `realrl.workers.watchdog` and `realrl.workers.hang_report`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from realrl.workers.transport import Server
from realrl.workers.wire import TransportError

logger = logging.getLogger(__name__)

STACK_DUMP_SIGNAL = signal.SIGUSR2
_POLL_S = 0.5  # how often the thread looks whether it should stop


def heartbeat_key(rank: int) -> str:
    return f"worker/{rank}/heartbeat"


def install_stack_dump_signal() -> None:
    """SIGUSR2 writes every thread's Python stack to stderr (the process's log)."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)


def process_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: [0] is the state letter (R, S,
    D, T, t, Z, ...), [19] the start time in clock ticks since boot; None without one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def python_stacks() -> str:
    """The Python stack of every thread of this process but the calling one, the main thread
    first, each most recent call last with its source lines, as a traceback reads."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main, caller = threading.main_thread().ident, threading.get_ident()
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    blocks = [f"Thread {names.get(ident, hex(ident))} (most recent call last):\n"
              + "".join(traceback.format_stack(frame)).rstrip()
              for ident, frame in frames if ident != caller]
    return "\n".join(blocks)


class HeartbeatResponder:
    """Answers "ping" (with this process's pid) and "stacks" requests from a daemon thread.

    The socket is made here and from then on used by the thread alone (ZeroMQ sockets may
    move to another thread once, behind the memory barrier that starting the thread is).
    """

    def __init__(self, host: str, secret: bytes):
        self._server = Server(f"tcp://{host}:*", secret)
        self.address = self._server.bound_address
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="heartbeat", daemon=True)
        self._thread.start()

    def publication(self) -> str:
        """What the master needs to reach and describe this worker, as JSON."""
        own = process_stat("self")
        return json.dumps({"address": self.address, "pid": os.getpid(),
                           "host": socket.gethostname(), "start_ticks": own and int(own[19])})

    def _serve(self) -> None:
        while not self._stopping.is_set():
            received = self._server.recv(timeout_s=_POLL_S)
            if received is None:
                continue
            peer, message = received
            if message.kind == "ping":
                reply = message.reply({"pid": os.getpid()})
            elif message.kind == "stacks":
                logger.warning("the master's hang watchdog asked for this worker's Python "
                               "stacks; they are in its diagnosis (logs/watchdog.txt)")
                reply = message.reply({"stacks": python_stacks()})
            else:
                reply = message.error_reply(f"the heartbeat thread answers 'ping' and 'stacks', "
                                            f"not {message.kind!r}")
            try:
                self._server.send(peer, reply)
            except TransportError:  # the master is gone; the process is about to be stopped
                pass
        self._server.close()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2 * _POLL_S + 1.0)
