"""What an episode is: an async function registered by name, and the record it returns.

An episode turns one prompt into one token sequence by alternating model turns
(``await env.generate(ids)``) with tool turns (``await env.call_tool(text)``), and returns an
`EpisodeResult`: the tokens and a per-token mask of the ones the model sampled. Only those
carry log-probs and enter the loss: in the packed rollout, every other token (prompt, tool
output, chat-template headers) is marked like a prompt token (`realrl.episodes.rollout`).

    @register_episode("my_episode")
    async def my_episode(env: EpisodeEnv) -> EpisodeResult:
        transcript = Transcript(env.prompt_ids)
        transcript.add_model(await env.generate(transcript.ids))
        return transcript.result()

`episode.name` picks one; `episode.module` names the module (or .py file) that registers
it when it is not built in. Many episodes run at once on the generation worker's event loop;
their model turns are batched into one engine call (`realrl.episodes.runner`).
"""

from __future__ import annotations

import difflib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from realrl.episodes.runner import EpisodeEnv
    from realrl.episodes.tools import ToolOutput

EpisodeFunction = Callable[["EpisodeEnv"], Awaitable["EpisodeResult"]]
_EPISODES: dict[str, EpisodeFunction] = {}


def register_episode(name: str) -> Callable[[EpisodeFunction], EpisodeFunction]:
    """Register an ``async def episode(env) -> EpisodeResult`` as `name` (``episode.name``)."""

    def decorator(function: EpisodeFunction) -> EpisodeFunction:
        existing = _EPISODES.get(name)
        if existing is not None and existing is not function:
            raise ValueError(f"episode {name!r} is already registered by "
                             f"{existing.__module__}.{existing.__qualname__}")
        _EPISODES[name] = function
        return function

    return decorator


def get_episode(name: str) -> EpisodeFunction:
    if name not in _EPISODES:
        close = difflib.get_close_matches(name, list(_EPISODES), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"`episode.name={name}` is not a registered episode.{hint} Registered: "
            f"{', '.join(sorted(_EPISODES))}; an episode of your own needs `episode.module` "
            "naming the module that registers it with @register_episode."
        )
    return _EPISODES[name]


def registered_episodes() -> list[str]:
    return sorted(_EPISODES)


@dataclass
class Completion:
    """One model turn: the sampled tokens (the stop token included when it ended with one)."""

    token_ids: list[int]
    logprobs: list[float]  # per sampled token, under the unmodified distribution
    text: str  # decoded without special tokens
    ended: bool  # ended with a stop token (False: hit gen.max_new_tokens)


@dataclass
class EpisodeResult:
    """One episode's sequence. ``token_ids``, ``model_mask`` and ``logprobs`` have one entry
    per token; ``logprobs`` is 0 where ``model_mask`` is False."""

    token_ids: list[int]
    model_mask: list[bool]
    logprobs: list[float]
    no_eos: bool  # cut by a budget (turns, tokens, context) instead of ending with an answer
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 0


@dataclass
class Transcript:
    """Builds an `EpisodeResult` turn by turn; the prompt is not the model's."""

    prompt_ids: list[int]
    ids: list[int] = field(init=False)
    model_mask: list[bool] = field(init=False)
    logprobs: list[float] = field(init=False)
    no_eos: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 0

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_ids)
        self.model_mask = [False] * len(self.ids)
        self.logprobs = [0.0] * len(self.ids)

    def add_model(self, completion: Completion) -> None:
        self.ids += completion.token_ids
        self.model_mask += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.turns += 1
        self.no_eos = not completion.ended

    def add_tool(self, token_ids: list[int], output: ToolOutput) -> None:
        """A tool call's output turn (`EpisodeEnv.tool_turn_ids`), counted in the metrics."""
        self.add_other(token_ids)
        self.tool_calls += 1
        self.tool_errors += not output.ok

    def add_other(self, token_ids: list[int]) -> None:
        """Tokens the model did not write, such as the environment's feedback
        (`EpisodeEnv.user_turn_ids`): no log-probs, never in the loss."""
        self.ids += token_ids
        self.model_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def result(self) -> EpisodeResult:
        return EpisodeResult(self.ids, self.model_mask, self.logprobs, self.no_eos,
                             self.tool_calls, self.tool_errors, self.turns)
