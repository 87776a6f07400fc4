"""``actor_gen`` with ``episode.name`` set: one episode per response, packed as a rollout.

The rollout keeps the keys and layout of a single-turn one (`realrl.interfaces.ppo_actor`),
so rewards, reference, critic and trainer read it unchanged:

- ``packed_input_ids`` ``[total_tokens]``: every episode's whole sequence (prompt, model
  turns, tool outputs);
- ``prompt_mask`` ``[total_tokens]``: True on every token the model did *not* sample (the
  prompt, tool outputs, template headers); the trainer's shifted loss mask is its negation
  one token on (`loss_mask_from_prompt_mask`), so tool tokens never enter the loss, across
  any packing and micro-batching;
- ``packed_logprobs`` ``[total_tokens - num_seqs]`` shifted: entry j holds the sampling
  log-prob of token j + 1 when the model sampled it, else 0;
- ``seq_no_eos_mask`` ``[num_seqs]``: the episode was cut by a budget.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from realrl.api.data import SequenceSample
from realrl.api.episode_config import EpisodeConfig
from realrl.api.registry import import_user_module
from realrl.episodes import builtin  # noqa: F401  (registers the built-in episodes)
from realrl.episodes.api import Completion, EpisodeResult, get_episode
from realrl.episodes.runner import BatchGenerate, EpisodeSettings, run_episodes
from realrl.episodes.tools import ToolBox
from realrl.episodes.turns import TurnFormat
from realrl.models.generation import generate
from realrl.models.sampling import GenerationConfig as SamplingConfig
from realrl.models.tokenizer import resolve_chat_template


class EpisodeRollout:
    """What an actor keeps between rollouts: the episode function, tools, turn format."""

    def __init__(self, config: EpisodeConfig, apply_chat_template: bool | None, tokenizer):
        if config.module:
            import_user_module(config.module)
        self.config, self.tokenizer = config, tokenizer
        self.episode = get_episode(config.name)
        self.toolbox = ToolBox(config)
        chat = resolve_chat_template(apply_chat_template, tokenizer, "the actor's tokenizer")
        self.turns = TurnFormat(tokenizer, chat)

    def run(self, engine, data: SequenceSample, sampling: SamplingConfig, episodes_per_prompt: int,
            group_size: int) -> tuple[SequenceSample, dict[str, float]]:
        """`episodes_per_prompt` episodes per prompt of `data`; the first `group_size` of each
        prompt are kept. Returns the rollout sample and its statistics."""
        if self.turns.stop_token_id is not None:
            sampling = dataclasses.replace(
                sampling, stop_token_ids=[*sampling.stop_token_ids, self.turns.stop_token_id])
        lengths = data.seqlens_of("packed_prompts")
        prompts = [ids.tolist() for ids in data.data["packed_prompts"].cpu().split(lengths)]
        indices = [i for i in range(data.bs) for _ in range(episodes_per_prompt)]
        metadata = [{key: values[i] for key, values in data.metadata.items()} for i in indices]
        settings = EpisodeSettings(self.config, self.toolbox, self.turns, self.tokenizer,
                                   sampling.max_new_tokens,
                                   engine.module.config.max_position_embeddings)
        started = time.perf_counter()
        results, round_sizes = run_episodes(self.episode, [prompts[i] for i in indices], metadata,
                                            settings, engine_batch(engine, sampling, self.tokenizer))
        elapsed_s = time.perf_counter() - started
        kept = [result for position, result in enumerate(results)
                if position % episodes_per_prompt < group_size]
        sample = pack_episodes(data, kept, group_size, self.config.name)
        return sample, episode_stats(results, round_sizes, elapsed_s)


def engine_batch(engine, sampling: SamplingConfig, tokenizer) -> BatchGenerate:
    """One round of model turns as one `generate` call on the engine's model."""

    def run(requests: list[list[int]]) -> list[Completion]:
        lengths = torch.tensor([len(ids) for ids in requests])
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
        packed = torch.tensor([token for ids in requests for token in ids], dtype=torch.long)
        output = generate(engine.module, packed, cu_seqlens, sampling, engine.generator)
        response_lens = output.response_lens.cpu().tolist()
        ends = output.cu_seqlens[1:].cpu().tolist()
        packed_ids = output.packed_input_ids.cpu()
        logprobs = output.packed_logprobs.float().cpu().split(response_lens)
        no_eos = output.no_eos.cpu().tolist()
        completions = []
        for index, length in enumerate(response_lens):
            token_ids = packed_ids[ends[index] - length: ends[index]].tolist()
            text = tokenizer.decode(token_ids, skip_special_tokens=True)
            completions.append(Completion(token_ids, logprobs[index].tolist(), text,
                                          ended=not no_eos[index]))
        return completions

    return run


def pack_episodes(data: SequenceSample, results: list[EpisodeResult], group_size: int,
                  episode_name: str) -> SequenceSample:
    """The rollout keys of the module docstring, `group_size` sequences per sample."""
    for result in results:
        lengths = {len(result.token_ids), len(result.model_mask), len(result.logprobs)}
        if len(lengths) != 1 or not result.token_ids:
            raise ValueError(
                f"episode {episode_name!r} returned token_ids, model_mask and logprobs of "
                f"lengths {len(result.token_ids)}, {len(result.model_mask)}, "
                f"{len(result.logprobs)}; they need one entry per token (use Transcript)")
    seq_lens = [len(result.token_ids) for result in results]
    seqlens = [seq_lens[i * group_size:(i + 1) * group_size] for i in range(data.bs)]
    shifted = [[length - 1 for length in sample] for sample in seqlens]
    return SequenceSample.from_tensors(
        ids=data.ids,
        seqlens={"packed_input_ids": seqlens, "prompt_mask": seqlens, "packed_logprobs": shifted,
                 "seq_no_eos_mask": [[1] * group_size for _ in range(data.bs)]},
        data={
            "packed_input_ids": torch.tensor([t for r in results for t in r.token_ids]),
            "prompt_mask": torch.tensor([not m for r in results for m in r.model_mask]),
            "packed_logprobs": torch.tensor([p for r in results for p in r.logprobs[1:]],
                                            dtype=torch.float32),
            "seq_no_eos_mask": torch.tensor([r.no_eos for r in results]),
        },
        metadata=data.metadata,
    )


def episode_stats(results: list[EpisodeResult], round_sizes: list[int],
                  elapsed_s: float) -> dict[str, float]:
    """actor_gen's statistics of an episode rollout (docs/metrics.md)."""
    count = max(len(results), 1)
    model_tokens = [sum(result.model_mask) for result in results]
    calls = sum(result.tool_calls for result in results)
    return {
        "response_length": sum(model_tokens) / count,
        "no_eos_fraction": sum(result.no_eos for result in results) / count,
        "generated_tokens_per_s": sum(model_tokens) / max(elapsed_s, 1e-9),
        "tool_call_fraction": sum(result.tool_calls > 0 for result in results) / count,
        "tool_calls_per_episode": calls / count,
        "tool_error_fraction": sum(r.tool_errors for r in results) / calls if calls else 0.0,
        "turns_per_episode": sum(result.turns for result in results) / count,
        "episode_length": sum(len(result.token_ids) for result in results) / count,
        "generation_rounds": float(len(round_sizes)),
        # Model turns per engine call: how many episodes were in flight together.
        "episodes_per_round": sum(round_sizes) / max(len(round_sizes), 1),
    }
