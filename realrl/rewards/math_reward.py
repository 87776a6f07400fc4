"""Math rewards: 1.0 when a completion's final answer equals any reference, else 0.0.

Why worker processes: math-verify bounds its sympy work with ``signal.alarm``, which only
works on the main thread of a process, and some expressions (``9^{9^{9^9}}``) make sympy
run for minutes or hold memory. The reward worker calls us from threads, so every symbolic
comparison runs in a small pool of single-threaded child processes. Each request gets a
soft deadline inside the child (a timer signal, which interrupts Python-level sympy work
and keeps the child alive) and a hard wall-clock deadline in the parent: a child that has
not answered by ``timeout_s`` is killed and replaced, and that item scores 0. A training
step therefore waits at most ``timeout_s`` per item per worker, whatever the model writes.

Easy cases (same string, same number) never leave the calling thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from realrl.rewards.math_answer import as_math_verify_input, extract_answer, fast_match

logger = logging.getLogger(__name__)

_WORKER_SCRIPT = Path(__file__).with_name("_math_worker.py")


class _WorkerProcess:
    """One math-verify child process speaking JSON lines; restartable after a kill."""

    def __init__(self, memory_limit_mb: int, startup_timeout_s: float):
        self._memory_limit_mb = memory_limit_mb
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen | None = None
        self._stderr = None  # the child's stderr, a temporary file read when it fails to start
        self._buffer = b""

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        environment = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        # `-I` drops PYTHONPATH and the working directory, so the child is told where this
        # process finds its packages (a wheelhouse installed with `--target` is on PYTHONPATH).
        search_path = json.dumps([entry for entry in sys.path if entry])
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER_SCRIPT), str(self._memory_limit_mb), search_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=environment,
            start_new_session=True,  # a Ctrl-C in the trainer's terminal is not ours to take
        )
        self._buffer = b""
        ready = self._read_line(time.monotonic() + self._startup_timeout_s)
        if ready is None or not ready.get("ready"):
            try:  # a child that closed its output is exiting: give it a moment to be reaped
                exit_code = self._process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                exit_code = None
            self._stderr.seek(0)
            output = self._stderr.read().decode(errors="replace").strip()[-2000:]
            self.kill()
            what = (f"exited with code {exit_code}" if exit_code is not None
                    else f"did not answer within {self._startup_timeout_s} s")
            raise RuntimeError(
                f"math-verify worker {_WORKER_SCRIPT} {what} at start; check that "
                f"`import math_verify` works in {sys.executable}"
                + (f". Its last output:\n{output}" if output else "")
            )

    def kill(self) -> None:
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout, self._stderr):
            stream.close()
        self._process = None

    def request(self, message: dict, timeout_s: float) -> dict | None:
        """Send one request; the reply, or None after killing a child that missed the deadline."""
        if self._process is None or self._process.poll() is not None:
            self.kill()
            self.start()
        deadline = time.monotonic() + timeout_s
        try:
            self._process.stdin.write((json.dumps(message) + "\n").encode())
            self._process.stdin.flush()
        except BrokenPipeError:
            self.kill()
            return None
        reply = self._read_line(deadline)
        if reply is None:
            self.kill()  # replaced lazily by the next request
        return reply

    def _read_line(self, deadline: float) -> dict | None:
        descriptor = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return None
            readable, _, _ = select.select([descriptor], [], [], remaining_s)
            if not readable:
                return None
            chunk = os.read(descriptor, 65536)
            if not chunk:  # the child died
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


class MathVerifier:
    """Scores math completions against reference answers with math-verify, off the main thread.

    Safe to call from any thread, including several at once. Use as a context manager or call
    :meth:`close` to stop the child processes.

    Args:
        num_workers: child processes (and symbolic comparisons running at once).
        timeout_s: wall-clock limit for one completion against all its references.
        use_last_number: fall back to the last number in the text when no answer format
            (``\\boxed``, ``####``, ``Answer:``) is present.
        interrupt_in_worker: also set a soft deadline inside the child at 80% of `timeout_s`,
            so typical runaway sympy calls end without the cost of restarting a child.
        memory_limit_mb: address-space limit of each child (0 for none).
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        use_last_number: bool = True,
        interrupt_in_worker: bool = True,
        memory_limit_mb: int = 4096,
        startup_timeout_s: float = 60.0,
    ):
        if num_workers < 1:
            raise ValueError(f"MathVerifier(num_workers={num_workers}) must be at least 1")
        if timeout_s <= 0:
            raise ValueError(f"MathVerifier(timeout_s={timeout_s}) must be positive")
        self.timeout_s = timeout_s
        self.use_last_number = use_last_number
        self._soft_timeout_s = 0.8 * timeout_s if interrupt_in_worker else None
        self._idle_workers: queue.Queue[_WorkerProcess] = queue.Queue()
        self._workers = [
            _WorkerProcess(memory_limit_mb, startup_timeout_s) for _ in range(num_workers)
        ]
        self._dispatch_pool = ThreadPoolExecutor(num_workers, thread_name_prefix="math-verify")
        # Start children in parallel so construction costs one interpreter start, not N.
        list(self._dispatch_pool.map(lambda worker: worker.start(), self._workers))
        for worker in self._workers:
            self._idle_workers.put(worker)
        self.num_timeouts = 0
        self._closed = False

    def worker_pids(self) -> list[int | None]:
        """Process ids of the children (None for one killed and not yet restarted)."""
        return [worker.pid for worker in self._workers]

    def score(self, completions: list[str], references: list[list[str]]) -> list[float]:
        """1.0 for each completion whose answer matches any of its references, else 0.0."""
        if self._closed:
            raise RuntimeError("MathVerifier.score() called after close()")
        if len(completions) != len(references):
            raise ValueError(
                f"MathVerifier.score got {len(completions)} completions but "
                f"{len(references)} reference lists; pass one list of references per completion"
            )
        answers = [extract_answer(text, self.use_last_number) for text in completions]
        futures = [
            self._dispatch_pool.submit(self._score_one, answer, list(answer_references))
            for answer, answer_references in zip(answers, references)
        ]
        return [future.result() for future in futures]

    def _score_one(self, answer: str | None, references: list[str]) -> float:
        if answer is None or not references:
            return 0.0
        undecided = []
        for reference in references:
            verdict = fast_match(answer, reference)
            if verdict is True:
                return 1.0
            if verdict is None:
                undecided.append(reference)
        if not undecided:
            return 0.0
        message = {
            "prediction": as_math_verify_input(answer),
            "references": [as_math_verify_input(reference) for reference in undecided],
            "soft_timeout_s": self._soft_timeout_s,
        }
        worker = self._idle_workers.get()
        try:
            reply = worker.request(message, self.timeout_s)
        finally:
            self._idle_workers.put(worker)
        if reply is None or reply["status"] == "timeout":
            self.num_timeouts += 1
            logger.warning(
                "math-verify gave up after %.1f s on answer %.80r", self.timeout_s, answer
            )
            return 0.0
        return float(reply["score"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dispatch_pool.shutdown(wait=True)
        for worker in self._workers:
            worker.kill()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
