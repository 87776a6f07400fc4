"""Code rewards: run a model-written Python program against test cases in a sandbox.

Each test case runs in a fresh subprocess with a fresh work directory (removed afterwards),
a scrubbed environment (minimal PATH, HOME=the work directory, nothing inherited), Python in
isolated mode (``-I -S``), resource limits (CPU seconds, address space, processes, file size,
open files, no core dumps) and a wall-clock timeout that kills the whole process group.

When this process is root (the usual case in containers) the launcher adds real isolation:
new network, mount and PID namespaces, empty tmpfs over ``/tmp``, ``/root``, ``/home`` and
the like, and a drop to an unprivileged uid. See ``_sandbox_launcher.py`` for the details and
why each step is there. Without root it falls back to resource limits plus an in-process
``socket`` guard, says so once in the log, and gives weaker guarantees: the program then runs
as the caller's user and can read whatever the caller can.

This is a library for the reward worker: it only ever spawns subprocesses and never runs
model code inside the calling process.

Test format (APPS / TACO / LiveCodeBench style), a JSON string:
``{"inputs": [stdin, ...], "outputs": [expected stdout, ...], "fn_name": optional}``.
Standard-input tests compare whitespace-normalised stdout. With ``fn_name`` each input is a
JSON argument list (or a string holding one JSON value per line) and the return value is
compared with the expected output.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from realrl.rewards._sandbox_runner import MEMORY_ERROR_EXIT_CODE, RESULT_MARKER

logger = logging.getLogger(__name__)

_PACKAGE_DIRECTORY = Path(__file__).parent
_LAUNCHER = _PACKAGE_DIRECTORY / "_sandbox_launcher.py"
_RUNNER = _PACKAGE_DIRECTORY / "_sandbox_runner.py"
_CODE_BLOCK_PATTERN = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_MASKED_DIRECTORIES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/root", "/home")
# Unprivileged uids for sandboxed programs: one per concurrent run in this process, offset by
# pid so that sandboxes in different reward workers on one host rarely share a uid.
_FIRST_SANDBOX_UID = 1_000_000 + (os.getpid() % 10_000) * 100
_MAX_CONCURRENT_UIDS = 100
_SIGNAL_STATUS = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit"}


@dataclass
class CodeResult:
    """Outcome of one program on its tests; `reward` is 1.0 only if every test passed.

    `statuses` holds one of "ok", "wrong", "timeout", "error", "memory", "output_limit"
    or "skipped" (not run after an earlier failure) per test, in order.
    """

    passed: int
    total: int
    reward: float
    statuses: list[str] = field(default_factory=list)


@dataclass
class ProgramRun:
    """Outcome of `CodeSandbox.run_program`: "ok" or a status of `CodeResult.statuses`, and
    the program's (capped) output."""

    status: str
    stdout: str
    stderr: str


def extract_code(completion: str) -> str | None:
    """The body of the last fenced ```python block of `completion` (or last plain ``` block)."""
    blocks = _CODE_BLOCK_PATTERN.findall(completion)
    return blocks[-1] if blocks else None


def normalize_output(text: str) -> str:
    """Whitespace-insensitive form of program output: trimmed lines, no blank trailing lines."""
    return "\n".join(line.strip() for line in text.strip().splitlines())


def _outputs_match(actual: str, expected) -> bool:
    if isinstance(expected, list):
        expected = "\n".join(str(item) for item in expected)
    return normalize_output(actual) == normalize_output(str(expected))


def _call_results_match(result, expected) -> bool:
    if result == expected:
        return True
    # APPS wraps a single return value in a list; JSON turns tuples into lists.
    return isinstance(expected, list) and len(expected) == 1 and result == expected[0]


def _call_arguments(test_input) -> str:
    if isinstance(test_input, str):
        return json.dumps([json.loads(line) for line in test_input.splitlines() if line.strip()])
    return json.dumps(test_input)


def _privileged() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("unshare") is not None


class CodeSandbox:
    """Runs untrusted Python programs against tests; thread-safe, see the module docstring.

    Args:
        timeout_s: wall-clock limit per test case; the CPU limit is its ceiling in seconds.
        memory_mb: address-space limit of the program.
        max_processes: process limit of the sandbox uid (forks beyond it fail).
        max_file_bytes: largest file the program may write, stdout included.
        max_open_files: open file descriptors.
        stop_at_first_failure: skip the remaining tests once one fails (the reward is 0
            anyway); `passed` then counts the tests that ran.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_processes: int = 16,
        max_file_bytes: int = 16 * 1024 * 1024,
        max_open_files: int = 64,
        stop_at_first_failure: bool = True,
    ):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_file_bytes = max_file_bytes
        self.max_open_files = max_open_files
        self.stop_at_first_failure = stop_at_first_failure
        self.privileged = _privileged()
        self._python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        self._python_prefix = os.path.realpath(sys.base_prefix)
        self._free_uids = list(range(_FIRST_SANDBOX_UID, _FIRST_SANDBOX_UID + _MAX_CONCURRENT_UIDS))
        self._uid_lock = threading.Lock()
        if self.privileged:
            logger.info("code sandbox: namespaces (net, mount, pid) and an unprivileged uid")
        else:
            logger.warning(
                "code sandbox: not root, so no network namespace or uid drop; falling back to "
                "resource limits and an in-process socket guard (programs can read what this "
                "user can read)"
            )

    def run_tests(self, program: str, input_output: str) -> CodeResult:
        """Run `program` on every test of `input_output` (a JSON string, see module docstring)."""
        try:
            tests = json.loads(input_output)
            inputs, outputs = tests["inputs"], tests["outputs"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"input_output must be a JSON object with 'inputs' and 'outputs' lists; "
                f"got {input_output[:200]!r} ({error})"
            ) from error
        if len(inputs) != len(outputs):
            raise ValueError(f"input_output has {len(inputs)} inputs but {len(outputs)} outputs")
        function_name = tests.get("fn_name")
        statuses: list[str] = []
        for test_input, expected in zip(inputs, outputs):
            if statuses and statuses[-1] != "ok" and self.stop_at_first_failure:
                statuses.append("skipped")
                continue
            statuses.append(self._run_one(program, test_input, expected, function_name))
        passed = statuses.count("ok")
        total = len(statuses)
        return CodeResult(passed, total, 1.0 if total and passed == total else 0.0, statuses)

    def run_completions(
        self, completions: list[str], input_outputs: list[str], max_parallel: int = 2
    ) -> list[CodeResult]:
        """Extract each completion's last code block and test it, `max_parallel` at a time."""

        def run(pair: tuple[str, str]) -> CodeResult:
            program = extract_code(pair[0])
            if program is None:
                return CodeResult(0, len(json.loads(pair[1])["inputs"]), 0.0, [])
            return self.run_tests(program, pair[1])

        with ThreadPoolExecutor(max_parallel, thread_name_prefix="code-sandbox") as pool:
            return list(pool.map(run, zip(completions, input_outputs)))

    def run_program(self, program: str, stdin_text: str = "") -> ProgramRun:
        """Run `program` once as ``__main__`` with `stdin_text` on its standard input, under the
        same isolation and limits as a test case: the python tool of agentic episodes
        (`realrl.episodes.tools`). Its output is cut at `max_file_bytes`."""
        exit_code, stdout, stderr = self._execute(program, stdin_text, ["stdio"])
        return ProgramRun(_failure_status(exit_code, stderr) or "ok", stdout, stderr)

    def _run_one(self, program: str, test_input, expected, function_name: str | None) -> str:
        if function_name:
            stdin_text, argv_tail = _call_arguments(test_input), ["call", function_name]
        else:
            stdin_text, argv_tail = str(test_input), ["stdio"]
        exit_code, stdout, stderr = self._execute(program, stdin_text, argv_tail)
        failure = _failure_status(exit_code, stderr)
        if failure is not None:
            return failure
        if not function_name:
            return "ok" if _outputs_match(stdout, expected) else "wrong"
        if RESULT_MARKER not in stdout:
            return "error"
        result = json.loads(stdout.rsplit(RESULT_MARKER, 1)[1])
        return "ok" if _call_results_match(result, expected) else "wrong"

    def _acquire_uid(self) -> int:
        with self._uid_lock:
            return self._free_uids.pop() if self._free_uids else _FIRST_SANDBOX_UID

    def _release_uid(self, uid: int) -> None:
        with self._uid_lock:
            if uid not in self._free_uids:
                self._free_uids.append(uid)

    def _launcher_config(self, uid: int, work_directory: str, argv_tail: list[str]) -> dict:
        argv = [self._python, "-I", "-S", "_runner.py", *argv_tail]
        if not self.privileged:
            argv.append("--block-network")
        return {
            "privileged": self.privileged,
            "uid": uid,
            "python": self._python,
            "python_prefix": self._python_prefix,
            "argv": argv,
            "environment": {"PATH": "/usr/bin:/bin", "HOME": work_directory, "LANG": "C.UTF-8"},
            "masked_directories": list(_MASKED_DIRECTORIES),
            "tmpfs_bytes": self.max_file_bytes,
            "limits": {
                "cpu_s": max(1, int(self.timeout_s + 0.999)),
                "as": self.memory_mb * 1024 * 1024,
                "nproc": self.max_processes,
                "fsize": self.max_file_bytes,
                "nofile": self.max_open_files,
            },
        }

    def _execute(self, program: str, stdin_text: str, argv_tail: list[str]) -> tuple[int, str, str]:
        """Run the runner once in a fresh directory; (exit code or 128+signal, stdout, stderr)."""
        uid = self._acquire_uid()
        control_directory = tempfile.mkdtemp(prefix="realrl-sandbox-")  # mode 0700, ours only
        try:
            work_directory = os.path.join(control_directory, "work")
            os.mkdir(work_directory, 0o700)
            Path(work_directory, "program.py").write_text(program)
            shutil.copyfile(_RUNNER, os.path.join(work_directory, "_runner.py"))
            if self.privileged:
                for name in ("", "program.py", "_runner.py"):
                    os.chown(os.path.join(work_directory, name), uid, uid)
            Path(control_directory, "stdin").write_text(stdin_text)
            config = self._launcher_config(uid, work_directory, argv_tail)
            with (
                open(os.path.join(control_directory, "stdin"), "rb") as stdin_file,
                open(os.path.join(control_directory, "stdout"), "w+b") as stdout_file,
                open(os.path.join(control_directory, "stderr"), "w+b") as stderr_file,
            ):
                exit_code = self._wait(config, work_directory, stdin_file, stdout_file, stderr_file)
                stdout = _read_capped(stdout_file, self.max_file_bytes)
                stderr = _read_capped(stderr_file, 65536)
            return exit_code, stdout, stderr
        finally:
            shutil.rmtree(control_directory, ignore_errors=True)
            self._release_uid(uid)

    def _wait(self, config: dict, work_directory: str, stdin_file, stdout_file, stderr_file) -> int:
        process = subprocess.Popen(
            [self._python, "-I", "-S", str(_LAUNCHER), json.dumps(config)],
            stdin=stdin_file,
            stdout=stdout_file,
            stderr=stderr_file,
            cwd=work_directory,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            close_fds=True,
        )
        try:
            process.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return 128 + signal.SIGXCPU  # reported as "timeout"
        if not self.privileged:
            _kill_group(process)  # stragglers left in the process group (no PID namespace)
        return process.returncode if process.returncode >= 0 else 128 - process.returncode


def _failure_status(exit_code: int, stderr: str) -> str | None:
    """The status of a run that failed ("timeout", "memory", "output_limit", "error"), or
    None for exit code 0."""
    if exit_code >= 128:
        return _SIGNAL_STATUS.get(exit_code - 128, "memory" if "MemoryError" in stderr else "error")
    if exit_code == MEMORY_ERROR_EXIT_CODE or (exit_code != 0 and "MemoryError" in stderr):
        return "memory"
    if exit_code != 0:
        # Python ignores SIGXFSZ, so an over-long write fails with EFBIG instead.
        return "output_limit" if "[Errno 27]" in stderr else "error"
    return None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _read_capped(file, max_bytes: int) -> str:
    file.seek(0)
    return file.read(max_bytes).decode("utf-8", errors="replace")
