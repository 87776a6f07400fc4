import random
import re

import pytest

from realrl.datasets.arithmetic import (
    WRONG_ANSWER_KINDS,
    as_paired_records,
    as_sft_records,
    make_arithmetic_records,
    make_arithmetic_splits,
    write_arithmetic_files,
    wrong_answer,
)
from realrl.datasets.records import load_paired_records, load_prompt_records, load_sft_records


def solve(prompt: str) -> int:
    match = re.fullmatch(r"(\d+)([+\-*])(\d+)=", prompt)
    assert match is not None, prompt
    left, op, right = int(match.group(1)), match.group(2), int(match.group(3))
    return {"+": left + right, "-": left - right, "*": left * right}[op]


def test_records_are_deterministic_for_a_seed_and_differ_across_seeds():
    assert make_arithmetic_records(50, seed=3) == make_arithmetic_records(50, seed=3)
    assert make_arithmetic_records(50, seed=3) != make_arithmetic_records(50, seed=4)


def test_records_are_correct_distinct_short_and_in_a_plain_charset():
    records = make_arithmetic_records(300, seed=0, min_digits=1, max_digits=3, ops=("+", "-", "*"))
    assert len({r["prompt"] for r in records}) == 300
    assert len({r["query_id"] for r in records}) == 300
    for record in records:
        assert record["task"] == "math"
        assert re.fullmatch(r"[0-9+\-*=]+", record["prompt"])
        assert len(record["prompt"]) <= 3 + 1 + 3 + 1
        assert record["answer"] == str(solve(record["prompt"]))


def test_digit_limits_bound_the_operands():
    for record in make_arithmetic_records(100, seed=1, min_digits=2, max_digits=2, ops=("+",)):
        left, right = record["prompt"].rstrip("=").split("+")
        assert 10 <= int(left) <= 99 and 10 <= int(right) <= 99


def test_asking_for_more_problems_than_exist_is_an_error():
    # one-digit operands and "+": 10 * 10 = 100 distinct problems
    assert len(make_arithmetic_records(100, seed=0, max_digits=1, ops=("+",))) == 100
    with pytest.raises(ValueError, match="only 100 exist"):
        make_arithmetic_records(101, seed=0, max_digits=1, ops=("+",))
    with pytest.raises(ValueError, match="unsupported ops"):
        make_arithmetic_records(1, seed=0, ops=("/",))


def test_train_and_eval_splits_are_disjoint_and_deterministic():
    train, evaluation = make_arithmetic_splits(200, 50, seed=9)
    assert (len(train), len(evaluation)) == (200, 50)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    assert train[0]["query_id"] == "train-0" and evaluation[-1]["query_id"] == "eval-49"
    assert (train, evaluation) == make_arithmetic_splits(200, 50, seed=9)


def test_sft_and_paired_forms_keep_the_right_answer_and_a_wrong_one():
    records = make_arithmetic_records(40, seed=2)
    sft = as_sft_records(records)
    assert [(r["prompt"], r["answer"]) for r in sft] == [
        (r["prompt"], r["answer"]) for r in records
    ]
    paired = as_paired_records(records, seed=2, num_pairs=3)
    assert paired == as_paired_records(records, seed=2, num_pairs=3)
    for record, pair in zip(records, paired):
        assert pair["pos_answers"] == [record["answer"]] * 3
        assert len(pair["neg_answers"]) == 3
        for wrong in pair["neg_answers"]:
            assert re.fullmatch(r"-?\d+", wrong) and wrong != record["answer"]


def _is_rough_mistake(right: int, wrong: int) -> bool:
    """Caught by an estimate of the result: the sign, the number of digits or the tens."""
    return (
        (right < 0) != (wrong < 0)
        or len(str(abs(right))) != len(str(abs(wrong)))
        or abs(wrong - right) >= 20
    )


def _built_in_pairs() -> list[tuple[int, int]]:
    records = make_arithmetic_records(4000, seed=0, max_digits=2)  # the built-in data's kind
    return [
        (int(pair["pos_answers"][0]), int(pair["neg_answers"][0]))
        for pair in as_paired_records(records, seed=0)
    ]


def test_three_quarters_of_the_wrong_answers_are_caught_by_a_rough_estimate():
    # What a small reward model learns within a default `rw` run: near misses (off by 1, 2 or
    # 10) need exact digit arithmetic and stay near chance there (see WRONG_ANSWER_KINDS).
    pairs = _built_in_pairs()
    rough = sum(_is_rough_mistake(right, wrong) for right, wrong in pairs) / len(pairs)
    assert 0.7 < rough < 0.8
    near_misses = [wrong - right for right, wrong in pairs if not _is_rough_mistake(right, wrong)]
    assert set(near_misses) <= {-10, -2, -1, 1, 2, 10}


def test_no_rule_that_ignores_the_prompt_ranks_the_pairs_well():
    # The reward model has to read the problem: comparing the two answers alone (which is
    # shorter, which is non-negative, which is smaller) ranks at most 60% of the pairs right.
    rules = {
        "shorter": lambda value: -len(str(value)),
        "non-negative": lambda value: value >= 0,
        "smaller": lambda value: -value,
        "larger": lambda value: value,
        "closer to zero": lambda value: -abs(value),
    }
    pairs = _built_in_pairs()
    for name, rule in rules.items():
        right_way = sum(
            1.0 if rule(right) > rule(wrong) else 0.5 if rule(right) == rule(wrong) else 0.0
            for right, wrong in pairs
        )
        assert right_way / len(pairs) <= 0.61, name


def test_every_kind_of_wrong_answer_differs_from_the_right_one():
    rng = random.Random(0)
    for value in range(-120, 1000):
        for kind, make in WRONG_ANSWER_KINDS.items():
            wrong = make(value, rng)
            assert wrong is None or wrong != value, (kind, value)
        assert wrong_answer(str(value), rng)[0] != str(value)


def test_written_files_pass_the_dataset_loaders(tmp_path):
    paths = write_arithmetic_files(tmp_path, n_train=30, n_eval=10, seed=5)
    assert sorted(paths) == [
        "paired_eval", "paired_train", "rl_eval", "rl_train", "sft_eval", "sft_train",
    ]  # fmt: skip
    prompts = load_prompt_records(paths["rl_train"])
    assert len(prompts) == 30 and prompts[0]["query_id"] == "train-0"
    assert len(load_sft_records(paths["sft_eval"])) == 10
    assert load_paired_records(paths["paired_train"])[0]["pos_answers"] == [prompts[0]["answer"]]


def test_the_builtin_chat_records_are_the_prompt_records_as_one_user_turn():
    from realrl.api.experiment import DatasetKind
    from realrl.workers.data_source import builtin_records

    prompts = builtin_records(DatasetKind.prompt, train_size=3)
    chats = builtin_records(DatasetKind.chat, train_size=3)
    assert chats == [
        {"query_id": p["query_id"], "messages": [{"role": "user", "content": p["prompt"]}],
         "answer": p["answer"], "task": "math"}
        for p in prompts
    ]


def test_the_builtin_eval_split_holds_problems_no_training_split_serves():
    from realrl.api.experiment import BUILTIN_EVAL_SIZE, BuiltinSplit, DatasetConfig, DatasetKind
    from realrl.workers.data_source import load_records

    train = load_records(DatasetKind.chat, DatasetConfig())  # the whole 4096-problem pool
    settings = DatasetConfig(builtin_split=BuiltinSplit.eval)
    evaluation = load_records(DatasetKind.chat, settings)
    assert len(evaluation) == settings.builtin_size() == BUILTIN_EVAL_SIZE == 256
    assert evaluation[0]["query_id"] == "eval-0" and train[0]["query_id"] == "train-0"
    train_prompts = {record["messages"][0]["content"] for record in train}
    assert not train_prompts & {record["messages"][0]["content"] for record in evaluation}
