"""Kill -9 a run while it writes a checkpoint, resume it, and check that nothing was lost.

Shared by tests/e2e/test_preemption_cli.py (a few kills) and
benchmarks/bench_checkpoint_crash.py (`--trials 20`). One chain of `kills` trials on one run
directory, against a reference run of the same settings that was never interrupted and kept
every checkpoint:

1. a launch (`recover_mode=auto` for the first, `resume` after) with `save_freq_steps=1` and
   `checkpoint.keep_last=2`; the chain picks one of the next two checkpoints it will write;
2. when that checkpoint's `.tmp` directory appears, it waits a random time, uniform over 1.25
   times a checkpoint save of the reference run (so the kill lands while workers write,
   while the master writes `master.json`, around the rename, while an old checkpoint is
   pruned, or just after), then SIGKILLs the process groups of the launcher, the master and
   every worker at once;
3. the newest complete checkpoint left must be the one being written (if it was renamed) or the
   one before, hold the reference run's weights and `master.json` for its step bit for bit,
   and the next launch must say it resumed from it;
4. after the last kill a launch runs to the end: its final weights and every step's metrics
   must equal the reference run's.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from e2e_helpers import (
    checkpoint_weights,
    differing_tensors,
    kill_leftovers,
    processes_mentioning,
    read_metrics,
    start_cli,
    wait_until,
    without_timing,
)

from realrl.workers.recovery import complete_checkpoints

ROLES = ("actor", "critic", "ref")
KILL_WINDOW_SAVES = 1.25  # the kill lands within this many checkpoint-save durations
CHAIN = ["save_freq_steps=1", "checkpoint.keep_last=2"]
_SAVED = re.compile(r"saved checkpoint \S+ \([\d.]+ MB in ([\d.]+) s\)")
_RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


@dataclass
class KillOutcome:
    target_step: int  # the step whose checkpoint was being written
    delay_s: float  # from its `.tmp` directory appearing to the SIGKILL
    landed: str  # "writing" (no rename yet), "pruning" (renamed, old one not yet gone), "after"
    newest_step: int  # the newest complete checkpoint left


def save_seconds(run_dir: Path) -> float:
    """The median time a checkpoint save took in the run's master log."""
    log = (run_dir / "logs" / "master.log").read_text()
    return statistics.median(float(seconds) for seconds in _SAVED.findall(log))


def complete_steps(run_dir: Path) -> list[int]:
    return [int(path.name[len("step"):]) for path in complete_checkpoints(run_dir)]


def kill_whole_run(launcher: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILL the launcher's and every child's process group (each child leads its own)."""
    for pid in [launcher.pid, *pids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    launcher.wait()


def check_checkpoint(run_dir: Path, reference_dir: Path, step: int) -> None:
    """The run's checkpoint after `step` steps equals the reference run's, bit for bit."""
    for role in ROLES:
        differing = differing_tensors(checkpoint_weights(reference_dir, step, role),
                                      checkpoint_weights(run_dir, step, role))
        assert not differing, f"step {step} {role}: tensors {differing[:3]} differ"
    name = f"step{step:06d}"
    expected = json.loads((reference_dir / "checkpoints" / name / "master.json").read_text())
    actual = json.loads((run_dir / "checkpoints" / name / "master.json").read_text())
    assert actual == expected, f"step {step}: master.json {actual} != {expected}"


def _kill_during_save(launcher, run_dir: Path, target: int, window_s: float,
                      rng: random.Random) -> float:
    """Wait for checkpoint `target` to start, then SIGKILL the run within `window_s`."""
    staging = run_dir / "checkpoints" / f"step{target:06d}.tmp"
    wait_until(lambda: len(processes_mentioning(str(run_dir))) >= 3, 300, "the run's processes",
               launcher)
    pids = list(processes_mentioning(str(run_dir)))
    deadline = time.monotonic() + 300
    while not staging.is_dir():
        assert launcher.poll() is None, f"the run exited ({launcher.returncode}) before {staging}"
        assert time.monotonic() < deadline, f"timed out waiting for {staging}"
        time.sleep(0.002)
    seen = time.monotonic()
    delay_s = rng.uniform(0.0, window_s)
    time.sleep(max(0.0, seen + delay_s - time.monotonic()))
    kill_whole_run(launcher, pids)
    return time.monotonic() - seen


def _landed(run_dir: Path, target: int) -> str:
    steps = complete_steps(run_dir)
    if target not in steps:
        return "writing"
    half_pruned = list((run_dir / "checkpoints").glob("*.deleting"))
    return "pruning" if half_pruned or len(steps) > 2 else "after"


def _resumed_step(log: Path, offset: int) -> int | None:
    """The step a launch whose log lines start at `offset` resumed at, once it says so."""
    found = _RESUMED.findall(log.read_text()[offset:])
    return int(found[0][1]) if found else None


def crash_chain(kills: int, settings: list[str], reference_dir: Path, output_root: Path,
                env: dict[str, str], rng: random.Random,
                report: Callable[[str], None] = lambda line: None) -> list[KillOutcome]:
    """Run the chain described in the module docstring; returns one outcome per kill."""
    run_dir = output_root / "ppo-math" / "trial0"
    total_steps = len(read_metrics(reference_dir))
    assert total_steps >= 2 * kills + 2, "each kill may take the run two checkpoints further"
    window_s = KILL_WINDOW_SAVES * save_seconds(reference_dir)
    common = [*settings, *CHAIN, f"output_root={output_root}"]
    outcomes: list[KillOutcome] = []
    newest, log = 0, run_dir / "logs" / "master.log"
    try:
        for trial in range(kills + 1):
            log_offset = log.stat().st_size if log.is_file() else 0
            recover = "recover_mode=auto" if trial == 0 else "recover_mode=resume"
            launcher = start_cli("ppo-math", [*common, recover], env,
                                 output_root / "launches" / str(trial))
            if trial > 0:  # it must resume from the newest complete checkpoint, and only then
                # watch for a `.tmp`: the one the last kill left is removed before the resume
                wait_until(lambda offset=log_offset: _resumed_step(log, offset) is not None, 300,
                           f"launch {trial} to resume", launcher)
                resumed = _resumed_step(log, log_offset)
                assert resumed == newest, f"launch {trial} resumed at {resumed}, not {newest}"
            if trial == kills:  # the last launch runs to the end
                stderr = output_root / "launches" / str(trial) / "stderr.txt"
                assert launcher.wait(timeout=600) == 0, stderr.read_text()[-4000:]
                break
            target = min(newest + rng.choice((1, 2)), total_steps - 1)
            delay_s = _kill_during_save(launcher, run_dir, target, window_s, rng)
            landed, newest = _landed(run_dir, target), complete_steps(run_dir)[-1]
            assert newest in (target - 1, target), (
                f"kill {trial + 1} at step {target}: newest complete checkpoint is {newest}")
            check_checkpoint(run_dir, reference_dir, newest)
            outcomes.append(KillOutcome(target, delay_s, landed, newest))
            report(f"kill {trial + 1}: {delay_s * 1000:.0f} ms into checkpoint {target} "
                   f"({landed}); newest complete: step {newest}, equal to the reference")
    finally:
        kill_leftovers(str(run_dir))
    check_checkpoint(run_dir, reference_dir, total_steps)
    expected = [without_timing(record) for record in read_metrics(reference_dir)]
    assert [without_timing(record) for record in read_metrics(run_dir)] == expected
    return outcomes
