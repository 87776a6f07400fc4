"""Runs inside the sandbox (``python -I -S _runner.py MODE [FN_NAME] [--block-network]``).

Copied into the work directory next to ``program.py``. MODE ``stdio`` executes the program as
``__main__`` with the test input on stdin. MODE ``call`` executes it as a module, then calls
``FN_NAME`` (a top-level function, or a method of a ``Solution`` class as in LeetCode-style
sets) with the JSON argument list read from stdin, and prints the JSON of the return value
after a marker line so the program's own prints cannot be mistaken for the result.

Exit codes: the program's own, 1 for an uncaught exception, 90 for MemoryError.
"""

import json
import sys

RESULT_MARKER = "\n@@realrl-call-result@@\n"
MEMORY_ERROR_EXIT_CODE = 90


def _block_network() -> None:
    """Fallback when no network namespace is available: make socket creation fail."""
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the realrl code sandbox")

    socket.socket = refuse
    socket.create_connection = refuse
    socket.socketpair = refuse
    sys.modules["_socket"].socket = refuse


def _call(namespace: dict, function_name: str, arguments_text: str):
    function = namespace.get(function_name)
    if function is None and "Solution" in namespace:
        function = getattr(namespace["Solution"](), function_name)
    if function is None:
        raise NameError(f"the program defines no function or Solution method {function_name!r}")
    arguments = json.loads(arguments_text)
    if not isinstance(arguments, list):
        arguments = [arguments]
    return function(*arguments)


def main() -> None:
    mode = sys.argv[1]
    if "--block-network" in sys.argv:
        _block_network()
    with open("program.py") as source_file:
        source = source_file.read()
    code = compile(source, "program.py", "exec")
    namespace = {
        "__name__": "__main__" if mode == "stdio" else "program",
        "__builtins__": __builtins__,
    }
    sys.setrecursionlimit(100000)
    try:
        if mode == "stdio":
            exec(code, namespace)
        else:
            arguments_text = sys.stdin.read()
            exec(code, namespace)
            result = _call(namespace, sys.argv[2], arguments_text)
            sys.stdout.write(RESULT_MARKER + json.dumps(result, default=repr) + "\n")
    except MemoryError:
        sys.stdout.flush()
        sys.stderr.write("MemoryError\n")
        sys.exit(MEMORY_ERROR_EXIT_CODE)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
