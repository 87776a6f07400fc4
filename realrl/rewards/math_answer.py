"""Pull the final answer out of a math completion, and a cheap equality check.

Extraction runs in the caller's process (it is plain string work and never hangs on
pathological input: every pattern is linear). Only the symbolic comparison, which can blow
up in sympy, is sent to the worker processes of :class:`realrl.rewards.math_reward.MathVerifier`.

Precedence, strongest first, and the last occurrence wins within each form:
1. ``\\boxed{...}`` / ``\\fbox{...}`` with nested braces (also ``\\boxed 5``);
2. the GSM8K marker ``#### 42``;
3. a phrase: ``Answer: 42``, ``The answer is 42``, ``final answer is 42``;
4. optionally, the last number in the text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_PATTERN = re.compile(r"####\s*([^\n]+)")
_PHRASE_PATTERN = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE
)
# A comma belongs to a number only as a thousands separator ("7, then" ends at 7), and a
# fraction's slash stays on its line ("8/" at a line's end is not "8/9" with the next line's 9).
_NUMBER_PATTERN = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[ \t]*/[ \t]*\d+)?|-?\.\d+")
_THOUSANDS_PATTERN = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_SIMPLE_FRACTION_PATTERN = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_SURE_MISMATCH_GAP = Fraction(1, 10**5)
_PLAIN_NUMBER_PATTERN = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)(/\d+)?$")


def _brace_group(text: str, open_index: int) -> str | None:
    """Return the contents of the brace group opening at `open_index`, or None if unclosed."""
    depth = 0
    for index in range(open_index, len(text)):
        character = text[index]
        if character == "{":
            depth += 1
        elif character == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
    return None


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` or ``\\fbox{...}`` in `text`, braces balanced."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    while start != -1:
        command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
        rest_index = start + len(command)
        if rest_index < len(text) and text[rest_index] == "{":
            contents = _brace_group(text, rest_index)
            if contents is not None:
                return contents.strip()
        elif rest_index < len(text) and text[rest_index] == " ":
            # `\boxed 5` is legal LaTeX: the argument is the next token.
            token = text[rest_index:].split(maxsplit=1)
            if token:
                return token[0].rstrip("$.")
        # Unclosed or malformed box: try the previous one.
        start = max(text.rfind(command, 0, start) for command in _BOX_COMMANDS)
    return None


def _clean_phrase_answer(answer: str) -> str:
    answer = answer.strip()
    if answer.startswith("$") and answer.count("$") >= 2:
        answer = answer[1 : answer.index("$", 1)]
    for prefix, suffix in (("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(prefix) and suffix in answer:
            answer = answer[len(prefix) : answer.index(suffix)]
    return answer.strip().rstrip(".").strip()


def extract_answer(completion: str, use_last_number: bool = True) -> str | None:
    """The final answer of `completion` as a string, or None when nothing answer-like is found.

    `use_last_number` turns on the weakest rule (the last number anywhere in the text), which
    helps with models that never learned an answer format but can reward lucky guesses.
    """
    boxed = extract_boxed(completion)
    if boxed:
        return boxed
    gsm8k_matches = _GSM8K_PATTERN.findall(completion)
    if gsm8k_matches:
        return _clean_phrase_answer(gsm8k_matches[-1])
    phrase_matches = _PHRASE_PATTERN.findall(completion)
    for candidate in reversed(phrase_matches):
        cleaned = _clean_phrase_answer(candidate)
        if cleaned:
            return cleaned
    if use_last_number:
        numbers = _NUMBER_PATTERN.findall(completion)
        if numbers:
            return numbers[-1].replace(" ", "")
    return None


def normalize_answer(answer: str) -> str:
    """A light textual normal form: no spaces, no ``$``, no ``\\left``/``\\right``, no final dot."""
    answer = answer.strip().rstrip(".").strip().strip("$").strip()
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\displaystyle", " "):
        answer = answer.replace(token, "")
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return answer.rstrip(".")


def parse_number(answer: str) -> Fraction | None:
    """`answer` as an exact rational when it is a plain number, decimal or simple fraction."""
    try:
        return _exact_number(answer)
    except (ValueError, ZeroDivisionError):
        return None


def _exact_number(answer: str) -> Fraction | None:
    """`parse_number` without its error handling: ZeroDivisionError for a fraction over 0
    (``8/0``, ``\\frac{8}{0}``), ValueError for a form that `Fraction` does not read."""
    text = normalize_answer(answer)
    if _THOUSANDS_PATTERN.match(text):
        text = text.replace(",", "")
    fraction_match = _SIMPLE_FRACTION_PATTERN.match(text)
    if fraction_match:
        sign, numerator, denominator = fraction_match.groups()
        value = Fraction(int(numerator), int(denominator))
        return -value if sign else value
    if _PLAIN_NUMBER_PATTERN.match(text):
        return Fraction(text)
    return None


def fast_match(prediction: str, reference: str) -> bool | None:
    """Decide the easy cases without sympy: True/False when sure, None to ask math-verify.

    Two different integers are a sure mismatch, and so are two numbers too far apart for
    math-verify's rounding to 6 decimals to equate; closer ones are not (math-verify accepts
    ``0.333333`` for ``1/3`` after rounding), so those go to the slow path. A fraction over 0
    never equals a number (math-verify reads ``8/0`` as sympy's complex infinity, ``0/0`` as
    NaN); an untrained model writes such answers now and then.
    """
    if normalize_answer(prediction) == normalize_answer(reference):
        return True
    reference_value = parse_number(reference)
    try:
        prediction_value = _exact_number(prediction)
    except ZeroDivisionError:
        return False if reference_value is not None else None
    except ValueError:
        prediction_value = None
    if prediction_value is None or reference_value is None:
        return None
    if prediction_value == reference_value:
        return True
    both_integers = prediction_value.denominator == 1 and reference_value.denominator == 1
    if both_integers:
        return False
    # math-verify compares plain numbers exactly, or rounded to 6 decimals when one is written
    # as a decimal: numbers further apart than a rounding step never match.
    gap = abs(prediction_value - reference_value)
    scale = max(1, abs(prediction_value), abs(reference_value))
    return False if gap > _SURE_MISMATCH_GAP * scale else None


def as_math_verify_input(answer: str) -> str:
    """Wrap a bare answer in ``$...$`` so math-verify's LaTeX extractor sees the whole thing."""
    stripped = answer.strip()
    if "$" in stripped or "\\boxed" in stripped or "\\(" in stripped or "\\[" in stripped:
        return stripped
    return f"${stripped}$"
