"""Episodes inside actor_gen on a real tiny model: masks, log-probs, training across
micro-batches, concurrency and determinism, hostile and malformed tool calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from episode_helpers import actor, prompt_batch, rollout, tiny_engine

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.common import loss_mask_from_prompt_mask, shifted_logprobs

PROMPTS = ["12*34=", "5*6=", "417*386="]


def sequences(sample: SequenceSample, key: str = "packed_input_ids"):
    return sample.data[key].split(sample.seqlens_of("packed_input_ids"))


def test_tool_tokens_are_marked_like_the_prompt_and_model_tokens_are_not(tokenizer):
    data = prompt_batch(tokenizer, PROMPTS, ["calc(2*3)"] * 3)
    result = rollout(tokenizer, data, group_size=2)
    sample = result.data
    for index, (ids, not_model) in enumerate(zip(sequences(sample),
                                                 sequences(sample, "prompt_mask"))):
        # Not the model's: exactly the prompt and the tool turn `out(6)`, in that order.
        assert tokenizer.decode(ids[not_model]) == PROMPTS[index // 2] + "out(6)"
        assert (~not_model).sum() > 0
    assert result.stats["tool_call_fraction"] == 1.0
    assert result.stats["turns_per_episode"] == 2.0


def test_log_probs_are_the_models_on_its_tokens_and_zero_on_the_others(tokenizer):
    data = prompt_batch(tokenizer, PROMPTS, ["calc(2*3)"] * 3)
    sample = rollout(tokenizer, data, group_size=2).data
    loss_mask = loss_mask_from_prompt_mask(sample.data["prompt_mask"],
                                           sample.cu_seqlens("packed_input_ids"))
    recomputed = shifted_logprobs(tiny_engine(tokenizer), sample, MicroBatchSpec(),
                                  "recomputed").data["recomputed"]
    generated = sample.data["packed_logprobs"]
    # Prefill and decode compute the same numbers in a different order: fp32 rounding apart.
    torch.testing.assert_close(generated[loss_mask], recomputed[loss_mask], atol=1e-4, rtol=0)
    assert (generated[~loss_mask] == 0).all()
    assert (recomputed[~loss_mask] != 0).all()  # the tool tokens had somewhere to leak from


def train_once(tokenizer, sample: SequenceSample, max_tokens_per_microbatch: int | None):
    engine = tiny_engine(tokenizer, lr=1e-2)
    microbatch = MicroBatchSpec(max_tokens_per_microbatch=max_tokens_per_microbatch)
    stats = actor(group_size=2).train_step(engine, sample, microbatch).stats
    return stats, [p.detach().clone() for p in engine.module.parameters()]


def test_training_on_episodes_ignores_tool_tokens_across_micro_batches(tokenizer):
    data = prompt_batch(tokenizer, PROMPTS, ["calc(2*3)", "calc(1+", "python(print(6))"])
    sample = rollout(tokenizer, data, group_size=2).data
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    sample.update_(SequenceSample.from_tensors(
        ids=sample.ids, seqlens={"rewards": [[1, 1]] * 3}, data={"rewards": rewards}))
    whole, whole_params = train_once(tokenizer, sample, None)
    # The generation's log-probs against the trainer's own: the ratio starts at exactly 1 only
    # if every token in the loss is a model token.
    assert whole["importance_ratio"] == pytest.approx(1.0, abs=1e-4)
    split, split_params = train_once(tokenizer, sample, 12)  # a micro-batch per sequence
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    for expected, actual in zip(whole_params, split_params):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    # Whatever the non-model positions hold, the step is the same.
    loss_mask = loss_mask_from_prompt_mask(sample.data["prompt_mask"],
                                           sample.cu_seqlens("packed_input_ids"))
    garbage = dataclasses.replace(sample)
    garbage.data = {**sample.data, "packed_logprobs": torch.where(
        loss_mask, sample.data["packed_logprobs"], torch.full_like(loss_mask, -7.0, dtype=float))}
    _, garbage_params = train_once(tokenizer, garbage, None)
    for expected, actual in zip(whole_params, garbage_params):
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_many_episodes_run_concurrently_in_batched_rounds(tokenizer):
    prompts = [f"{a}*{a + 3}=" for a in range(10, 22)]  # 12 prompts x 2 episodes
    data = prompt_batch(tokenizer, prompts, ["python(print(6))"] * len(prompts))
    result = rollout(tokenizer, data, group_size=2)
    # Two model turns each, and every engine call served all 24 episodes at once: their python
    # calls (24 sandboxed processes, 2 at a time) sat between the two rounds.
    assert result.stats["generation_rounds"] == 2.0
    assert result.stats["episodes_per_round"] == 24.0
    assert result.stats["tool_error_fraction"] == 0.0


def test_the_same_seed_gives_the_same_episodes(tokenizer):
    prompts = [f"{a}*{a + 3}=" for a in range(10, 18)]
    data = prompt_batch(tokenizer, prompts, ["calc(2*3)", "python(print(6))"] * 4)
    first = rollout(tokenizer, data, group_size=2, seed=3).data
    again = rollout(tokenizer, data, group_size=2, seed=3).data
    other = rollout(tokenizer, data, group_size=2, seed=4).data
    for key in ("packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask"):
        assert torch.equal(first.data[key], again.data[key]), key
    assert not torch.equal(first.data["packed_input_ids"], other.data["packed_input_ids"])


HOSTILE_CALLS = {
    "python(while True: pass)": "out(error: timeout)",
    "python(print('x' * 10**9))": "out(error: ",  # output limit, or memory
    "python(exec('import os\\nwhile True:\\n    try: os.fork()\\n    except OSError: pass'))":
        "out(error: ",
    "calc(1+": "out(error: calc( is not closed",
    "calcp(2*3)": "out(error: unknown tool calcp",
}


def test_hostile_and_malformed_calls_end_as_error_outputs_and_the_episode_goes_on(tokenizer):
    calls = list(HOSTILE_CALLS)
    data = prompt_batch(tokenizer, ["12*34="] * len(calls), calls)
    result = rollout(tokenizer, data, group_size=1, max_tool_output_chars=30)
    assert result.stats["turns_per_episode"] == 2.0  # every episode took its second turn
    assert result.stats["tool_error_fraction"] == 1.0
    sample = result.data
    for ids, not_model, expected in zip(sequences(sample), sequences(sample, "prompt_mask"),
                                        HOSTILE_CALLS.values()):
        tool_ids = ids[not_model][len("12*34="):]  # one token per character
        assert tokenizer.decode(tool_ids).startswith(expected), tokenizer.decode(tool_ids)
        assert len(tool_ids) <= len("out()") + 30  # episode.max_tool_output_chars
