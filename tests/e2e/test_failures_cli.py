"""How a run fails, through the real CLI: a worker killed mid-step, and malformed data.

A dead worker must stop the whole run within seconds, name the worker, show the end of its
log and leave no process behind; a malformed dataset line must be reported (file, line,
problem) before any process starts, without a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from e2e_helpers import (
    describe,
    kill_leftovers,
    processes_mentioning,
    read_metrics,
    run_cli,
    start_cli,
    wait_until,
    worker_pid,
)

STOP_DEADLINE_S = 10.0


@pytest.mark.parametrize(
    ("schedule", "killed_rank"),
    [
        pytest.param(["allocation_mode=actor_gen:d2,actor_train:d1@0,*:d2"], 1,
                     id="synchronous"),
        # Worker 1 trains while worker 0 generates the next rollout; the master has a rollout
        # in flight when the trainer dies.
        pytest.param(["pipeline_rollout=true"], 1, id="pipelined", marks=pytest.mark.slow),
        # Worker 0 streams rollout requests while worker 1 trains: the generator dies.
        pytest.param(["rollout.mode=async"], 0, id="async_generator", marks=pytest.mark.slow),
        # 4 workers: generation data-parallel on workers 0-1, both trainers on workers 2-3,
        # interruptible generation; the second generation rank dies (its peer and the
        # trainers must not be left waiting).
        pytest.param(["n_devices_per_node=4", "allow_oversubscribe=true",
                      "allocation_mode=actor_train:d2@2-3,critic_train:d2@2-3,*:d2@0-1",
                      "rollout.mode=async", "rollout.groups_per_request=2",
                      "rollout.decode_steps_per_chunk=1"], 1,
                     id="async_generator_of_two", marks=pytest.mark.slow),
    ],
)
def test_killing_a_worker_mid_step_stops_the_run_and_names_it(
    schedule, killed_rank, tiny_model, cli_env, tmp_path
):
    run_dir = tmp_path / "runs" / "ppo-math" / "trial0"
    launcher = start_cli(
        "ppo-math",
        [
            f"actor.path={tiny_model}",
            f"output_root={tmp_path / 'runs'}",
            "n_devices_per_node=2",
            *schedule,
            "dataset.batch_size=8",
            "gen.max_new_tokens=16",
            "total_train_steps=200",
        ],
        cli_env,
        tmp_path / "launcher",
    )
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").is_file(), 240, "the first step", launcher)
        pid = worker_pid(run_dir, killed_rank)
        assert pid is not None, processes_mentioning(str(run_dir))
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = launcher.wait(timeout=60)
        stopped_after_s = time.monotonic() - killed_at
        leftovers = processes_mentioning(str(run_dir))
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(str(run_dir))

    stderr = (tmp_path / "launcher" / "stderr.txt").read_text()
    assert returncode != 0
    assert stopped_after_s < STOP_DEADLINE_S, f"took {stopped_after_s:.1f} s to stop"
    assert len(read_metrics(run_dir)) < 200
    assert f"'worker{killed_rank}'" in stderr and "SIGKILL" in stderr, stderr
    log = (run_dir / "logs" / f"worker{killed_rank}.log").read_text()
    last_log_line = log.strip().splitlines()[-1]
    assert last_log_line in stderr
    assert leftovers == {}, f"processes left behind: {leftovers}"


MALFORMED = [
    pytest.param(
        '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n',
        2,
        "bad JSON",
        id="bad_json",
    ),
    pytest.param(
        '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "3+3="}\n',
        3,
        "missing required key 'answer'",
        id="missing_key",
    ),
]


@pytest.mark.parametrize(("content", "line", "problem"), MALFORMED)
def test_malformed_dataset_line_fails_before_training_with_file_and_line(
    content, line, problem, tiny_model, cli_env, tmp_path
):
    data = tmp_path / "user_sft.jsonl"
    data.write_text(content)
    result = run_cli(
        "sft",
        [f"model.path={tiny_model}", f"dataset.path={data}", f"output_root={tmp_path / 'runs'}"],
        cli_env,
    )
    assert result.returncode in (1, 2), describe(result)
    assert f"{data}:{line}: {problem}" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "runs").exists(), "nothing may start before the data is valid"


def test_prompt_dataset_without_an_answer_fails_before_training(tiny_model, cli_env, tmp_path):
    data = tmp_path / "user_math.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1=", "solutions": ["2"]})
        + "\n"
        + json.dumps({"prompt": "2+2="})
        + "\n"
    )
    result = run_cli(
        "ppo-math",
        [f"actor.path={tiny_model}", f"dataset.path={data}", f"output_root={tmp_path / 'runs'}"],
        cli_env,
    )
    assert result.returncode in (1, 2), describe(result)
    assert f"{data}:2:" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr + result.stdout
