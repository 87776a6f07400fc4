"""A test episode that always calls the tool its sample names, a tiny model's engine, and a
prompt batch (a module of its own, not conftest.py, so tests can import it)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.episode_config import EpisodeConfig
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters
from realrl.episodes import EpisodeEnv, EpisodeResult, Transcript, register_episode
from realrl.interfaces.configs import PPOActorConfig
from realrl.interfaces.ppo_actor import PPOActorInterface

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interfaces"))
from interface_helpers import build_model, make_engine  # noqa: E402


@register_episode("test_forced_tool")
async def forced_tool(env: EpisodeEnv) -> EpisodeResult:
    """Model turn, the tool call of the sample's `call` metadata whatever the model wrote, its
    output, another model turn: every sequence holds tool tokens between model tokens."""
    transcript = Transcript(env.prompt_ids)
    transcript.add_model(await env.generate(transcript.ids))
    output = await env.call_tool(env.metadata["call"])
    transcript.add_tool(env.tool_turn_ids(output), output)
    transcript.add_model(await env.generate(transcript.ids))
    return transcript.result()


def prompt_batch(tokenizer, prompts: list[str], calls: list[str]) -> SequenceSample:
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    return SequenceSample.from_default(
        ids=[f"q{i}" for i in range(len(prompts))],
        seqlens=[len(ids) for ids in encoded],
        data={"packed_prompts": torch.tensor([t for ids in encoded for t in ids])},
        metadata={"call": calls, "answer": ["6"] * len(prompts), "task": ["math"] * len(prompts)},
    )


def actor(group_size: int, episode: str = "test_forced_tool", max_new_tokens: int = 6,
          **episode_options) -> PPOActorInterface:
    ppo = PPOHyperparameters(adv_estimator="grpo", disable_value=True, kl_ctl=0.0)
    return PPOActorInterface(PPOActorConfig(
        ppo=ppo, generation=GenerationHyperparameters(max_new_tokens=max_new_tokens),
        group_size=group_size, generation_size=group_size,
        episode=EpisodeConfig(name=episode, tool_timeout_s=2.0, tool_memory_mb=256,
                              **episode_options)))


def tiny_engine(tokenizer, seed: int = 0, lr: float | None = None):
    """The same tiny model every time; `seed` seeds its sampler. A large Adam eps keeps the
    rounding noise of nearly zero gradients from becoming lr-sized steps (parity tests)."""
    return make_engine(build_model(len(tokenizer), seed=0), tokenizer, lr=lr, seed=seed,
                       adam_eps=1e-3)


def rollout(tokenizer, data: SequenceSample, group_size: int, seed: int = 0, **options):
    interface = actor(group_size, **options)
    return interface.generate(tiny_engine(tokenizer, seed), data, MicroBatchSpec())
