"""Start a local run's master and workers by forking one process that imported them already.

Why: each of them otherwise starts a fresh interpreter that imports torch, transformers and
realrl, about 3 s of one core each (measured on a 2-core machine: 3.1-3.8 s of CPU, torch 2 s
of it). Three at once on two cores kept the workers from their first step for 7-8 s, and
most of a short run, such as every end-to-end test, was those imports.

How: the supervisor (`realrl.launcher.processes`) starts this module once,

    python -m realrl.launcher.forkserver FD [--for RUN_DIR] MODULE...

with one end of a socket pair as FD (RUN_DIR only tells `ps` whose processes these are). It imports the MODULEs (for a run: `ENTRY_MODULES`, what
`realrl.launcher.entry` imports), touching no GPU, and then forks a child for each request: a
command line `-m MODULE ARGS` or `-c CODE ARGS`, the child's environment and working
directory, and, passed as a file descriptor, the write end of the pipe that the supervisor
reads as the child's output. The child leaves this process's loop, becomes what
`python -m MODULE ARGS` would be (its own session, stdin from /dev/null, stdout and stderr
into that pipe, that environment, default signal handlers), runs the module as `__main__`
and exits as the interpreter would. This process reports each child's pid once the child
leads its own session, and its exit status once it ends (the negative signal number if a
signal killed it, as `subprocess.Popen` does).

Dying together: this process gets SIGKILL when the supervisor dies, and each child when this
process dies (`prctl(PR_SET_PDEATHSIG)`), so no child outlives the supervisor even if it is
killed. When the supervisor closes its end of the socket, this process starts nothing more and
exits once its last child has been reaped.

What a child inherits: the modules imported here and their import-time state. Environment
variables read at import (`OMP_WAIT_POLICY` by OpenMP, for one) take this process's values,
which the supervisor sets to what every child shares; each child's thread count is applied
after the fork by `torch.set_num_threads` (`apply_thread_limit`). `ps` shows every child with
this module's command line; each child's name (`ps -o comm`, `top`) says which it is
(`realrl-master`, `realrl-worker0`, ...).

`REALRL_FORK_SERVER=0` starts every process as its own interpreter instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import queue
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
_MAX_MESSAGE = 1 << 20
# What `realrl.launcher.entry` imports for either role (not the module itself: run as __main__
# it would be imported twice, and runpy warns), and torch._dynamo, which a trainer's first
# `torch.optim` call imports (1.5 s of CPU in each).
ENTRY_MODULES = ("realrl.launcher.processes", "realrl.launcher.slurm_task",
                 "realrl.workers.preemption", "realrl.workers.rendezvous",
                 "realrl.workers.master_main", "realrl.workers.model_worker", "torch._dynamo")


class ForkServerError(RuntimeError):
    """The fork server could not start a process (it died, or the fork failed)."""


# ---------------------------------------------------------------- the supervisor's side


class ForkedProcess:
    """A child of the fork server, with the part of `subprocess.Popen` the supervisor uses."""

    def __init__(self, server: ForkServer, pid: int, stdout_fd: int):
        self.pid = pid
        self.stdout = os.fdopen(stdout_fd, "rb")
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.returncode = self._server.wait(self.pid, timeout)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The supervisor's handle on one `python -m realrl.launcher.forkserver` process."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...], run_dir: str | None = None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent_pid = os.getpid()
        label = ["--for", run_dir] if run_dir else []
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), *label, *preload],
                env=env, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                start_new_session=True, preexec_fn=parent_death_signal_setter(parent_pid))
        finally:
            theirs.close()
        self._socket = ours
        self._replies: queue.Queue[dict] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._pids: list[int] = []
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="fork server", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """Fork a child that runs what `python ARGV` would (`-m MODULE ...` or `-c CODE ...`)
        with environment `env` (the whole of it), named `name`; blocks until the server has
        done its imports."""
        read_fd, write_fd = os.pipe()
        request = {"name": name, "argv": argv, "env": env, "cwd": os.getcwd()}
        try:
            socket.send_fds(self._socket, [json.dumps(request).encode()], [write_fd])
        except OSError as error:
            os.close(read_fd)
            raise self._failed(name, str(error)) from None
        finally:
            os.close(write_fd)
        reply = self._replies.get()
        if "pid" not in reply:
            os.close(read_fd)
            raise self._failed(name, reply["error"], exiting=reply.get("gone", False))
        return ForkedProcess(self, reply["pid"], read_fd)

    def _failed(self, name: str, why: str, exiting: bool = True) -> ForkServerError:
        if exiting:  # wait for its exit code
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=5.0)
        code = self._popen.poll()
        state = "running" if code is None else f"exited with code {code}"
        return ForkServerError(
            f"cannot start process {name!r}: the fork server (pid {self._popen.pid}, {state}) "
            f"failed: {why}. Its own errors, if any, are above; REALRL_FORK_SERVER=0 starts "
            "each process as its own interpreter instead.")

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: pid in self._exits, timeout):
                raise subprocess.TimeoutExpired(f"fork server child {pid}", timeout or 0.0)
            return self._exits[pid]

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["returncode"]
                    self._changed.notify_all()
                elif "pid" in message:
                    self._pids.append(message["pid"])
            if "exited" not in message:
                self._replies.put(message)
        # The server reports every child's exit before its own, unless it was killed: then
        # its children died with it (their parent-death signal), unreported.
        self._replies.put({"error": "it stopped answering", "gone": True})
        with self._changed:
            for pid in self._pids:
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._changed.notify_all()

    def exited_early(self) -> int | None:
        """The server's exit code if it is gone before it was closed (and its children with
        it), else None."""
        return None if self._closing else self._popen.poll()

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the server to start nothing more; it exits once its children have. Call after
        the children were stopped."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_WR)
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait()
        self._reader.join(timeout=timeout_s)
        self._socket.close()


# ---------------------------------------------------------------- the server's side


def _prctl(option: int, value: int | bytes) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def parent_death_signal_setter(parent_pid: int):
    """A function (a Popen preexec_fn) that has the calling process SIGKILLed when its parent
    `parent_pid` dies, and exits at once if it died already (Linux only, else None). `prctl`
    is resolved here, in the parent, not after the fork."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return set_parent_death_signal


def _send(channel: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
        channel.send(json.dumps(message).encode())


def _serve(channel: socket.socket) -> tuple[dict, int] | None:
    """Fork a child per request until the supervisor hangs up and the last child is reaped.
    Returns (request, output fd) in a child, None in this process when it is done."""
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    signal.signal(signal.SIGCHLD, lambda number, frame: None)  # only to wake select()
    children: set[int] = set()
    accepting = True
    while accepting or children:
        readable, _, _ = select.select([channel, wake_read] if accepting else [wake_read], [],
                                       [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                wake_read.recv(4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send(channel, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if accepting and channel in readable:
            data, fds, _, _ = socket.recv_fds(channel, _MAX_MESSAGE, 1)
            if not data:
                accepting = False
                continue
            request = json.loads(data)
            started_read, started_write = os.pipe()
            try:
                pid = os.fork()
            except OSError as error:
                for fd in (*fds, started_read, started_write):
                    os.close(fd)
                _send(channel, {"error": f"fork failed: {error}"})
                continue
            if pid == 0:
                os.close(started_read)
                for item in (channel, wake_read, wake_write):
                    item.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                os.close(started_write)  # the supervisor may signal our group from now on
                return request, fds[0]
            os.close(started_write)
            os.read(started_read, 1)  # returns once the child closed its end: it has a session
            os.close(started_read)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(channel, {"pid": pid})
    return None


def _become(request: dict, output_fd: int, server_pid: int) -> None:
    """Turn this fresh child into the process `python -m` / `python -c` would have started."""
    die_with_server = parent_death_signal_setter(server_pid)
    if die_with_server is not None:
        die_with_server()
    _prctl(_PR_SET_NAME, f"realrl-{request['name']}"[:15].encode())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


def forkable(argv: list[str]) -> bool:
    """Whether the fork server can run `argv`: this interpreter with `-m` or `-c`."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] in ("-m", "-c")


def _run(argv: list[str]) -> None:
    """What `python -m MODULE ARGS` or `python -c CODE ARGS` runs, in this process."""
    option, target, *args = argv
    if option == "-m":
        sys.argv = [target, *args]  # runpy puts the module's file first
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[0]))
    modules = argv[3:] if argv[1:2] == ["--for"] else argv[1:]
    server_pid = os.getpid()
    for module in modules:
        importlib.import_module(module)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # no child could use that GPU
        raise ForkServerError(f"CUDA was initialised while importing {modules}")
    served = _serve(channel)
    if served is None:
        os._exit(0)  # nothing to flush: skip tearing down the modules imported for the children
    request, output_fd = served
    _become(request, output_fd, server_pid)
    _run(request["argv"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
