import json
import re

import pytest

from realrl.datasets.jsonl import DatasetError, read_jsonl, write_jsonl
from realrl.datasets.records import load_paired_records, load_prompt_records, load_sft_records


def write_lines(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def expect_problem(loader, path, line, problem):
    """The error names the file and 1-based line, and the problem on that same line."""
    pattern = re.escape(f"{path}:{line}: ") + "[^\n]*" + re.escape(problem)
    with pytest.raises(DatasetError, match=pattern):
        loader(path)


def test_read_jsonl_skips_blank_lines_and_records_line_numbers(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "a"}', "", "   ", '{"prompt": "b", "extra": 1}'])
    records = read_jsonl(path, {"prompt": str})
    assert [(r["prompt"], r["_line"]) for r in records] == [("a", 1), ("b", 4)]
    assert records[1]["extra"] == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "a"', "bad JSON (Expecting ',' delimiter at column 15)"),
        ('["prompt"]', "expected a JSON object, got list"),
        ('{"question": "a"}', "missing required key 'prompt'"),
        ('{"prompt": 3}', "key 'prompt' must be str, got int"),
        ('{"prompt": "  "}', "key 'prompt' is empty"),
    ],
)
def test_read_jsonl_names_file_line_and_problem(tmp_path, line, problem):
    path = write_lines(tmp_path, ['{"prompt": "fine"}', line])
    expect_problem(lambda p: read_jsonl(p, {"prompt": str}), path, 2, problem)


def test_read_jsonl_does_not_accept_booleans_as_integers(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "a", "n": true}'])
    expect_problem(
        lambda p: read_jsonl(p, {"prompt": str, "n": int}), path, 1, "key 'n' must be int"
    )


def test_read_jsonl_collects_several_problems_then_stops(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": 1}'] * 25)
    with pytest.raises(DatasetError) as caught:
        read_jsonl(path, {"prompt": str}, max_problems=10)
    message = str(caught.value)
    assert f"{path}:1: key 'prompt' must be str" in message
    assert f"{path}:10: key 'prompt' must be str" in message
    assert f"{path}:11:" not in message
    assert "stopped after 10 problems" in message


def test_read_jsonl_rejects_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl", {"prompt": str})
    with pytest.raises(DatasetError, match="holds no records"):
        read_jsonl(write_lines(tmp_path, [""]), {"prompt": str})


def test_write_jsonl_round_trips_unicode_without_internal_fields(tmp_path):
    path = write_jsonl([{"prompt": "π≈3", "_line": 4}], tmp_path / "sub" / "out.jsonl")
    assert json.loads(path.read_text(encoding="utf-8")) == {"prompt": "π≈3"}


def test_prompt_loader_fills_defaults_and_keeps_given_ids(tmp_path):
    path = write_lines(
        tmp_path,
        [
            '{"prompt": "1+1=", "answer": "2"}',
            '{"prompt": "p", "solutions": ["x"], "query_id": "q7"}',
            '{"prompt": "f", "task": "code", "input_output": "{\\"inputs\\": [\\"1\\"], '
            '\\"outputs\\": [\\"2\\"]}"}',
        ],
        name="train.jsonl",
    )
    records = load_prompt_records(path)
    assert [r["query_id"] for r in records] == ["train-1", "q7", "train-3"]
    assert [r["task"] for r in records] == ["math", "math", "code"]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "p"}', "a math record needs 'answer' (str) or non-empty 'solutions'"),
        ('{"prompt": "p", "task": "poetry", "answer": "a"}', "key 'task' must be one of"),
        ('{"prompt": "p", "solutions": [1]}', "key 'solutions' must be a list of strings"),
        ('{"prompt": "p", "task": "code"}', "a code record needs 'input_output'"),
        (
            '{"prompt": "p", "task": "code", "input_output": "{"}',
            "'input_output' is not valid JSON",
        ),
        (
            '{"prompt": "p", "task": "code", "input_output": "{\\"inputs\\": [1]}"}',
            "must hold 'inputs' and 'outputs' lists",
        ),
        (
            '{"prompt": "p", "task": "code", "input_output": '
            '"{\\"inputs\\": [1], \\"outputs\\": []}"}',
            "'input_output' has 1 inputs but 0 outputs",
        ),
        ('{"prompt": "p", "answer": 4}', "key 'answer' must be str, got int"),
    ],
)
def test_prompt_loader_reports_task_problems_by_line(tmp_path, line, problem):
    path = write_lines(tmp_path, ['{"prompt": "ok", "answer": "1"}', line])
    expect_problem(load_prompt_records, path, 2, problem)


def test_prompt_loader_rejects_duplicate_query_ids_naming_both_lines(tmp_path):
    path = write_lines(
        tmp_path,
        ['{"prompt": "a", "answer": "1", "query_id": "q"}'] * 2,
    )
    expect_problem(load_prompt_records, path, 2, "query_id 'q' already used on line 1")


def test_sft_loader_requires_a_non_empty_answer(tmp_path):
    path = write_lines(
        tmp_path, ['{"prompt": "a", "answer": "b"}', '{"prompt": "a", "answer": ""}']
    )
    expect_problem(load_sft_records, path, 2, "key 'answer' is empty")
    path = write_lines(tmp_path, ['{"prompt": "a"}'], name="sft.jsonl")
    expect_problem(load_sft_records, path, 1, "missing required key 'answer'")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "p", "pos_answers": ["a"], "neg_answers": []}', "must have the same non-zero"),
        ('{"prompt": "p", "pos_answers": [], "neg_answers": []}', "must have the same non-zero"),
        ('{"prompt": "p", "pos_answers": ["a"], "neg_answers": [2]}', "must be lists of strings"),
        ('{"prompt": "p", "pos_answers": "a", "neg_answers": ["b"]}', "'pos_answers' must be list"),
    ],
)
def test_paired_loader_reports_unmatched_answers_by_line(tmp_path, line, problem):
    path = write_lines(tmp_path, [line])
    expect_problem(load_paired_records, path, 1, problem)
    good = write_lines(tmp_path, ['{"prompt": "p", "pos_answers": ["a"], "neg_answers": ["b"]}'])
    assert load_paired_records(good)[0]["neg_answers"] == ["b"]
