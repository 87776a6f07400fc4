"""A built-in synthetic task: short arithmetic problems such as ``"12+345="`` -> ``"357"``.

It needs no download, its rewards are exact, and a model of a few hundred thousand
parameters learns it on a CPU, which makes it the task of the quickstart and the end-to-end
tests. Prompts use only digits and ``+ - * =``, so any tokenizer covers them.

Every function is deterministic for a seed; problems within one call are distinct, and
``make_arithmetic_splits`` draws train and eval from one pool so they never share a prompt.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from realrl.datasets.jsonl import write_jsonl

__all__ = [
    "as_paired_records",
    "as_sft_records",
    "make_arithmetic_records",
    "make_arithmetic_splits",
    "write_arithmetic_files",
    "write_jsonl",
]

_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _operand_range(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _num_distinct_problems(min_digits: int, max_digits: int, num_ops: int) -> int:
    low, high = _operand_range(min_digits)[0], _operand_range(max_digits)[1]
    return (high - low + 1) ** 2 * num_ops


def make_arithmetic_records(
    n: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: tuple[str, ...] = ("+", "-"),
    id_prefix: str = "arith",
) -> list[dict[str, Any]]:
    """``n`` distinct RL prompt records ``{"query_id", "prompt": "12+345=", "answer": "357",
    "task": "math"}``; each operand has a uniformly drawn digit count in the range."""
    unknown = [op for op in ops if op not in _OPERATIONS]
    if unknown or not ops:
        raise ValueError(f"unsupported ops {unknown or ops}; choose from {list(_OPERATIONS)}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    capacity = _num_distinct_problems(min_digits, max_digits, len(ops))
    if n > capacity:
        raise ValueError(
            f"cannot draw {n} distinct problems: only {capacity} exist with {min_digits}-"
            f"{max_digits} digits and ops {list(ops)}; allow more digits or ops"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    records = []
    while len(records) < n:
        left = rng.randint(*_operand_range(rng.randint(min_digits, max_digits)))
        right = rng.randint(*_operand_range(rng.randint(min_digits, max_digits)))
        op = rng.choice(ops)
        prompt = f"{left}{op}{right}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = str(_OPERATIONS[op](left, right))
        records.append(
            {
                "query_id": f"{id_prefix}-{len(records)}",
                "prompt": prompt,
                "answer": answer,
                "task": "math",
            }
        )
    return records


def make_arithmetic_splits(
    n_train: int, n_eval: int, seed: int, **options: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and eval records (ids ``train-i`` / ``eval-i``) from one seeded pool."""
    pool = make_arithmetic_records(n_train + n_eval, seed, **options)
    train = [{**r, "query_id": f"train-{i}"} for i, r in enumerate(pool[:n_train])]
    evaluation = [{**r, "query_id": f"eval-{i}"} for i, r in enumerate(pool[n_train:])]
    return train, evaluation


def as_sft_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SFT form: the completion is the bare answer (the tokenizer's EOS is added at load)."""
    return [
        {"query_id": r["query_id"], "prompt": r["prompt"], "answer": r["answer"]} for r in records
    ]


def _wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible mistake: off by a small amount, or off by ten (a carry error)."""
    delta = rng.choice([-10, -2, -1, 1, 2, 10])
    return str(int(answer) + delta)


def as_paired_records(
    records: list[dict[str, Any]], seed: int, num_pairs: int = 1
) -> list[dict[str, Any]]:
    """Paired form for reward modelling / DPO: ``pos_answers`` right, ``neg_answers`` wrong."""
    if num_pairs < 1:
        raise ValueError(f"num_pairs must be >= 1, got {num_pairs}")
    rng = random.Random(seed)
    return [
        {
            "query_id": r["query_id"],
            "prompt": r["prompt"],
            "pos_answers": [r["answer"]] * num_pairs,
            "neg_answers": [_wrong_answer(r["answer"], rng) for _ in range(num_pairs)],
        }
        for r in records
    ]


def write_arithmetic_files(
    directory: str | Path, n_train: int, n_eval: int, seed: int, **options: Any
) -> dict[str, Path]:
    """Write ``{rl,sft,paired}_{train,eval}.jsonl`` into ``directory``; returns name -> path."""
    directory = Path(directory)
    train, evaluation = make_arithmetic_splits(n_train, n_eval, seed, **options)
    paths = {}
    for split, records in (("train", train), ("eval", evaluation)):
        forms = {
            "rl": records,
            "sft": as_sft_records(records),
            "paired": as_paired_records(records, seed),
        }
        for form, form_records in forms.items():
            paths[f"{form}_{split}"] = write_jsonl(
                form_records, directory / f"{form}_{split}.jsonl"
            )
    return paths
