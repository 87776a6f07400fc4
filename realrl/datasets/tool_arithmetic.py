"""The built-in agentic task: multiplication of two- and three-digit numbers.

Products such as ``417*386=`` -> ``160962`` are beyond what the tiny default model computes in
its head (its answers from memory are almost never right), and a ``calc(417*386)`` call is,
so a policy that learns to call the tool earns more reward (`realrl.episodes.builtin`). The
prompts are those of `realrl.datasets.arithmetic` with ``*`` only, so the rule reward checks
them as it checks the other built-in problems.

`as_tool_sft_records` writes the transcripts the default agentic model is warm-started on
(`realrl.launcher.warm_start.ensure_tool_warm_start`): a fraction ``tool_fraction`` of the
problems solved with a tool call in the raw turn format of `realrl.episodes.turns`, the rest
answered directly, so that the warm-started model knows the call format but calls the tool
only sometimes, leaving reinforcement learning something to raise.
"""

from __future__ import annotations

import random
from typing import Any

from realrl.datasets.arithmetic import make_arithmetic_splits

MULTIPLICATION_DIGITS = {"min_digits": 2, "max_digits": 3, "ops": ("*",)}
# How the raw turn format writes a call, its output and the end of a model turn, as in
# `realrl.episodes.turns` (RAW_TOOL_OUTPUT) with the built-in tokenizer's EOS.
_END_OF_TURN = "<eos>"


def make_multiplication_splits(n_train: int, n_eval: int, seed: int):
    """Disjoint train and eval records of the multiplication task (see the module docstring)."""
    return make_arithmetic_splits(n_train, n_eval, seed, **MULTIPLICATION_DIGITS)


def tool_transcript(prompt: str, answer: str, tool: str) -> str:
    """What the model writes, and the tool output between, after `prompt` (``"12*34="``) when
    it calls `tool` (``calc`` or ``python``): the completion of an SFT record."""
    expression = prompt.rstrip("=")
    call = f"calc({expression})" if tool == "calc" else f"python(print({expression}))"
    return f"{call}{_END_OF_TURN}out({answer}){answer}"


def as_tool_sft_records(records: list[dict[str, Any]], seed: int,
                        tool_fraction: float) -> list[dict[str, Any]]:
    """SFT records: with probability `tool_fraction` a calc call (one in five of them a python
    call) and its use, else the bare answer."""
    rng = random.Random(seed)
    sft_records = []
    for record in records:
        prompt, answer = record["prompt"], record["answer"]
        if rng.random() < tool_fraction:
            tool = "python" if rng.random() < 0.2 else "calc"
            answer = tool_transcript(prompt, answer, tool)
        sft_records.append({"query_id": record["query_id"], "prompt": prompt, "answer": answer})
    return sft_records
