import json
import os
import shutil
import socket
import tempfile
import time

import pytest

from realrl.rewards.code_sandbox import CodeSandbox, extract_code

ADD_TESTS = json.dumps({"inputs": ["1 2\n", "10 -4\n"], "outputs": ["3\n", "6\n"]})
CORRECT_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
WRONG_PROGRAM = "a, b = map(int, input().split())\nprint(a - b)\n"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="uid drop and namespaces need root; the fallback is weaker"
)


@pytest.fixture(scope="module")
def sandbox():
    return CodeSandbox(timeout_s=2.0, memory_mb=256, max_processes=8, max_file_bytes=1 << 20)


def assert_contained(sandbox: CodeSandbox, program: str, expected_status: str, max_seconds: float):
    start = time.monotonic()
    result = sandbox.run_tests(program, ADD_TESTS)
    assert time.monotonic() - start < max_seconds
    assert result.reward == 0.0
    assert result.statuses[0] == expected_status, result
    # The sandbox is still healthy afterwards.
    assert sandbox.run_tests(CORRECT_PROGRAM, ADD_TESTS).reward == 1.0


def test_correct_program_scores_one(sandbox):
    result = sandbox.run_tests(CORRECT_PROGRAM, ADD_TESTS)
    assert (result.passed, result.total, result.reward, result.statuses) == (
        2,
        2,
        1.0,
        ["ok", "ok"],
    )


def test_wrong_program_scores_zero(sandbox):
    result = sandbox.run_tests(WRONG_PROGRAM, ADD_TESTS)
    assert (result.passed, result.reward, result.statuses) == (0, 0.0, ["wrong", "skipped"])


def test_all_tests_run_when_not_stopping_at_first_failure():
    sandbox = CodeSandbox(timeout_s=2.0, stop_at_first_failure=False)
    program = "a, b = map(int, input().split())\nprint(3)\n"
    result = sandbox.run_tests(program, ADD_TESTS)
    assert (result.passed, result.total, result.statuses) == (1, 2, ["ok", "wrong"])


def test_output_comparison_ignores_surrounding_whitespace(sandbox):
    tests = json.dumps({"inputs": [""], "outputs": ["1 2\n3"]})
    assert sandbox.run_tests("print('  1 2  ')\nprint('3')\n\n", tests).reward == 1.0


def test_call_based_tests_call_the_named_function(sandbox):
    tests = json.dumps(
        {"inputs": [[1, 2], "[4, 5]\n6"], "outputs": [3, [[4, 5, 6]]], "fn_name": "join"}
    )
    program = (
        "def join(a, b):\n    print('noise')\n    return a + b if isinstance(a, int) else a + [b]\n"
    )
    assert sandbox.run_tests(program, tests).statuses == ["ok", "ok"]
    solution = "class Solution:\n    def join(self, a, b):\n        return a * b\n"
    assert sandbox.run_tests(solution, tests).statuses == ["wrong", "skipped"]


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
    assert_contained(sandbox, "while True:\n    pass\n", "timeout", max_seconds=2.0 + 2.0)


def test_sleeping_program_is_killed_at_the_wall_clock_timeout(sandbox):
    assert_contained(sandbox, "import time\ntime.sleep(60)\n", "timeout", max_seconds=2.0 + 2.0)


def test_fork_bomb_is_contained(sandbox):
    program = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    assert_contained(sandbox, program, "timeout", max_seconds=2.0 + 3.0)


def test_memory_hog_fails_with_memory_status():
    # A 10 s wall-clock limit, so that the status says the memory limit stopped it: with 2 s,
    # a CI machine loaded by the other test process once ran out of time first.
    sandbox = CodeSandbox(timeout_s=10.0, memory_mb=256, max_processes=8, max_file_bytes=1 << 20)
    program = "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))\n"
    assert_contained(sandbox, program, "memory", max_seconds=12.0)


def test_huge_output_is_cut_off(sandbox):
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    assert_contained(sandbox, program, "output_limit", max_seconds=5.0)


@needs_root
def test_writes_outside_the_work_directory_do_not_appear(sandbox, tmp_path):
    os.chmod(tmp_path, 0o777)  # even a world-writable directory outside is out of reach
    targets = [tmp_path / "escaped.txt", "/tmp/realrl-sandbox-escape.txt", "/work/escaped.txt"]
    writes = "".join(
        f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
        for target in targets
    )
    program = writes + "open('inside.txt', 'w').write('fine')\n" + CORRECT_PROGRAM
    assert sandbox.run_tests(program, ADD_TESTS).reward == 1.0  # inside writes are allowed
    for target in targets:
        assert not os.path.exists(target), target


@pytest.fixture
def run_directory_outside_tmp():
    """A root-owned 0755 directory not under the masked /tmp, so only the uid drop protects it."""
    parent = "/var/cache" if os.path.isdir("/var/cache") else None
    if parent is None:
        pytest.skip("no /var/cache to hold a run directory outside /tmp")
    directory = tempfile.mkdtemp(prefix="realrl-test-run-", dir=parent)
    os.chmod(directory, 0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@needs_root
def test_secret_file_outside_the_sandbox_cannot_be_read(sandbox, run_directory_outside_tmp):
    secret = os.path.join(run_directory_outside_tmp, "secret.key")
    with open(secret, "w") as secret_file:
        secret_file.write("hunter2")
    os.chmod(secret, 0o600)
    program = f"print(open({secret!r}).read())\n"
    tests = json.dumps({"inputs": [""], "outputs": ["hunter2"]})
    assert sandbox.run_tests(program, tests).statuses == ["error"]
    # The same program passes once the file is world-readable, so the check above can fail.
    os.chmod(secret, 0o644)
    assert sandbox.run_tests(program, tests).statuses == ["ok"]


@needs_root
def test_files_under_tmp_are_invisible_even_when_world_readable(sandbox, tmp_path):
    os.chmod(tmp_path, 0o755)
    shared = tmp_path / "shared.txt"
    shared.write_text("visible?")
    os.chmod(shared, 0o644)
    program = f"import os\nprint(os.path.exists({str(shared)!r}))\n"
    tests = json.dumps({"inputs": [""], "outputs": ["False"]})
    assert sandbox.run_tests(program, tests).statuses == ["ok"]


def test_connecting_to_a_local_listener_fails(sandbox):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
            "print('connected')\n"
        )
        tests = json.dumps({"inputs": [""], "outputs": ["connected"]})
        assert sandbox.run_tests(program, tests).statuses == ["error"]
        with pytest.raises(TimeoutError):
            listener.accept()


def test_environment_is_scrubbed(sandbox, monkeypatch):
    monkeypatch.setenv("REALRL_TEST_SECRET", "s3cret")
    program = "import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())\n"
    tests = json.dumps({"inputs": [""], "outputs": ["['HOME', 'LANG', 'PATH']\nTrue"]})
    assert sandbox.run_tests(program, tests).statuses == ["ok"]


def test_completions_run_in_parallel_batches(sandbox):
    completions = [
        f"Here you go:\n```python\n{CORRECT_PROGRAM}```",
        f"```python\n{WRONG_PROGRAM}```",
        "no code at all",
    ]
    results = sandbox.run_completions(completions, [ADD_TESTS] * 3)
    assert [result.reward for result in results] == [1.0, 0.0, 0.0]
    assert results[2].total == 2


def test_extract_code_takes_the_last_python_block():
    completion = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```"
    assert extract_code(completion) == "print(2)\n"
    assert extract_code("no fences") is None


def test_malformed_tests_raise_a_clear_error(sandbox):
    with pytest.raises(ValueError, match="'inputs' and 'outputs'"):
        sandbox.run_tests("print(1)", "{not json")
