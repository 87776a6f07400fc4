import threading
import time
from pathlib import Path

import pytest

from realrl.rewards.math_reward import MathVerifier

# (model answer, reference, expected reward). The answer is boxed in the completion.
ANSWER_PAIRS = [
    # fractions and decimals
    ("\\frac{1}{2}", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("\\dfrac{3}{4}", "0.75", 1.0),
    ("1/2", "0.5", 1.0),
    ("\\frac{2}{4}", "\\frac{1}{2}", 1.0),
    ("\\frac{1}{3}", "0.5", 0.0),
    ("0.25", "\\frac{1}{4}", 1.0),
    ("2.50", "2.5", 1.0),
    ("\\frac{7}{2}", "3.5", 1.0),
    ("\\frac{7}{2}", "3.4", 0.0),
    # integers, negatives, thousands
    ("42", "42", 1.0),
    ("-3", "-3", 1.0),
    ("-3", "3", 0.0),
    ("1,000", "1000", 1.0),
    ("1000", "1,000", 1.0),
    ("-\\frac{1}{2}", "-0.5", 1.0),
    ("0", "0", 1.0),
    ("17", "71", 0.0),
    ("12", "12.0", 1.0),
    # radicals, pi, expressions
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("2\\sqrt{3}", "\\sqrt{12}", 1.0),
    ("\\sqrt{3}", "\\sqrt{2}", 0.0),
    ("2\\pi", "2\\pi", 1.0),
    ("\\pi", "3.15", 0.0),
    ("2x+1", "1+2x", 1.0),
    ("x^2-1", "(x-1)(x+1)", 1.0),
    ("x^2+1", "(x+1)^2", 0.0),
    ("2^{10}", "1024", 1.0),
    ("3!", "6", 1.0),
    # equations: the right-hand side counts
    ("x=3", "3", 1.0),
    ("x = 5", "3", 0.0),
    # sets and tuples
    ("\\{1,2\\}", "\\{2,1\\}", 1.0),
    ("\\{1,2,3\\}", "\\{1,2\\}", 0.0),
    ("(1,2)", "(1, 2)", 1.0),
    ("(1, 2)", "(2, 1)", 0.0),
    # intervals
    ("(0,1]", "(0, 1]", 1.0),
    ("[0,1)", "(0,1)", 0.0),
    ("(-\\infty, 2)", "(-\\infty,2)", 1.0),
    ("[1,5]", "[1, 5]", 1.0),
    ("[1,5]", "[1, 6]", 0.0),
    # percentages (math-verify reads 50\% as 50)
    ("50\\%", "50", 1.0),
    ("25\\%", "50", 0.0),
    # LaTeX decorations and text
    ("\\left(\\frac{1}{2}\\right)", "\\frac{1}{2}", 1.0),
    ("\\text{(B)}", "B", 1.0),
    ("\\frac{1}{2}\\,", "\\frac{1}{2}", 1.0),
    ("10^{-2}", "0.01", 1.0),
    ("\\frac{3}{2}", "1\\frac{1}{2}", 1.0),
    # plainly wrong
    ("7", "8", 0.0),
    ("\\frac{1}{2}", "2", 0.0),
    ("x", "y", 0.0),
    ("\\infty", "100", 0.0),
]


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=2, timeout_s=5.0) as math_verifier:
        yield math_verifier


def test_answer_pairs_score_as_expected(verifier):
    assert len(ANSWER_PAIRS) >= 50
    completions = [
        f"Let me think. The result is \\boxed{{{answer}}}." for answer, _, _ in ANSWER_PAIRS
    ]
    references = [[reference] for _, reference, _ in ANSWER_PAIRS]
    scores = verifier.score(completions, references)
    mismatches = [
        (answer, reference, expected, got)
        for (answer, reference, expected), got in zip(ANSWER_PAIRS, scores)
        if got != expected
    ]
    assert mismatches == []


def test_score_is_one_when_any_reference_matches(verifier):
    scores = verifier.score(["#### 0.5", "#### 7", "Answer: 9"], [["3", "1/2"], ["8", "9"], []])
    assert scores == [1.0, 0.0, 0.0]


def test_completion_without_any_answer_scores_zero(verifier):
    assert verifier.score(["I am not sure."], [["3"]]) == [0.0]


def test_pathological_expression_times_out_with_zero_and_verifier_keeps_working():
    with MathVerifier(num_workers=1, timeout_s=2.0) as math_verifier:
        start = time.monotonic()
        scores = math_verifier.score(["\\boxed{9^{9^{9^{9}}}}"], [["5"]])
        elapsed_s = time.monotonic() - start
        assert scores == [0.0]
        assert elapsed_s < 2.0 + 1.5
        assert math_verifier.num_timeouts == 1
        assert math_verifier.score(
            ["\\boxed{\\frac{1}{2}}", "\\boxed{2x}"], [["0.5"], ["x+x"]]
        ) == [1.0, 1.0]


def test_worker_that_misses_the_hard_deadline_is_killed_and_replaced():
    # Without the in-worker deadline only the parent's wall-clock kill can end the item.
    with MathVerifier(num_workers=1, timeout_s=1.5, interrupt_in_worker=False) as math_verifier:
        original_pid = math_verifier.worker_pids()[0]
        start = time.monotonic()
        assert math_verifier.score(["\\boxed{9^{9^{9^{9}}}}"], [["5"]]) == [0.0]
        assert time.monotonic() - start < 1.5 + 1.0
        assert math_verifier.worker_pids() == [None]
        assert math_verifier.score(["\\boxed{\\sqrt{4}}"], [["2.0"]]) == [1.0]
        assert math_verifier.worker_pids()[0] not in (None, original_pid)


def test_verifier_works_from_non_main_threads(verifier):
    results: dict[int, list[float]] = {}

    def score_in_thread(thread_index: int) -> None:
        results[thread_index] = verifier.score(
            ["\\boxed{\\frac{2}{4}}", "\\boxed{x^2-1}", "\\boxed{3}"],
            [["0.5"], ["(x-1)(x+1)"], ["4"]],
        )

    threads = [threading.Thread(target=score_in_thread, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {index: [1.0, 1.0, 0.0] for index in range(3)}


def test_score_rejects_mismatched_lengths(verifier):
    with pytest.raises(ValueError, match="one list of references per completion"):
        verifier.score(["\\boxed{1}"], [])


def test_worker_finds_packages_on_the_parents_path_despite_isolated_mode(tmp_path, monkeypatch):
    # A wheelhouse installed with `pip --target` is reachable through PYTHONPATH only, which
    # `python -I` ignores: the child must get the parent's sys.path. This folder's math_verify
    # answers 1.0 for everything, so a score of 1.0 on a wrong answer proves it was imported.
    (tmp_path / "math_verify.py").write_text(
        "def parse(text, parsing_timeout=None):\n    return [text]\n"
        "def verify(reference, prediction, timeout_seconds=None):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with MathVerifier(num_workers=1) as verifier:
        assert verifier.score(["\\boxed{x^2}"], [["\\boxed{y+1}"]]) == [1.0]


def test_a_worker_that_dies_at_start_is_reported_with_its_exit_code_and_output(monkeypatch):
    import realrl.rewards.math_reward as math_reward

    script = Path(math_reward.__file__).with_name("_missing_worker.py")
    monkeypatch.setattr(math_reward, "_WORKER_SCRIPT", script)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        math_reward._WorkerProcess(memory_limit_mb=0, startup_timeout_s=60.0).start()
    assert time.monotonic() - started < 30  # a dead child is not waited for until the timeout
    message = str(error.value)
    assert "exited with code 2" in message and "_missing_worker.py" in message
    assert "No such file or directory" in message  # the child's own stderr
