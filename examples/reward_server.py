"""An HTTP reward service for `reward.sources=[remote]`, standard library only.

    python examples/reward_server.py --port 8000 &
    python -m realrl.apps.quickstart ppo-math reward.sources=[remote] \\
        reward.remote.url=http://127.0.0.1:8000/score

It answers the protocol of `realrl.rewards.remote` (docs/rewards.md): a POST of
``{"items": [{"prompt", "response", "metadata"}, ...]}`` gets ``{"rewards": [...]}``, one
number per item in order. It scores the built-in arithmetic task as the rule reward does: 1
when the response's answer equals ``metadata["answer"]``, else 0; an item without an answer
scores 0. Replace `score` with a call to your own reward model or judge.

A malformed request gets HTTP 400 with the reason, and the client does not retry it; an error
inside `score` gets HTTP 500, which the client retries with back-off. With ``--token-env NAME``
it answers only requests carrying ``Authorization: Bearer $NAME`` (HTTP 401 otherwise); start
the run with the same token in a variable named by ``reward.remote.token_env``.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from realrl.rewards.math_answer import extract_answer, fast_match


def score(prompt: str, response: str, metadata: dict) -> float:
    """1.0 when the response's final answer matches the record's answer, else 0.0."""
    reference, prediction = metadata.get("answer"), extract_answer(response)
    if reference is None or prediction is None:
        return 0.0
    return 1.0 if fast_match(prediction, str(reference)) else 0.0


def score_request(body: bytes) -> list[float]:
    """The rewards of one request's body; ValueError names what is wrong with it."""
    try:
        request = json.loads(body)
    except json.JSONDecodeError as error:
        raise ValueError(f"the body is not JSON ({error.msg})") from None
    items = request.get("items") if isinstance(request, dict) else None
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError('the body must be {"items": [{"prompt", "response", "metadata"}, ...]}')
    return [score(item.get("prompt", ""), item.get("response", ""), item.get("metadata") or {})
            for item in items]


class RewardHandler(BaseHTTPRequestHandler):
    token: str | None = None  # --token-env's value: requests must carry it

    def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        expected = f"Bearer {self.token}" if self.token else None
        if expected and not hmac.compare_digest(self.headers.get("Authorization", ""), expected):
            self.answer(401, {"error": "missing or wrong Authorization: Bearer token"})
            return
        try:
            rewards = score_request(body)
        except ValueError as error:
            self.answer(400, {"error": str(error)})
            return
        except Exception as error:  # a bug in `score`: the client retries, then reports it
            self.answer(500, {"error": f"{type(error).__name__}: {error}"})
            return
        self.answer(200, {"rewards": rewards})

    def answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # one line per request, on stderr
        sys.stderr.write(f"reward server: {self.address_string()} {format % args}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--token-env", default="",
                        help="environment variable holding the token requests must carry")
    args = parser.parse_args(argv)
    if args.token_env:
        RewardHandler.token = os.environ.get(args.token_env) or parser.error(
            f"--token-env {args.token_env}: ${args.token_env} is not set or empty")
    server = ThreadingHTTPServer((args.host, args.port), RewardHandler)
    host, port = server.server_address[:2]
    print(f"reward server listening on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
