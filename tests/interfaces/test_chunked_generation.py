"""`PPOActorInterface.generate_chunk`: a rollout generated in chunks of decode steps, as the
model worker serves it with `rollout.mode=async` (`realrl.interfaces.chunked_generation`)."""

from __future__ import annotations

import pytest
import torch
from interface_helpers import build_model, make_engine, prompt_batch
from test_ppo_actor import actor_config

from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.chunked_generation import ChunkRequest
from realrl.interfaces.common import loss_mask_from_prompt_mask
from realrl.interfaces.ppo_actor import PPOActorInterface

PROMPTS = ["1+2=", "33*4=", "7-1="]


def _chunked(actor, engine, prompts, versions: list[int], session="s"):
    """One chunk of 2 decode steps per entry of `versions` (the last to the end)."""
    results = []
    for index, version in enumerate(versions):
        steps = 0 if index == len(versions) - 1 else 2
        request = ChunkRequest(session, steps, version, "recompute")
        results.append(actor.generate_chunk(engine, prompts if index == 0 else None,
                                            MicroBatchSpec(), request))
    assert all(result is None for result in results[:-1])
    return results[-1]


def test_chunks_give_the_rollout_of_one_call_with_every_tokens_version(tokenizer):
    config = actor_config(group_size=3, generation_size=4, max_new_tokens=8)
    prompts = prompt_batch(tokenizer, PROMPTS, {"answer": ["3", "132", "6"]})
    whole = PPOActorInterface(config).generate(
        make_engine(build_model(len(tokenizer)), tokenizer, lr=None), prompts, MicroBatchSpec())
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    chunked = _chunked(PPOActorInterface(config), engine, prompts, [7, 7, 7])
    rollout = chunked.data
    for key in whole.data.keys:
        assert torch.equal(rollout.data[key], whole.data.data[key]), key
    assert rollout.metadata == whole.data.metadata
    # Versions are shifted like the log-probs: -1 where the next token is a prompt token.
    versions = rollout.data["packed_weight_versions"]
    assert rollout.seqlens["packed_weight_versions"] == rollout.seqlens["packed_logprobs"]
    loss_mask = loss_mask_from_prompt_mask(rollout.data["prompt_mask"],
                                           rollout.cu_seqlens("packed_input_ids"))
    assert versions[loss_mask].eq(7).all() and versions[~loss_mask].eq(-1).all()
    assert chunked.stats["weight_updates"] == 0.0


def test_a_new_version_between_chunks_is_recorded_from_the_next_token_on(tokenizer):
    config = actor_config(group_size=2, max_new_tokens=8)
    config.generation.min_new_tokens = 8  # every response runs through both versions
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    prompts = prompt_batch(tokenizer, PROMPTS)
    result = _chunked(PPOActorInterface(config), engine, prompts, [3, 4])
    rollout = result.data
    loss_mask = loss_mask_from_prompt_mask(rollout.data["prompt_mask"],
                                           rollout.cu_seqlens("packed_input_ids"))
    per_response = rollout.data["packed_weight_versions"][loss_mask].view(-1, 8)
    # The prefill's token and the first chunk's 2 steps ran on version 3, the rest on 4.
    assert per_response[:, :3].eq(3).all() and per_response[:, 3:].eq(4).all()
    assert result.stats["weight_updates"] == 1.0


def test_a_chunk_of_an_unknown_session_without_prompts_names_the_problem(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    actor = PPOActorInterface(actor_config())
    with pytest.raises(ValueError, match="no session 'lost'"):
        actor.generate_chunk(engine, None, MicroBatchSpec(), ChunkRequest("lost", 2, 0, "keep"))
