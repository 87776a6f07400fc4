"""User mistakes caught before any process starts, through the real CLI (issue 26 item 6).

Each mistake ends the CLI with exit 2 and one `error:` line naming the key or file, what is
wrong and the fix, with no traceback and no run directory (so no master or worker started);
`--dry-run` refuses exactly what a start refuses. These runs stop in the launcher, so they
take a few seconds each.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from e2e_helpers import describe, run_cli

TINY = ["total_train_steps=1", "dataset.batch_size=4", "gen.max_new_tokens=8"]


def _error_line(result) -> str:
    """The CLI's one error line; fails unless there is exactly one and no traceback."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, describe(result)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, describe(result)
    return lines[0]


def _write_dataset(path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def _prompt_line(prompt: str, answer: str) -> bytes:
    return json.dumps({"prompt": prompt, "answer": answer}).encode()


def _corrupt_copy(tiny_model, tmp_path):
    copy = tmp_path / "corrupt_model"
    shutil.copytree(tiny_model, copy)
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return copy


def _mistakes(tiny_model, tmp_path):
    """name -> (overrides, the texts the error line must hold)."""
    bad_utf8 = tmp_path / "latin1.jsonl"
    _write_dataset(bad_utf8, [_prompt_line("1+1=", "2"), b'{"prompt": "caf\xe9 2+2=", "answer": "4"}'])
    two_records = tmp_path / "two.jsonl"
    _write_dataset(two_records, [_prompt_line("1+1=", "2"), _prompt_line("2+2=", "4")])
    corrupt = _corrupt_copy(tiny_model, tmp_path)
    too_many = len(os.sched_getaffinity(0)) + 1
    return {
        "missing_model": ([f"actor.path={tmp_path / 'no_such_model'}"],
                          ["`actor.path=", "no_such_model does not exist", "set actor.path to"]),
        "corrupt_safetensors": ([f"actor.path={corrupt}"],
                                ["`actor.path=", f"{corrupt}/model.safetensors",
                                 "truncated or damaged"]),
        "non_utf8_dataset": ([f"actor.path={tiny_model}", f"dataset.path={bad_utf8}"],
                             [f"{bad_utf8}:2: not UTF-8: byte 0xe9", "byte offset",
                              "save the file as UTF-8"]),
        "batch_larger_than_dataset": (
            [f"actor.path={tiny_model}", f"dataset.path={two_records}"],
            ["`dataset.batch_size=4`", "the 2 records of", "set dataset.batch_size to at most 2"]),
        "batch_larger_than_the_builtin_eval_split": (
            [f"actor.path={tiny_model}", "dataset.builtin_split=eval", "dataset.batch_size=300",
             "dataset.builtin_train_size=1000"],  # the eval split holds 256 all the same
            ["`dataset.batch_size=300`", "the 256 records of the built-in eval split",
             "set dataset.batch_size to at most 256"]),
        "resume_without_checkpoint": (
            [f"actor.path={tiny_model}", "recover_mode=resume"],
            ["`recover_mode=resume`", str(tmp_path / "runs" / "ppo-math" / "trial0"),
             "set recover_mode=auto"]),
        "more_cpu_workers_than_cores": (
            [f"actor.path={tiny_model}", f"n_devices_per_node={too_many}"],
            [f"`n_devices_per_node={too_many}`", "CPU model workers",
             "allow_oversubscribe=true"]),
        "new_tokens_past_the_context": (
            [f"actor.path={tiny_model}", "gen.max_new_tokens=300"],
            ["`gen.max_new_tokens=300`", "256 positions", "max_position_embeddings",
             "set gen.max_new_tokens to at most 255"]),
        "prompt_limit_plus_new_tokens_past_the_context": (
            [f"actor.path={tiny_model}", "dataset.max_prompt_len=250"],
            ["`dataset.max_prompt_len=250`", "`gen.max_new_tokens=8`", "256 positions",
             "lower dataset.max_prompt_len to 248"]),
    }


MISTAKES = ["missing_model", "corrupt_safetensors", "non_utf8_dataset",
            "batch_larger_than_dataset", "batch_larger_than_the_builtin_eval_split",
            "resume_without_checkpoint",
            "more_cpu_workers_than_cores", "new_tokens_past_the_context",
            "prompt_limit_plus_new_tokens_past_the_context"]


@pytest.mark.parametrize("dry_run", [False, True], ids=["start", "dry_run"])
@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_is_one_line_and_exit_2_before_any_process_starts(
    mistake, dry_run, tiny_model, cli_env, tmp_path
):
    overrides, expected = _mistakes(tiny_model, tmp_path)[mistake]
    env = cli_env | {"CUDA_VISIBLE_DEVICES": ""}  # CPU workers, also on a GPU machine
    result = run_cli("ppo-math", [*TINY, *overrides, f"output_root={tmp_path / 'runs'}",
                                  *(["--dry-run"] if dry_run else [])], env)
    assert result.returncode == 2, describe(result)
    line = _error_line(result)
    missing = [text for text in expected if text not in line]
    assert not missing, f"{missing} not in {line!r}"
    assert not (tmp_path / "runs").exists(), "nothing may be prepared or started"


def test_oversubscribing_is_allowed_when_asked_for(tiny_model, cli_env, tmp_path):
    too_many = len(os.sched_getaffinity(0)) + 1
    result = run_cli("ppo-math", [*TINY, f"actor.path={tiny_model}", "--dry-run",
                                  f"n_devices_per_node={too_many}", "allow_oversubscribe=true",
                                  f"output_root={tmp_path / 'runs'}"],
                     cli_env | {"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, describe(result)
    assert f"# workers ({too_many} model workers + 1 master)" in result.stdout


def test_a_null_prompt_limit_is_the_context_minus_the_new_tokens(tiny_model, cli_env, tmp_path):
    result = run_cli("ppo-math", [*TINY, f"actor.path={tiny_model}", "--dry-run",
                                  "gen.max_new_tokens=56", f"output_root={tmp_path / 'runs'}"],
                     cli_env)
    assert result.returncode == 0, describe(result)
    assert "max_prompt_len: 200\n" in result.stdout  # 256 positions - 56 new tokens
