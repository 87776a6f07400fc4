"""The HTTP reward client against a real local server (http.server in a thread): batching,
retries with exponential back-off, and errors that name the URL, what went wrong and the fix.

The server answers each request by the next entry of its script (an HTTP status, a body, or
a delay past the client's timeout), then with the default answer; it records every request.
The back-off is checked on the waits the client asks for (its `sleep`), not on a clock.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from realrl.rewards.remote import RemoteRewardClient, RemoteRewardError

ITEMS = [{"prompt": "1+2=", "response": f"{n}", "metadata": {"answer": "3"}} for n in range(5)]


class ScriptedServer:
    """A reward service on a free local port; `script` entries: ("ok",), ("status", code),
    ("body", bytes), ("hang", seconds). Past the script it answers ("ok",): reward = the
    response's length."""

    def __init__(self, script=()):
        self.script, self.requests, self.authorizations = list(script), [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.authorizations.append(self.headers.get("Authorization"))
                action = server.script.pop(0) if server.script else ("ok",)
                if action[0] == "hang":
                    time.sleep(action[1])
                    return
                if action[0] == "status":
                    self._send(action[1], b"overloaded, try later")
                elif action[0] == "body":
                    self._send(200, action[1])
                else:
                    rewards = [float(len(item["response"])) for item in body["items"]]
                    self._send(200, json.dumps({"rewards": rewards}).encode())

            def _send(self, status, data):
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def client(url, waits=None, **options):
    settings = {"timeout_s": 2.0, "max_retries": 3, "backoff_s": 0.01} | options
    return RemoteRewardClient(url, sleep=(waits.append if waits is not None else time.sleep),
                              **settings)


def test_one_request_carries_every_item_and_rewards_come_back_in_order():
    with ScriptedServer() as server:
        rewards = client(server.url).score(ITEMS)
    assert rewards == [1.0] * 5
    assert server.requests == [{"items": ITEMS}]


def test_max_items_per_request_splits_the_batch_in_order():
    items = [{"prompt": "p", "response": "x" * n, "metadata": {}} for n in range(5)]
    with ScriptedServer() as server:
        rewards = client(server.url, max_items_per_request=2).score(items)
    assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [len(request["items"]) for request in server.requests] == [2, 2, 1]


def test_a_server_error_is_retried_with_doubling_waits_until_it_answers():
    waits = []
    with ScriptedServer([("status", 503), ("status", 500), ("status", 429)]) as server:
        remote = client(server.url, waits, backoff_s=0.5)
        assert remote.score(ITEMS[:2]) == [1.0, 1.0]
    assert waits == [0.5, 1.0, 2.0]  # backoff_s, then twice as long each time
    assert len(server.requests) == 4 and remote.retries == 3


def test_past_its_retries_the_error_names_the_url_the_status_and_the_fix():
    waits = []
    with ScriptedServer([("status", 503)] * 3) as server:
        with pytest.raises(RemoteRewardError) as error:
            client(server.url, waits, max_retries=2, backoff_s=0.25).score(ITEMS)
    message = str(error.value)
    assert server.url in message and "3 tries" in message and "max_retries=2" in message
    assert "HTTP 503" in message and "overloaded, try later" in message
    assert "Fix: the service failed on its side" in message
    assert waits == [0.25, 0.5] and len(server.requests) == 3


def test_a_timeout_is_retried_then_reported_with_the_timeout_key():
    waits = []
    with ScriptedServer([("hang", 1.0), ("hang", 1.0)]) as server:
        with pytest.raises(RemoteRewardError) as error:
            client(server.url, waits, timeout_s=0.2, max_retries=1).score(ITEMS)
    message = str(error.value)
    assert server.url in message and "timed out after 0.2 s" in message
    assert "reward.remote.timeout_s" in message
    assert waits == [0.01] and len(server.requests) == 2


def test_a_timeout_then_an_answer_succeeds():
    with ScriptedServer([("hang", 1.0)]) as server:
        assert client(server.url, timeout_s=0.2).score(ITEMS[:1]) == [1.0]


@pytest.mark.parametrize(("body", "problem"), [
    (b"<html>502 Bad Gateway</html>", "its answer is not JSON: '<html>502 Bad Gateway</html>'"),
    (b'{"scores": [1, 2]}', 'its answer has no "rewards" list'),
    (b'{"rewards": [1.0]}', "its answer holds 1 rewards for 5 items"),
    (b'{"rewards": [1, 2, "three", 4, 5]}', "its reward 2 is 'three', not a number"),
])
def test_a_malformed_answer_fails_at_once_naming_the_url_and_the_protocol(body, problem):
    waits = []
    with ScriptedServer([("body", body)]) as server:
        with pytest.raises(RemoteRewardError) as error:
            client(server.url, waits).score(ITEMS)
    message = str(error.value)
    assert server.url in message and problem in message and "1 try (not retried)" in message
    assert '{"rewards": [number, ...]}' in message  # the fix: what the service must answer
    assert waits == [] and len(server.requests) == 1


def test_a_client_error_status_is_not_retried():
    with ScriptedServer([("status", 404)]) as server:
        with pytest.raises(RemoteRewardError) as error:
            client(server.url).score(ITEMS)
    assert "HTTP 404" in str(error.value) and "check reward.remote.url" in str(error.value)
    assert len(server.requests) == 1


def test_nothing_listening_is_retried_then_reported_as_cannot_connect():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/score"
    waits = []
    with pytest.raises(RemoteRewardError) as error:
        client(url, waits, max_retries=2).score(ITEMS)
    message = str(error.value)
    assert url in message and "cannot connect" in message and "start the reward service" in message
    assert waits == [0.01, 0.02]


def test_a_token_from_the_named_variable_goes_in_every_request(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", "abc123")
    with ScriptedServer() as server:
        client(server.url, token_env="REWARD_TOKEN_FOR_TEST", max_items_per_request=2).score(ITEMS)
    assert server.authorizations == ["Bearer abc123"] * 3
    with ScriptedServer() as server:
        client(server.url).score(ITEMS)
    assert server.authorizations == [None]


@pytest.mark.parametrize("value", [None, "  "])
def test_an_unset_or_empty_token_variable_is_named_before_any_request(monkeypatch, value):
    monkeypatch.delenv("REWARD_TOKEN_FOR_TEST", raising=False)
    if value is not None:
        monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", value)
    with pytest.raises(RemoteRewardError) as error:
        client("http://127.0.0.1:9/score", token_env="REWARD_TOKEN_FOR_TEST")
    message = str(error.value)
    assert "$REWARD_TOKEN_FOR_TEST is " + ("not set" if value is None else "empty") in message
    assert "export REWARD_TOKEN_FOR_TEST=<token>" in message


@pytest.mark.parametrize("token_env", ["", "REWARD_TOKEN_FOR_TEST"])
def test_a_refused_credential_is_not_retried_and_names_the_token_variable(monkeypatch, token_env):
    monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", "wrong")
    with ScriptedServer([("status", 401)]) as server:
        with pytest.raises(RemoteRewardError) as error:
            client(server.url, token_env=token_env).score(ITEMS)
    assert len(server.requests) == 1
    message = str(error.value)
    assert "HTTP 401" in message
    if token_env:
        assert "refused the token in $REWARD_TOKEN_FOR_TEST (reward.remote.token_env)" in message
    else:
        assert "name that variable in reward.remote.token_env" in message
