"""Many episodes at once on one generation worker, their model turns batched into one call.

Every episode is a task on one asyncio event loop. A model turn (`EpisodeEnv.generate`)
queues a request with the `GenerationBatcher`; when every live episode either waits for one
or has finished, the batcher runs all waiting requests as one batched engine call (a *round*)
and wakes them. Python tool calls run meanwhile in worker threads, each in its sandboxed
process, at most ``episode.max_parallel_tools`` at once; a round waits for them, so the
batches, and with them the random draws of the sampler, depend only on the episodes and the
seed, never on timing: the same seed gives the same rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from realrl.api.episode_config import EpisodeConfig
from realrl.episodes.api import Completion, EpisodeFunction, EpisodeResult
from realrl.episodes.tools import ToolBox, ToolOutput
from realrl.episodes.turns import TurnFormat

# Runs one round: prompt token ids per request -> one completion per request, in order.
BatchGenerate = Callable[[list[list[int]]], list[Completion]]


class GenerationBatcher:
    def __init__(self, generate_batch: BatchGenerate, num_episodes: int) -> None:
        self.generate_batch = generate_batch
        self.live = num_episodes
        self.pending: dict[int, tuple[list[int], asyncio.Future]] = {}
        self.round_sizes: list[int] = []

    async def generate(self, episode_index: int, token_ids: list[int]) -> Completion:
        if episode_index in self.pending:
            raise RuntimeError(f"episode {episode_index} asked for a second model turn before "
                               "its first returned; await env.generate before calling it again")
        future = asyncio.get_running_loop().create_future()
        self.pending[episode_index] = (list(token_ids), future)
        self._run_round_if_ready()
        return await future

    def finish(self) -> None:
        self.live -= 1
        self._run_round_if_ready()

    def _run_round_if_ready(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        requests = [self.pending[index] for index in sorted(self.pending)]
        self.pending = {}
        self.round_sizes.append(len(requests))
        try:
            completions = self.generate_batch([token_ids for token_ids, _ in requests])
        except Exception as error:
            for _, future in requests:
                future.set_exception(error)
            return
        for (_, future), completion in zip(requests, completions):
            future.set_result(completion)


@dataclass
class EpisodeSettings:
    """What every episode of one rollout shares, besides the batcher."""

    config: EpisodeConfig
    toolbox: ToolBox
    turns: TurnFormat
    tokenizer: object
    max_new_tokens: int  # per model turn
    max_context: int  # the model's max_position_embeddings


@dataclass
class _Shared:
    settings: EpisodeSettings
    batcher: GenerationBatcher
    tool_slots: asyncio.Semaphore  # python tool calls running at once


class EpisodeEnv:
    """An episode's view of the rollout: its prompt and metadata, the model, the tools."""

    def __init__(self, index: int, prompt_ids: list[int], metadata: dict, shared: _Shared):
        self.index, self.prompt_ids, self.metadata = index, list(prompt_ids), metadata
        self._shared, settings = shared, shared.settings
        self.config, self.tokenizer, self.turns = settings.config, settings.tokenizer, settings.turns

    async def generate(self, token_ids: list[int]) -> Completion:
        """One model turn continuing `token_ids` (at most gen.max_new_tokens tokens)."""
        return await self._shared.batcher.generate(self.index, token_ids)

    async def call_tool(self, text: str) -> ToolOutput | None:
        """Run the tool call of a model turn's `text`; None when the turn calls no tool. A
        malformed call or a failing tool gives an output whose text is the error."""
        toolbox = self._shared.settings.toolbox
        call = toolbox.parse(text)
        if call is None:
            return None
        if not toolbox.blocks(call):
            return toolbox.run(call)
        async with self._shared.tool_slots:
            return await asyncio.to_thread(toolbox.run, call)

    def tool_turn_ids(self, output: ToolOutput) -> list[int]:
        """A tool's output as the tokens that follow the model turn that called it."""
        return self.turns.tool_turn_ids(output.text)

    def user_turn_ids(self, text: str) -> list[int]:
        """The environment's words to the model, as the tokens of a user turn."""
        return self.turns.user_turn_ids(text)

    def fits(self, num_tokens: int) -> bool:
        """Whether a model turn after `num_tokens` tokens stays within the model's context."""
        settings = self._shared.settings
        return num_tokens + settings.max_new_tokens <= settings.max_context


def run_episodes(episode: EpisodeFunction, prompts: list[list[int]], metadata: list[dict],
                 settings: EpisodeSettings, generate_batch: BatchGenerate
                 ) -> tuple[list[EpisodeResult], list[int]]:
    """Run `episode` once per prompt, all at once; returns the results in prompt order and
    the number of model turns in every generation round."""
    batcher = GenerationBatcher(generate_batch, len(prompts))
    # A semaphore binds to the loop that first waits on it: the one asyncio.run makes below.
    shared = _Shared(settings, batcher, asyncio.Semaphore(settings.config.max_parallel_tools))

    async def run_one(index: int) -> EpisodeResult:
        try:
            return await episode(EpisodeEnv(index, prompts[index], metadata[index], shared))
        finally:
            batcher.finish()

    async def run_all() -> list[EpisodeResult]:
        return list(await asyncio.gather(*(run_one(index) for index in range(len(prompts)))))

    return asyncio.run(run_all()), batcher.round_sizes
