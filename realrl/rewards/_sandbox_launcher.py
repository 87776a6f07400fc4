"""Sandbox launcher: set up isolation, then exec the runner. Run as a script, never imported.

Why a separate launcher process rather than ``subprocess``'s ``preexec_fn``: the caller runs
sandboxes from a thread pool, and Python documents ``preexec_fn`` as unsafe with threads
(the forked child can deadlock on a lock another thread held). This script starts in a fresh
interpreter, so it may call anything.

Privileged mode (launched as root; the parent checks CAP_SYS_ADMIN by trying):
1. ``unshare`` new mount, network and PID namespaces. The network namespace holds only a
   down loopback device, so every connect fails, 127.0.0.1 included.
2. Mount empty tmpfs over the world-writable and private directories (``/tmp``,
   ``/dev/shm``, ``/root``, ...): writes there vanish with the namespace and nothing in them
   can be read. The work directory and the interpreter's prefix are bind-mounted back at
   their own paths (the interpreter read-only), so absolute paths keep working.
3. Fork a small init (pid 1 of the new PID namespace) that mounts a private ``/proc`` and
   forks the program. When the program exits, init exits and the kernel kills every
   process left in the namespace: a fork bomb or a daemonised child cannot outlive the run.
4. The program's process sets the resource limits, drops to an unprivileged uid/gid that
   owns only the work directory (so files with owner-only permissions elsewhere, such as a
   run's secrets, cannot be read), asks for SIGKILL if its init dies, and execs
   ``python -I -S``.

Fallback mode (not root): resource limits only; the runner disables ``socket`` in-process.

The exit status is the program's exit code, or 128 + the signal number that killed it.
"""

import ctypes
import json
import os
import resource
import sys

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error_number = ctypes.get_errno()
        raise OSError(error_number, f"{what}: {os.strerror(error_number)}")


def _encode(value: str | None) -> bytes | None:
    return value.encode() if value is not None else None


def _mount(source, target, filesystem, flags, data=None) -> None:
    encode = _encode
    _check(
        _libc.mount(encode(source), encode(target), encode(filesystem), flags, encode(data)),
        f"mount {source} on {target}",
    )


def _is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _bind_back(source_descriptor: int, path: str, read_only: bool) -> None:
    os.makedirs(path, exist_ok=True)
    _mount(f"/proc/self/fd/{source_descriptor}", path, None, _MS_BIND | _MS_REC)
    if read_only:
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        _mount(None, path, None, flags)


def _isolate_filesystem(config: dict) -> None:
    work_directory = os.getcwd()
    python_prefix = config["python_prefix"]
    work_descriptor = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    prefix_descriptor = os.open(python_prefix, os.O_RDONLY | os.O_DIRECTORY)
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for directory in config["masked_directories"]:
        if os.path.isdir(directory):
            options = f"size={config['tmpfs_bytes']},mode=1777"
            _mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    masked = config["masked_directories"]
    if any(_is_under(python_prefix, directory) for directory in masked):
        _bind_back(prefix_descriptor, python_prefix, read_only=True)
    if any(_is_under(work_directory, directory) for directory in masked):
        _bind_back(work_descriptor, work_directory, read_only=False)
    os.chdir(work_directory)
    os.close(work_descriptor)
    os.close(prefix_descriptor)


def _set_limits(limits: dict) -> None:
    cpu_s = limits["cpu_s"]
    # The hard CPU limit delivers SIGKILL one second after the soft limit's SIGXCPU.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    for name in ("AS", "NPROC", "FSIZE", "NOFILE"):
        value = limits[name.lower()]
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _exec_program(config: dict, drop_to_uid: int | None) -> None:
    """Runs in the process that becomes the program: limits, identity, then exec."""
    if drop_to_uid is not None:
        os.setgroups([])
        os.setgid(drop_to_uid)
        os.setuid(drop_to_uid)
        _check(_libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    _set_limits(config["limits"])
    os.execve(config["python"], config["argv"], config["environment"])


def _exit_code(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def _run_as_init(config: dict) -> int:
    """pid 1 of the new PID namespace: private /proc, run the program, report its status."""
    _check(_libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    program_pid = os.fork()
    if program_pid == 0:
        try:
            _exec_program(config, drop_to_uid=config["uid"])
        finally:
            os._exit(127)
    while True:  # reap orphans until the program itself exits
        pid, wait_status = os.wait()
        if pid == program_pid:
            return _exit_code(wait_status)


def main() -> None:
    config = json.loads(sys.argv[1])
    if not config["privileged"]:
        _exec_program(config, drop_to_uid=None)
        return
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID), "unshare")
    _isolate_filesystem(config)
    init_pid = os.fork()
    if init_pid == 0:
        try:
            os._exit(_run_as_init(config))
        finally:
            os._exit(126)
    _, wait_status = os.waitpid(init_pid, 0)
    sys.exit(_exit_code(wait_status))


if __name__ == "__main__":
    main()
