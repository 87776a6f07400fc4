import json

import pytest

from realrl.rewards import CodeSandbox, MathVerifier, score_completions

ADD_TESTS = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
ADD_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_score_completions_routes_each_item_by_task():
    with MathVerifier(num_workers=1, timeout_s=5.0) as math_verifier:
        rewards = score_completions(
            completions=[
                "\\boxed{\\frac{1}{2}}",
                ADD_PROGRAM,
                "#### 4",
                "```python\nprint(6)\n```",
            ],
            tasks=["math", "code", "math", "code"],
            answers=[["0.5"], [], ["5"], []],
            input_outputs=[None, ADD_TESTS, None, ADD_TESTS],
            math_verifier=math_verifier,
            code_sandbox=CodeSandbox(timeout_s=2.0),
        )
    assert rewards == [1.0, 1.0, 0.0, 0.0]


def test_score_completions_names_unknown_tasks_and_missing_scorers():
    with pytest.raises(ValueError, match=r"unknown reward task\(s\) \['poetry'\]"):
        score_completions(["x"], ["poetry"], [[]], [None], None, None)
    with pytest.raises(ValueError, match="code_sandbox is None"):
        score_completions([ADD_PROGRAM], ["code"], [[]], [ADD_TESTS], None, None)
    with pytest.raises(ValueError, match="equal lengths"):
        score_completions(["x", "y"], ["math"], [[]], [None], None, None)
