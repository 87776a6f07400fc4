"""A client of an HTTP reward service (`reward.sources=[remote]`): batched JSON POSTs with a
timeout and bounded retries with exponential back-off, standard library only.

The protocol (docs/rewards.md; `examples/reward_server.py` implements it)::

    POST <url>   Content-Type: application/json
    {"items": [{"prompt": str, "response": str, "metadata": {...}}, ...]}

    200  {"rewards": [number, ...]}   # one per item, in the order of the items

A request that times out (`timeout_s` for the connection and for each read of the answer),
cannot connect, is cut off, or gets HTTP 408, 429 or 5xx is sent again after `backoff_s`,
then twice as long each time, at most `max_retries` times; after the last one
`RemoteRewardError` names the URL, what went wrong and what to do. An answer that is not the
JSON above, or another HTTP status (404, 400, ...), fails at once: sending the same request
again would get the same answer. With a token (`reward.remote.token_env` names the environment
variable holding it) every request carries ``Authorization: Bearer <token>``; HTTP 401 or 403
then names that variable.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from realrl.api.errors import UserFacingError

logger = logging.getLogger(__name__)

EXCERPT_CHARS = 200  # of a bad answer's body, quoted in errors


class RemoteRewardError(UserFacingError):
    """The reward service could not score a batch; the message names the URL and the fix."""


@dataclass(frozen=True)
class _Failure:
    reason: str  # what happened, e.g. "timed out after 2 s"
    fix: str
    retryable: bool


TIMEOUT_FIX = ("check that the service is up and answers a batch within "
               "reward.remote.timeout_s, or raise reward.remote.timeout_s or "
               "reward.remote.max_retries")
CONNECT_FIX = "start the reward service, or set reward.remote.url to where it listens"
SERVER_FIX = "the service failed on its side: see its log"
PROTOCOL_FIX = ('the service must answer HTTP 200 with {"rewards": [number, ...]}, one number per '
                'item in the order of the items (docs/rewards.md)')


class RemoteRewardClient:
    """Scores (prompt, response, metadata) items at `url`; `retries` counts the requests sent
    again since the client was made (for statistics). `sleep` waits between tries."""

    def __init__(self, url: str, timeout_s: float, max_retries: int, backoff_s: float,
                 max_items_per_request: int | None = None, token_env: str = "",
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.max_items_per_request = max_items_per_request
        self.token_env = token_env
        self.headers = {"Content-Type": "application/json", "User-Agent": "realrl-reward-client"}
        if token_env:
            self.headers["Authorization"] = f"Bearer {_token(token_env, url)}"
        self.sleep = sleep
        self.retries = 0

    def score(self, items: list[dict]) -> list[float]:
        """One reward per item, in order; requests of at most `max_items_per_request` items."""
        size = self.max_items_per_request or max(1, len(items))
        rewards: list[float] = []
        for start in range(0, len(items), size):
            rewards += self._score_batch(items[start:start + size])
        return rewards

    def _score_batch(self, items: list[dict]) -> list[float]:
        body = json.dumps({"items": items}).encode("utf-8")
        started = time.monotonic()
        tries = 0
        while True:
            tries += 1
            outcome = self._try(body, len(items))
            if isinstance(outcome, list):
                return outcome
            if not outcome.retryable or tries > self.max_retries:
                break
            delay = self.backoff_s * 2 ** (tries - 1)
            logger.warning("reward service %s: %s; retry %d of %d in %.3g s", self.url,
                           outcome.reason, tries, self.max_retries, delay)
            self.sleep(delay)
            self.retries += 1
        how = (f"{tries} tries in {time.monotonic() - started:.1f} s (reward.remote.max_retries="
               f"{self.max_retries})" if outcome.retryable else "1 try (not retried)")
        raise RemoteRewardError(
            f"the reward service at {self.url} did not score a batch of {len(items)} "
            f"response(s) after {how}: {outcome.reason}. Fix: {outcome.fix}"
        )

    def _try(self, body: bytes, num_items: int) -> list[float] | _Failure:
        """One request: the rewards, or what went wrong."""
        answer = self._post(body)
        return answer if isinstance(answer, _Failure) else _parse_rewards(answer, num_items)

    def _post(self, body: bytes) -> bytes | _Failure:
        """The answer's body on HTTP 200, else what went wrong."""
        request = urllib.request.Request(self.url, data=body, method="POST", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            excerpt = _excerpt(error.read())
            retryable = error.code in (408, 429) or error.code >= 500
            fix = (SERVER_FIX if error.code >= 500 else TIMEOUT_FIX if retryable else
                   self._auth_fix() if error.code in (401, 403) else
                   "check reward.remote.url (host, port and path) and that the service takes "
                   'POST {"items": [...]} (docs/rewards.md)')
            return _Failure(f"HTTP {error.code} {error.reason}: {excerpt}", fix, retryable)
        except urllib.error.URLError as error:
            if isinstance(error.reason, TimeoutError):
                return _Failure(f"timed out after {self.timeout_s:g} s", TIMEOUT_FIX, True)
            return _Failure(f"cannot connect ({error.reason})", CONNECT_FIX, True)
        except TimeoutError:  # while reading the answer
            return _Failure(f"timed out after {self.timeout_s:g} s", TIMEOUT_FIX, True)
        except (http.client.HTTPException, OSError) as error:  # reset, closed, TLS, ...
            reason = f"the connection broke ({type(error).__name__}: {error})"
            return _Failure(reason, SERVER_FIX, True)


    def _auth_fix(self) -> str:
        if not self.token_env:
            return ("the service wants credentials: put its token in an environment variable "
                    "and name that variable in reward.remote.token_env")
        return (f"the service refused the token in ${self.token_env} "
                "(reward.remote.token_env): check that it is valid for this service")


def _token(token_env: str, url: str) -> str:
    """The token in environment variable `token_env`; an error naming it when unset or empty."""
    token = os.environ.get(token_env, "").strip()
    if not token:
        raise RemoteRewardError(
            f"reward.remote.token_env={token_env}, but ${token_env} is "
            f"{'empty' if token_env in os.environ else 'not set'} in this process, so requests "
            f"to {url} cannot carry a token. Fix: export {token_env}=<token> in the shell that "
            "starts the run (workers inherit it; under SLURM, sbatch exports it by default)")
    return token


def _parse_rewards(body: bytes, num_items: int) -> list[float] | _Failure:
    """The rewards of an answer's body, or why it is not a valid answer."""
    try:
        answer = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _Failure(f"its answer is not JSON: {_excerpt(body)}", PROTOCOL_FIX, False)
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list):
        return _Failure(f'its answer has no "rewards" list: {_excerpt(body)}', PROTOCOL_FIX, False)
    if len(rewards) != num_items:
        return _Failure(f"its answer holds {len(rewards)} rewards for {num_items} items",
                        PROTOCOL_FIX, False)
    bad = [index for index, value in enumerate(rewards)
           if isinstance(value, bool) or not isinstance(value, (int, float))]
    if bad:
        return _Failure(f"its reward {bad[0]} is {rewards[bad[0]]!r}, not a number",
                        PROTOCOL_FIX, False)
    return [float(value) for value in rewards]


def _excerpt(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return repr(text[:EXCERPT_CHARS] + ("..." if len(text) > EXCERPT_CHARS else ""))
