"""Graceful preemption and checkpoints that survive crashes, through the real CLI (issue 26).

The ppo-math runs here have the recoverable settings (`RECOVERABLE_PPO`: weights, optimizer and
LR schedule, sampling RNG, data position, adaptive KL coefficient, value normaliser and EMA
reference all in play), each compared with one uninterrupted reference run of them:

- the launcher alone SIGKILLed after a checkpoint: its children exit on their own, and
  `recover_mode=auto` ends the run with exactly the reference's weights and metrics;
- SIGTERM to the launcher mid-run: the master finishes its step and writes a checkpoint, the run
  exits with 75 and prints the exact command that resumes it, no process is left, and that
  command ends the run with exactly the weights and metrics of a run never interrupted.
- kill -9 of the whole run at random moments while it writes checkpoints (`crash_trials`; 1
  kill here, `benchmarks/bench_checkpoint_crash.py --trials 20` for the full count): resuming
  always finds the newest complete checkpoint and goes on bit-exact.
- a disk that fills up during a save: one line naming the checkpoint, the reason and the fix,
  no traceback, the previous checkpoint intact and the partial `.tmp` removed.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess

import pytest
import torch
from crash_trials import check_checkpoint, complete_steps, crash_chain
from e2e_helpers import (
    RECOVERABLE_PPO,
    checkpoint_weights,
    cli_command,
    describe,
    differing_tensors,
    kill_leftovers,
    processes_mentioning,
    read_metrics,
    run_cli,
    start_cli,
    wait_until,
    without_timing,
)

from realrl.launcher.checkpoint_files import safetensors_problem
from realrl.workers.preemption import PREEMPTED_EXIT_CODE

TOTAL_STEPS = 8
CRASH_KILLS = 1  # the suite's time budget; the benchmark makes the 20


@pytest.fixture(scope="module")
def settings(tiny_model) -> list[str]:
    return [f"actor.path={tiny_model}", *RECOVERABLE_PPO, f"total_train_steps={TOTAL_STEPS}"]


@pytest.fixture(scope="module")
def reference(settings, cli_env, tmp_path_factory):
    """A run never interrupted that keeps a checkpoint of every step."""
    output_root = tmp_path_factory.mktemp("reference")
    result = run_cli("ppo-math", [*settings, "save_freq_steps=1", "checkpoint.keep_last=0",
                                  f"output_root={output_root}"], cli_env)
    assert result.returncode == 0, describe(result)
    return output_root / "ppo-math" / "trial0"


@pytest.mark.slow
def test_a_killed_launcher_takes_its_children_and_the_run_resumes_bit_exact(
    settings, reference, cli_env, tmp_path
):
    run_dir = tmp_path / "ppo-math" / "trial0"
    resumable = [*settings, "save_freq_steps=1", f"output_root={tmp_path}", "recover_mode=auto"]
    launcher = start_cli("ppo-math", resumable, cli_env, tmp_path / "first_attempt")
    try:
        wait_until((run_dir / "checkpoints" / "step000002").is_dir, 300,
                   "the step-2 checkpoint", launcher)
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher only: each child leads its own
        launcher.wait()  # process group, and must notice its parent's death and exit
        assert complete_steps(run_dir)[-1] < TOTAL_STEPS, "the run finished before the kill"
        wait_until(lambda: not processes_mentioning(str(run_dir)), 10,
                   "the killed launcher's children to exit")
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(str(run_dir))

    resumed = run_cli("ppo-math", resumable, cli_env)
    assert resumed.returncode == 0, describe(resumed)
    assert "resumed from" in (run_dir / "logs" / "master.log").read_text()
    check_checkpoint(run_dir, reference, TOTAL_STEPS)
    assert [without_timing(record) for record in read_metrics(run_dir)] == [
        without_timing(record) for record in read_metrics(reference)]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_the_printed_command_resumes_bit_exact(
    settings, reference, cli_env, tmp_path
):
    run_dir = tmp_path / "ppo-math" / "trial0"
    overrides = [*settings, f"output_root={tmp_path}"]  # save_freq_steps=0: only the last step
    launcher = start_cli("ppo-math", overrides, cli_env, tmp_path / "launcher")
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").is_file(), 300, "the first step", launcher)
        launcher.send_signal(signal.SIGTERM)
        returncode = launcher.wait(timeout=120)
        leftovers = processes_mentioning(str(run_dir))
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(str(run_dir))

    stderr = (tmp_path / "launcher" / "stderr.txt").read_text()
    assert returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert leftovers == {}, f"processes left behind: {leftovers}"
    (step,) = complete_steps(run_dir)
    assert 1 <= step < TOTAL_STEPS, "the run finished before the signal could stop it"
    assert [record["step"] for record in read_metrics(run_dir)] == list(range(1, step + 1))
    checkpoint = run_dir / "checkpoints" / f"step{step:06d}"
    assert f"the run stopped at SIGTERM with checkpoint {checkpoint} (exit code 75)" in stderr
    check_checkpoint(run_dir, reference, step)

    resume_line = stderr.strip().splitlines()[-1]
    assert resume_line.startswith("resume with: "), stderr[-3000:]
    command = shlex.split(resume_line.removeprefix("resume with: "))
    assert command == [*cli_command("ppo-math", overrides), "recover_mode=auto"]
    resumed = subprocess.run(command, env=cli_env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, describe(resumed)
    assert f"resumed from {checkpoint} at step {step}" in (run_dir / "logs" / "master.log").read_text()
    for role in ("actor", "critic", "ref"):
        differing = differing_tensors(checkpoint_weights(reference, TOTAL_STEPS, role),
                                      checkpoint_weights(run_dir, TOTAL_STEPS, role))
        assert not differing, f"{role}: tensors {differing[:3]} differ"
    assert [without_timing(record) for record in read_metrics(run_dir)] == [
        without_timing(record) for record in read_metrics(reference)]


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_always_resumes_bit_exact(
    settings, reference, cli_env, tmp_path
):
    outcomes = crash_chain(CRASH_KILLS, settings, reference, tmp_path, cli_env, random.Random(0))
    assert len(outcomes) == CRASH_KILLS


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of `size` bytes mounted on a folder (needs root); unmounted afterwards."""
    mounted = []

    def mount(directory, size: int):
        directory.mkdir(parents=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                 str(directory)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {result.stderr.strip()}")
        mounted.append(directory)

    yield mount
    for directory in mounted:
        subprocess.run(["umount", "--lazy", str(directory)], check=False)


def test_a_full_disk_during_a_save_names_the_path_and_keeps_the_previous_checkpoint(
    tiny_model, cli_env, tmp_path, small_disk
):
    """An SFT checkpoint holds the weights and AdamW's two moments, about 3 times the weight
    file: a disk of 4.5 times it takes the first checkpoint and fills up during the second."""
    run_dir = tmp_path / "sft" / "trial0"
    checkpoints = run_dir / "checkpoints"
    small_disk(checkpoints, int(4.5 * (tiny_model / "model.safetensors").stat().st_size))
    result = run_cli("sft", [f"model.path={tiny_model}", f"output_root={tmp_path}",
                             "n_devices_per_node=1", "dataset.batch_size=4",
                             "total_train_steps=3", "save_freq_steps=1", "recover_mode=auto"],
                     cli_env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, describe(result)
    assert (f"cannot write checkpoint {checkpoints / 'step000002'}: worker 0: no space left on "
            f"the device of {checkpoints / 'step000002.tmp'}") in result.stderr, describe(result)
    assert (f"the previous checkpoint {checkpoints / 'step000001'} is intact and the partial "
            "step000002.tmp was removed. To go on: free space there") in result.stderr
    assert "Traceback" not in output and "inline_container" not in output, describe(result)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step000001"]
    assert (checkpoints / "latest").resolve() == (checkpoints / "step000001").resolve()
    assert safetensors_problem(checkpoints / "step000001" / "default" / "model.safetensors") is None
    optimizer = torch.load(checkpoints / "step000001" / "default" / "optimizer.pt",
                           weights_only=False)
    assert optimizer  # the AdamW state loads
