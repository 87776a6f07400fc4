"""Record schemas for the three dataset kinds, and loaders that return validated records.

RL prompts (PPO/GRPO, generation)::

    {"prompt": str, "answer"?: str, "solutions"?: [str], "task"?: "math" | "code",
     "input_output"?: str (JSON {"inputs": [...], "outputs": [...]}), "query_id"?: str}

``task`` defaults to ``"math"``; a math record needs ``answer`` or ``solutions``, a code
record needs ``input_output``. A missing ``query_id`` becomes ``"<file stem>-<line>"``;
query ids must be unique within a file.

SFT::  {"prompt": str, "answer": str}   (``answer`` is the completion the model learns)

Chat prompts (RLHF with a reward model, ppo-rlhf)::

    {"prompt": str} or {"messages": [{"role": "system" | "user" | "assistant", "content": str},
    ...]} (ending with a user turn), plus any of the RL prompt keys above, none required

Paired (reward modelling, DPO)::

    {"prompt": str, "pos_answers": [str], "neg_answers": [str]}   (same non-zero length)

``prompt`` is the text of the user's turn: with a chat template (`dataset.apply_chat_template`)
the datasets wrap it, so records never carry control tokens such as ``<|im_start|>``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from realrl.datasets.jsonl import DatasetError, iter_jsonl

logger = logging.getLogger(__name__)

TASKS = ("math", "code")

PROMPT_REQUIRED = {"prompt": str}
PROMPT_OPTIONAL = {
    "answer": str,
    "solutions": list,
    "task": str,
    "input_output": str,
    "query_id": (str, int),
}
CHAT_OPTIONAL = {"prompt": str, "messages": list, **PROMPT_OPTIONAL}
CHAT_ROLES = ("system", "user", "assistant")
SFT_REQUIRED = {"prompt": str, "answer": str}
PAIRED_REQUIRED = {"prompt": str, "pos_answers": list, "neg_answers": list}


def _is_string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def check_prompt_record(record: dict[str, Any]) -> list[str]:
    """Task-specific problems of an RL prompt record whose keys and types are already valid."""
    task = record.get("task") or "math"
    if task not in TASKS:
        return [f"key 'task' must be one of {list(TASKS)}, got {task!r}"]
    solutions = record.get("solutions")
    if solutions is not None and not _is_string_list(solutions):
        return ["key 'solutions' must be a list of strings"]
    if task == "math" and record.get("answer") is None and not solutions:
        return ["a math record needs 'answer' (str) or non-empty 'solutions' (list of str)"]
    if task == "code":
        return _check_input_output(record.get("input_output"))
    return []


def _check_input_output(text: str | None) -> list[str]:
    if text is None:
        return ["a code record needs 'input_output': a JSON string with 'inputs' and 'outputs'"]
    try:
        cases = json.loads(text)
    except json.JSONDecodeError as error:
        return [f"key 'input_output' is not valid JSON ({error.msg})"]
    if not isinstance(cases, dict):
        return ["key 'input_output' must encode an object with 'inputs' and 'outputs' lists"]
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        return ["key 'input_output' must hold 'inputs' and 'outputs' lists"]
    if len(inputs) != len(outputs):
        return [f"'input_output' has {len(inputs)} inputs but {len(outputs)} outputs"]
    return []


def check_chat_record(record: dict[str, Any]) -> list[str]:
    """Problems of a chat prompt record whose keys and types are already valid."""
    has_prompt, messages = record.get("prompt") is not None, record.get("messages")
    if has_prompt == (messages is not None):
        return ["a chat record needs exactly one of 'prompt' (str) and 'messages' (a list of "
                "{'role', 'content'})"]
    task = record.get("task")
    if task is not None and task not in TASKS:
        return [f"key 'task' must be one of {list(TASKS)}, got {task!r}"]
    if messages is None:
        return []
    for index, message in enumerate(messages):
        if (not isinstance(message, dict) or message.get("role") not in CHAT_ROLES
                or not isinstance(message.get("content"), str)):
            return [f"messages[{index}] must be {{'role': one of {list(CHAT_ROLES)}, 'content': "
                    f"str}}, got {message!r}"]
    if not messages or messages[-1]["role"] != "user":
        return ["'messages' must end with a user turn (the model writes the next, assistant turn)"]
    return []


def check_paired_record(record: dict[str, Any]) -> list[str]:
    positives, negatives = record["pos_answers"], record["neg_answers"]
    if not _is_string_list(positives) or not _is_string_list(negatives):
        return ["keys 'pos_answers' and 'neg_answers' must be lists of strings"]
    if not positives or len(positives) != len(negatives):
        return [
            f"'pos_answers' ({len(positives)}) and 'neg_answers' ({len(negatives)}) must have "
            "the same non-zero length: answers are compared pairwise"
        ]
    return []


def load_prompt_records(path: str | Path) -> list[dict[str, Any]]:
    """RL prompt records with ``task`` and ``query_id`` filled in (see module docstring)."""
    return list(iter_prompt_records(path))


def iter_prompt_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """`load_prompt_records` one record at a time (in constant memory but for the query ids);
    a `DatasetError` comes after the last record."""
    records = iter_jsonl(path, PROMPT_REQUIRED, PROMPT_OPTIONAL, check=check_prompt_record)
    for record in _with_query_ids(path, records):
        record["task"] = record.get("task") or "math"
        yield record


def load_chat_records(path: str | Path) -> list[dict[str, Any]]:
    """Chat prompt records with ``query_id`` filled in (see module docstring)."""
    return list(iter_chat_records(path))


def iter_chat_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """`load_chat_records` one record at a time, as `iter_prompt_records`."""
    return _with_query_ids(path, iter_jsonl(path, {}, CHAT_OPTIONAL, check=check_chat_record))


def _with_query_ids(path: str | Path, records: Iterator[dict[str, Any]]
                    ) -> Iterator[dict[str, Any]]:
    """`records` with a ``query_id`` each (``<file stem>-<line>`` where missing); a repeated
    id is a `DatasetError` after the last record."""
    path = Path(path)
    first_line_of: dict[str, int] = {}
    problems = []
    for record in records:
        given_id = record.get("query_id")
        query_id = str(given_id) if given_id is not None else f"{path.stem}-{record['_line']}"
        record["query_id"] = query_id
        if query_id in first_line_of:
            problems.append(
                f"{path}:{record['_line']}: query_id {query_id!r} already used on line "
                f"{first_line_of[query_id]}; query ids must be unique"
            )
        first_line_of.setdefault(query_id, record["_line"])
        yield record
    if problems:
        raise DatasetError(f"invalid dataset {path}:\n  " + "\n  ".join(problems[:10]))


def load_sft_records(path: str | Path) -> list[dict[str, Any]]:
    return list(iter_sft_records(path))


def iter_sft_records(path: str | Path) -> Iterator[dict[str, Any]]:
    return iter_jsonl(path, SFT_REQUIRED, non_empty=("prompt", "answer"))


def load_paired_records(path: str | Path) -> list[dict[str, Any]]:
    return list(iter_paired_records(path))


def iter_paired_records(path: str | Path) -> Iterator[dict[str, Any]]:
    return iter_jsonl(path, PAIRED_REQUIRED, check=check_paired_record)
