"""The tools of agentic episodes, and the tolerant parser of a model turn's tool call.

Call format. A model turn whose text starts with ``name(`` is a call of tool ``name`` with
everything up to the turn's last ``)`` as its argument: ``calc(123*456)``,
``python(print(2**10))``. Any other turn is an answer. Parsing never fails: a malformed call
(an unknown tool, no closing parenthesis, an argument the tool rejects) becomes a `ToolOutput`
whose text is the error message, which the episode appends like any tool output, and the
episode goes on.

Tools (`TOOLS`):
- ``calc``: exact arithmetic on numbers with ``+ - * / // % **`` and parentheses, evaluated
  from the parsed syntax tree (no ``eval``); powers and results are bounded in size.
- ``python``: the argument is a program, run once in `realrl.rewards.CodeSandbox` (network,
  mount and PID namespaces and an unprivileged uid when root; CPU, memory, process, file-size
  limits and a wall-clock timeout always); its standard output is the result. An infinite loop,
  a fork bomb or a flood of output ends as an ``error: timeout`` / ``error: output_limit``
  output, not as a stuck worker.
Every output is cut to ``episode.max_tool_output_chars`` characters.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from fractions import Fraction

from realrl.api.episode_config import EpisodeConfig
from realrl.rewards.code_sandbox import CodeSandbox

_CALL_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


@dataclass
class ToolCall:
    """``name(argument)`` as the model wrote it; `error` set for a call that cannot run."""

    name: str
    argument: str
    error: str | None = None


@dataclass
class ToolOutput:
    text: str  # what joins the sequence, cut to episode.max_tool_output_chars
    ok: bool  # False: the call was malformed or the tool failed (the text says why)


def parse_tool_call(text: str, tools: tuple[str, ...] | list[str]) -> ToolCall | None:
    """The tool call of a model turn, or None when the turn is an answer (does not start with
    ``identifier(``). Never raises: a malformed call carries its error message."""
    match = _CALL_START.match(text)
    if match is None:
        return None
    name, rest = match.group(1), text[match.end():]
    close = rest.rfind(")")
    argument = rest[:close] if close >= 0 else rest
    if name not in tools:
        return ToolCall(name, argument, f"error: unknown tool {name}; tools: {', '.join(tools)}")
    if close < 0:
        return ToolCall(name, argument, f"error: {name}( is not closed; write {name}(...)")
    return ToolCall(name, argument)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CALC_DIGITS = 1000  # a result or power operand beyond this many digits is refused


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression (integers stay integers, ``7/2`` is 3.5,
    ``1/3`` a decimal); raises ValueError with a message the model can read."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()[:40]!r}") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 64 or len(str(left)) > 64:
                raise ValueError("power too large")
            return left ** int(right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        result = Fraction(_BINARY[type(node.op)](left, right))
        if len(str(result.numerator)) > MAX_CALC_DIGITS:
            raise ValueError("result too large")
        return result
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not "
                     f"{type(node).__name__}")


def _python_program(argument: str) -> str:
    """The program of a python call; a fenced block is unwrapped, and a bare expression other
    than a print is printed (``python(2**10)`` prints 1024)."""
    fenced = _FENCE.match(argument)
    program = fenced.group(1) if fenced else argument
    try:
        expression = ast.parse(program, mode="eval").body
    except SyntaxError:
        return program
    calls_print = (isinstance(expression, ast.Call) and isinstance(expression.func, ast.Name)
                   and expression.func.id == "print")
    return program if calls_print else f"print({program})"


# Tool name -> what it does, in the order tools are listed to the model.
TOOLS = {
    "calc": "exact arithmetic: calc(417*386)",
    "python": "a Python program in the sandbox, its stdout: python(print(417*386))",
}


class ToolBox:
    """Runs the tools `config.tools` allows; thread-safe (python calls run in worker threads
    of the episode runner, each in its own sandboxed process)."""

    def __init__(self, config: EpisodeConfig) -> None:
        self.config = config
        self.tools = tuple(tool for tool in TOOLS if tool in config.tools)
        self._sandbox: CodeSandbox | None = None

    def parse(self, text: str) -> ToolCall | None:
        return parse_tool_call(text, self.tools)

    def blocks(self, call: ToolCall) -> bool:
        """Whether `run` takes long enough to belong in a worker thread (a sandboxed process)."""
        return call.error is None and call.name == "python"

    def run(self, call: ToolCall) -> ToolOutput:
        if call.error is not None:
            return self._output(call.error, ok=False)
        if call.name == "calc":
            try:
                return self._output(calculate(call.argument), ok=True)
            except (ValueError, ArithmeticError) as error:
                return self._output(f"error: {error}", ok=False)
        run = self._python().run_program(_python_program(call.argument))
        if run.status != "ok":
            # An exception's last line ("ZeroDivisionError: division by zero"), else the limit
            # the program hit ("timeout", "memory", "output_limit").
            last_line = run.stderr.strip().splitlines()[-1:] if run.status == "error" else []
            return self._output(f"error: {(last_line or [run.status])[0]}", ok=False)
        return self._output(run.stdout.strip(), ok=True)

    def _output(self, text: str, ok: bool) -> ToolOutput:
        return ToolOutput(text[: self.config.max_tool_output_chars], ok)

    def _python(self) -> CodeSandbox:
        if self._sandbox is None:
            # The file-size limit caps stdout: a flood of output fails fast instead of filling
            # the disk; the output kept is far larger than what joins the sequence anyway.
            self._sandbox = CodeSandbox(
                timeout_s=self.config.tool_timeout_s, memory_mb=self.config.tool_memory_mb,
                max_processes=8, max_file_bytes=max(65536, 16 * self.config.max_tool_output_chars),
            )
        return self._sandbox
