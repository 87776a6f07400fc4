"""Worker process for MathVerifier: parse + verify with math-verify, one request per line.

Run as a script (``python -I _math_worker.py MEMORY_LIMIT_MB SEARCH_PATH_JSON``, the second
argument the parent's ``sys.path``, which ``-I`` would otherwise drop), not imported: it must not
pull in the realrl package (and torch) just to compare two expressions. It runs in its own
main thread, so a ``signal.setitimer`` deadline can interrupt sympy; math-verify's own
``signal.alarm`` timeouts are switched off because their ``alarm(0)`` would cancel ours.
The parent still enforces a hard wall-clock limit and kills this process if the deadline
cannot interrupt the work (a long computation inside C code never returns to Python).

Protocol: one JSON object per line on stdin ``{"prediction": str, "references": [str],
"soft_timeout_s": float | null}``; one JSON object per line on the protocol pipe
``{"score": 0.0 | 1.0, "status": "ok" | "timeout" | "error"}``. The first line written is
``{"ready": true}``. Anything the libraries print goes to stderr, never into the protocol.
"""

import json
import logging
import os
import resource
import signal
import sys


class _SoftDeadline(BaseException):
    """A BaseException, so math-verify's and sympy's `except Exception` cannot swallow it."""


def _on_deadline(signum, frame):
    raise _SoftDeadline()


def _verify_any(prediction: str, references: list, parse, verify) -> float:
    parsed_prediction = parse(prediction, parsing_timeout=None)
    if not parsed_prediction:
        return 0.0
    for reference in references:
        parsed_reference = parse(reference, parsing_timeout=None)
        if parsed_reference and verify(parsed_reference, parsed_prediction, timeout_seconds=None):
            return 1.0
    return 0.0


def _answer(request: dict, parse, verify) -> dict:
    soft_timeout_s = request.get("soft_timeout_s")
    if soft_timeout_s:
        signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
    try:
        score = _verify_any(request["prediction"], request["references"], parse, verify)
        return {"score": score, "status": "ok"}
    except _SoftDeadline:
        return {"score": 0.0, "status": "timeout"}
    except Exception as error:  # MemoryError and RecursionError included: score 0
        return {"score": 0.0, "status": "error", "detail": f"{type(error).__name__}: {error}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    memory_limit_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if len(sys.argv) > 2:
        parent_path = json.loads(sys.argv[2])
        sys.path[:] = parent_path + [entry for entry in sys.path if entry not in parent_path]
    if memory_limit_mb > 0:
        limit_bytes = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    # Keep the protocol on a private descriptor; route stray prints to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.disable(logging.WARNING)  # math-verify warns once per call with timeouts off
    signal.signal(signal.SIGALRM, _on_deadline)
    from math_verify import parse, verify

    # The first parse and verify build sympy's and the LaTeX grammar's lazy state (~0.2 s):
    # pay it here, before "ready", not in the middle of a training step.
    _verify_any("$1/2$", ["$0.5$"], parse, verify)
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = _answer(json.loads(line), parse, verify)
        protocol.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
