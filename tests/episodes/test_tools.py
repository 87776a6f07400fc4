"""The tools of agentic episodes: the tolerant call parser, the calculator, and Python in the
sandbox with hostile programs (infinite loop, flood of output, fork bomb) contained."""

from __future__ import annotations

import pytest

from realrl.api.episode_config import TOOL_NAMES, EpisodeConfig
from realrl.episodes.tools import TOOLS, ToolBox, calculate, parse_tool_call

BOTH = ("calc", "python")


def test_the_config_names_every_tool_the_toolbox_runs():
    assert tuple(TOOLS) == TOOL_NAMES


@pytest.mark.parametrize("text", ["160962", "-5", "the answer is 4", "  12", "", "(3)"])
def test_a_turn_that_does_not_start_with_a_call_is_an_answer(text):
    assert parse_tool_call(text, BOTH) is None


def test_a_call_takes_everything_up_to_the_last_parenthesis():
    call = parse_tool_call(" calc((1+2)*3)", BOTH)
    assert (call.name, call.argument, call.error) == ("calc", "(1+2)*3", None)
    call = parse_tool_call("python(print(max(1, 2)))trailing", BOTH)
    assert (call.name, call.argument, call.error) == ("python", "print(max(1, 2))", None)


def test_malformed_calls_carry_an_error_message_instead_of_raising():
    unclosed = parse_tool_call("calc(12*", BOTH)
    assert unclosed.error.startswith("error: calc( is not closed")
    unknown = parse_tool_call("calcp(1*2)", BOTH)
    assert unknown.error == "error: unknown tool calcp; tools: calc, python"
    # A tool the config leaves out is unknown too.
    assert parse_tool_call("python(1)", ("calc",)).error.startswith("error: unknown tool python")


@pytest.mark.parametrize("expression, value", [
    ("417*386", "160962"),  # 417 * 386 = 160962
    ("(1+2)*-3", "-9"),
    ("7/2", "3.5"),
    ("2**10 // 3", "341"),  # 1024 // 3 = 341
    ("10 % 4", "2"),
])
def test_calculator_computes_exactly(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1+", "cannot parse"),
    ("1/0", "division by zero"),
    ("9**9**9", "power too large"),
    ("__import__('os').system('true')", "only numbers"),
    ("True+1", "only numbers"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


@pytest.fixture(scope="module")
def toolbox():
    return ToolBox(EpisodeConfig(tool_timeout_s=2.0, tool_memory_mb=256, max_tool_output_chars=40))


def run(toolbox, text):
    return toolbox.run(toolbox.parse(text))


def test_tool_errors_become_outputs(toolbox):
    assert (run(toolbox, "calc(1/0)").text, run(toolbox, "calc(1/0)").ok) == (
        "error: division by zero", False)
    unclosed = run(toolbox, "calc(1+")
    assert not unclosed.ok and unclosed.text.startswith("error: calc( is not closed")


def test_python_prints_and_bare_expressions_are_printed(toolbox):
    assert (run(toolbox, "python(print(417*386))").text, run(toolbox, "python(2**10)").text) == (
        "160962", "1024")
    fenced = run(toolbox, "python(```python\nx = 6\nprint(x * 7)\n```)")
    assert (fenced.text, fenced.ok) == ("42", True)


def test_a_python_exception_reports_its_last_line(toolbox):
    output = run(toolbox, "python(1/0)")
    assert not output.ok
    assert output.text == "error: ZeroDivisionError: division by zero"[:40]


def test_an_infinite_loop_ends_as_a_timeout(toolbox):
    output = run(toolbox, "python(while True: pass)")
    assert (output.text, output.ok) == ("error: timeout", False)
    assert run(toolbox, "python(print(1))").text == "1"  # the toolbox still works


def test_a_flood_of_output_is_cut(toolbox):
    output = run(toolbox, "python(print('x' * 10**9))")
    # A GB of output fails the file-size limit (or runs out of memory); either way the
    # output is an error of at most max_tool_output_chars characters.
    assert not output.ok and output.text.startswith("error: ")
    assert len(output.text) <= 40
    long_output = run(toolbox, "python(print('y' * 1000))")
    assert long_output.text == "y" * 40


def test_a_fork_bomb_is_contained(toolbox):
    program = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass"
    output = run(toolbox, f"python(exec('{program}'))")
    assert not output.ok
    assert run(toolbox, "python(print(2))").text == "2"


def test_the_network_is_unreachable(toolbox):
    program = ("import socket; s = socket.create_connection(('127.0.0.1', 1), timeout=1)")
    output = run(toolbox, f"python({program})")
    assert not output.ok and output.text.startswith("error: ")
    assert "Error" in output.text  # an exception (PermissionError or ConnectionRefusedError)
