"""The command that builds the default actor when neither the packaged nor a cached one exists.

It runs in a child process (the launcher imports no runner from here; see
`realrl.launcher.warm_start`), so only running it shows that it is a valid CLI command: with
`--dry-run` appended it passes every check a start makes and plans the run where
`ensure_warm_start` then looks for its checkpoint, without training for ~1,500 steps. The
packaged actor stands in for the fresh model the command starts from, which the test would
otherwise build first (importing torch and transformers).
"""

from __future__ import annotations

import os
import subprocess

from realrl.launcher.warm_start import (
    PACKAGED_ACTOR,
    WARM_START_VERSION,
    build_command,
    tool_build_command,
)


def test_the_warm_start_build_command_passes_the_checks_of_a_start(tmp_path):
    build_root = tmp_path / "cache" / "build"
    env = {**os.environ, "REALRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*build_command(build_root), f"model.path={PACKAGED_ACTOR}", "--dry-run"], env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "total_train_steps: 1500" in result.stdout, result.stdout[-2000:]
    # The run directory ensure_warm_start copies the trained model from.
    assert f"# run directory\n{build_root / 'default-actor' / WARM_START_VERSION}\n" in (
        result.stdout), result.stdout[-2000:]


def test_the_agent_warm_start_build_command_passes_the_checks_of_a_start(tmp_path):
    build_root = tmp_path / "cache" / "build"
    env = {**os.environ, "REALRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = tool_build_command(build_root, PACKAGED_ACTOR)
    result = subprocess.run([*command, "--dry-run"], env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "total_train_steps: 3000" in result.stdout, result.stdout[-2000:]
    transcripts = (build_root / "agent-sft-v1.jsonl").read_text().splitlines()
    assert len(transcripts) == 4096 and any("calc(" in line for line in transcripts)
