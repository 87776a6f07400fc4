"""Verifiable rewards: math answer equivalence and sandboxed code execution.

Importing this package is cheap (no torch, no sympy); math-verify loads only in the
MathVerifier's worker processes.
"""

from realrl.rewards.code_sandbox import CodeResult, CodeSandbox, extract_code
from realrl.rewards.dispatch import score_completions
from realrl.rewards.math_answer import extract_answer
from realrl.rewards.math_reward import MathVerifier

__all__ = [
    "CodeResult",
    "CodeSandbox",
    "MathVerifier",
    "extract_answer",
    "extract_code",
    "score_completions",
]
