"""Helpers of the end-to-end tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Keys every e2e run shares: no wandb, no tensorboard files, tiny batches and responses.
QUIET_RUN = ["wandb.mode=disabled", "tensorboard=false"]
RUN_TIMEOUT_S = 300
# A ppo-math run in which every piece of state that changes during a run is in play: a critic
# with value normalisation, an adaptive KL controller, an EMA reference model, sampling on a
# different layout than training. Lending idle cores changes thread counts with timing, and
# with them the rounding of some float sums, so bit-identical runs keep the even split.
# Add `total_train_steps` (and `actor.path`, `output_root`).
RECOVERABLE_PPO = [
    "n_devices_per_node=2",
    "share_idle_cores=false",
    "allocation_mode=actor_gen:d2,actor_train:d1@0,*:d2",
    "dataset.batch_size=4",
    "group_size=2",
    "gen.max_new_tokens=8",
    "seed=7",
    "actor.optimizer.lr=1e-3",
    "critic.optimizer.lr=1e-3",
    "actor.optimizer.lr_scheduler=cosine",
    "ppo.adaptive_kl_target=0.01",
    "ppo.adaptive_kl_horizon=100",
    "ppo.value_norm=true",
    "ref_ema_eta=0.5",
]
# Metrics that depend on wall-clock time, or on the process's memory (a resumed process has
# run fewer steps), differ between any two runs.
TIMING_PREFIXES = ("timing/", "perf/", "actor_gen/generated_tokens_per_s")
MEMORY_SUFFIX = "peak_memory_gb"


def cli_command(experiment: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "realrl.apps.quickstart", experiment, *QUIET_RUN, *overrides]


def run_cli(
    experiment: str, overrides: list[str], env: dict[str, str], timeout_s: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Run the CLI to completion; stdout and stderr are captured as text."""
    return subprocess.run(
        cli_command(experiment, overrides),
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_cli(
    experiment: str, overrides: list[str], env: dict[str, str], output_dir: Path
) -> subprocess.Popen:
    """Start the CLI in its own session (so a test can signal its whole process group);
    stdout and stderr go to files in `output_dir`, so a full pipe can never block it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with (
        open(output_dir / "stdout.txt", "w") as stdout,
        open(output_dir / "stderr.txt", "w") as stderr,
    ):
        return subprocess.Popen(
            cli_command(experiment, overrides),
            env=env,
            cwd=REPO_ROOT,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )


def describe(result: subprocess.CompletedProcess) -> str:
    """The tail of a finished run's output, for assertion messages."""
    return (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n"
        f"{result.stderr[-4000:]}"
    )


def assert_traceback_only_in_logs(result: subprocess.CompletedProcess,
                                  log_files: list[Path]) -> None:
    """An error written for the user (`realrl.api.errors.UserFacingError`) reached the console
    as its message alone: no traceback in the CLI's output, one in each of `log_files`."""
    assert "Traceback" not in result.stdout + result.stderr, describe(result)
    for path in log_files:
        assert "Traceback (most recent call last)" in path.read_text(), f"none in {path}"


def wait_until(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    process: subprocess.Popen | None = None,
) -> None:
    """Poll `condition` every 0.1 s; fail after `timeout_s` or when `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run exited with {process.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def processes_mentioning(text: str) -> dict[int, str]:
    """pid -> command line of every live process whose command line contains `text`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        command = raw.replace(b"\0", b" ").decode(errors="replace")
        if text in command and state != "Z":  # a zombie holds nothing; its parent reaps it
            found[int(entry.name)] = command
    return found


def worker_pid(run_dir, rank: int) -> int | None:
    """The pid of model worker `rank` of the run in `run_dir`, read from /proc: forked from
    the fork server, it has that server's command line and its own name."""
    for pid in processes_mentioning(str(run_dir)):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"realrl-worker{rank}":
                return pid
    return None


def kill_leftovers(text: str) -> None:
    """Safety net after a failed test: SIGKILL what this test started (matched by run dir)."""
    for pid in processes_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_metrics(run_dir: Path, custom_mfcs: tuple[str, ...] = ()) -> list[dict]:
    """The run's `metrics.jsonl`, each of whose keys `docs/metrics.md` documents (besides the
    statistics of `custom_mfcs`, MFCs a test's own experiment defines)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = {key for record in records for key in record
            if not key.startswith(tuple(f"{mfc}/" for mfc in custom_mfcs))}
    undocumented = sorted(key for key in keys
                          if not any(pattern.fullmatch(key) for pattern in documented_metrics()))
    assert not undocumented, f"{path} logs metrics docs/metrics.md does not name: {undocumented}"
    return records


@functools.cache
def documented_metrics() -> list[re.Pattern]:
    """The keys named in the first column of the tables of `docs/metrics.md` (before its
    "Samples" section), as patterns: a `<placeholder>` stands for one name (an MFC's, a
    task's, ...)."""
    reference = (REPO_ROOT / "docs" / "metrics.md").read_text().split("\n## Samples", 1)[0]
    patterns = []
    for line in reference.splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", line[1:].split(" | ", 1)[0]):
            if "..." not in name:  # `rew_inf/...`: keys documented in their own rows
                pieces = re.split(r"<[^>]+>", name)
                patterns.append(re.compile("[^/]+".join(map(re.escape, pieces))))
    return patterns


def without_timing(record: dict) -> dict:
    """A metrics record without the values that differ between two identical runs."""
    return {key: value for key, value in record.items()
            if not key.startswith(TIMING_PREFIXES) and not key.endswith(MEMORY_SUFFIX)}


def checkpoint_weights(run_dir: Path, step: int, role: str) -> dict:
    """The weights of `role` in the run's checkpoint after `step` steps."""
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step{step:06d}" / role / "model.safetensors")


def differing_tensors(expected: dict, actual: dict) -> list[str]:
    """Names of the tensors that are not bit-identical (all of them if the names differ)."""
    import torch

    if expected.keys() != actual.keys():
        return sorted(set(expected) ^ set(actual))
    return [name for name in expected if not torch.equal(expected[name], actual[name])]
