"""Route each completion to the reward its task needs: math answers or code tests."""

from __future__ import annotations

from realrl.rewards.code_sandbox import CodeSandbox
from realrl.rewards.math_reward import MathVerifier

TASKS = ("math", "code")


def score_completions(
    completions: list[str],
    tasks: list[str],
    answers: list[list[str]],
    input_outputs: list[str | None],
    math_verifier: MathVerifier | None,
    code_sandbox: CodeSandbox | None,
) -> list[float]:
    """One reward in [0, 1] per completion, in order.

    `answers[i]` are the references of a "math" item (ignored for "code"); `input_outputs[i]`
    is the JSON test spec of a "code" item (ignored for "math"). Math items are scored in one
    batch so the verifier's workers run them in parallel; code items run two at a time. A code completion without a fenced
    code block scores 0.
    """
    lengths = {len(completions), len(tasks), len(answers), len(input_outputs)}
    if len(lengths) != 1:
        raise ValueError(
            f"score_completions needs equal lengths; got completions={len(completions)}, "
            f"tasks={len(tasks)}, answers={len(answers)}, input_outputs={len(input_outputs)}"
        )
    unknown = sorted({task for task in tasks if task not in TASKS})
    if unknown:
        raise ValueError(f"unknown reward task(s) {unknown}; valid tasks are {list(TASKS)}")
    rewards = [0.0] * len(completions)
    math_indices = [index for index, task in enumerate(tasks) if task == "math"]
    if math_indices:
        if math_verifier is None:
            raise ValueError("math tasks present but math_verifier is None; pass a MathVerifier")
        math_rewards = math_verifier.score(
            [completions[index] for index in math_indices],
            [answers[index] for index in math_indices],
        )
        for index, reward in zip(math_indices, math_rewards):
            rewards[index] = reward
    code_indices = [index for index, task in enumerate(tasks) if task == "code"]
    if code_indices:
        if code_sandbox is None:
            raise ValueError("code tasks present but code_sandbox is None; pass a CodeSandbox")
        missing = [index for index in code_indices if input_outputs[index] is None]
        if missing:
            raise ValueError(f"code items {missing} have input_outputs=None; they need JSON tests")
        results = code_sandbox.run_completions(
            [completions[index] for index in code_indices],
            [input_outputs[index] for index in code_indices],
        )
        for index, result in zip(code_indices, results):
            rewards[index] = result.reward
    return rewards
