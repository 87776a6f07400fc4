from fractions import Fraction

import pytest

from realrl.rewards.math_answer import (
    as_math_verify_input,
    extract_answer,
    extract_boxed,
    fast_match,
    parse_number,
)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("so x = \\boxed{5}", "5"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
        ("old style \\fbox{42}.", "42"),
        ("spaced form $\\boxed 7$", "7"),
        ("unclosed last \\boxed{3} and \\boxed{4", "3"),
        ("Natalia sold 48 clips.\n#### 72", "72"),
        ("We get 1,000 apples\n#### 1,000", "1,000"),
        ("Thus the answer is $-3$.", "-3"),
        ("Answer: (0, 1]", "(0, 1]"),
        ("The final answer is \\(\\frac{3}{4}\\).", "\\frac{3}{4}"),
        ("I computed 3 + 4 = 7, then doubled to 14", "14"),
        ("a ratio of 2/3 here", "2/3"),
        ("it is 7, I think", "7"),
        ("about 1,234,567 of them", "1,234,567"),
        ("the pair 1,2", "2"),
        ("half is 1 / 2", "1/2"),
        ("x = 8/\n9 more", "9"),
    ],
)
def test_extract_answer_finds_the_final_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_extract_answer_prefers_boxed_over_phrases_and_numbers():
    assert extract_answer("The answer is 3. Actually \\boxed{4}, not 5") == "4"


def test_extract_answer_without_last_number_fallback_returns_none():
    assert extract_answer("I computed 3 + 4 = 7", use_last_number=False) is None
    assert extract_answer("no digits here at all") is None


def test_extract_boxed_handles_deeply_nested_braces():
    assert extract_boxed("\\boxed{\\{1, \\{2\\}\\}}") == "\\{1, \\{2\\}\\}"
    assert extract_boxed("\\boxed{{a}{b}}") == "{a}{b}"


@pytest.mark.parametrize(
    "text, value",
    [
        ("0.5", Fraction(1, 2)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("-\\dfrac{3}{4}", Fraction(-3, 4)),
        ("1,234", Fraction(1234)),
        ("3/6", Fraction(1, 2)),
        ("$12$.", Fraction(12)),
        ("x + 1", None),
        ("1,2", None),  # a pair, not a thousands separator
    ],
)
def test_parse_number_reads_plain_numbers_exactly(text, value):
    assert parse_number(text) == value


def test_fast_match_is_sure_only_when_it_can_be():
    assert fast_match("\\frac{1}{2}", "0.5") is True
    assert fast_match("\\left( 1, 2 \\right)", "(1,2)") is True
    assert fast_match("7", "8") is False
    # 0.333333 vs 1/3 is a rounding question for math-verify, not a sure mismatch.
    assert fast_match("0.333333", "\\frac{1}{3}") is None
    assert fast_match(".3", "1017") is False
    assert fast_match("52/9", "1017") is False
    # Over zero: math-verify's zoo or nan equals no number (checked against math-verify).
    for undefined in ("8/0", "-3/0", "0/0", "\\frac{8}{0}", "$12/0$"):
        assert fast_match(undefined, "1102") is False and fast_match(undefined, "0") is False
    assert fast_match("8/0", "\\infty") is None  # not a number: math-verify decides
    assert fast_match("0.3334", "\\frac{1}{3}") is False
    assert fast_match("\\sqrt{2}", "2^{1/2}") is None


def test_as_math_verify_input_wraps_bare_answers_in_dollars():
    assert as_math_verify_input("\\frac{1}{2}") == "$\\frac{1}{2}$"
    assert as_math_verify_input("$x$") == "$x$"
