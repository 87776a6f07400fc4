import pytest
import torch

from realrl.api.data import SequenceSample
from realrl.api.experiment import RolloutFilter
from realrl.workers.rollout_filter import (
    apply_rollout_filter,
    discarded_by_filter,
    select_sequences,
)


def rollouts(rewards_per_prompt):
    """Prompt i has len(rewards_per_prompt[i]) responses; response j of prompt i has length
    i + j + 1 and token values 100 * i + j, so every kept slice is recognisable."""
    ids, token_chunks, seqlens, flags = [], [], [], []
    for i, rewards in enumerate(rewards_per_prompt):
        ids.append(f"q{i}")
        lengths = [i + j + 1 for j in range(len(rewards))]
        seqlens.append(lengths)
        token_chunks += [torch.full((n,), 100 * i + j) for j, n in enumerate(lengths)]
        flags.append([1] * len(rewards))
    return SequenceSample.from_tensors(
        ids=ids,
        seqlens={"packed_input_ids": seqlens, "rewards": flags,
                 "packed_prompts": [[2]] * len(ids)},
        data={"packed_input_ids": torch.cat(token_chunks),
              "rewards": torch.tensor([r for rs in rewards_per_prompt for r in rs]),
              "packed_prompts": torch.zeros(2 * len(ids), dtype=torch.long)},
        metadata={"answer": [str(i) for i in range(len(ids))]},
    )


def test_select_sequences_keeps_the_chosen_responses_of_each_prompt():
    sample = rollouts([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    kept = select_sequences(sample, [[1], [0, 2]], ["packed_input_ids", "rewards"])
    assert kept.seqlens["packed_input_ids"] == [[2], [2, 4]]
    # prompt 0 response 1: length 2, value 1; prompt 1 responses 0 and 2: values 100, 102
    assert kept.data["packed_input_ids"].tolist() == [1, 1, 100, 100, 102, 102, 102, 102]
    assert kept.data["rewards"].tolist() == [1.0, 1.0, 0.0]
    assert kept.data["packed_prompts"].numel() == 4  # per-prompt keys are untouched
    assert kept.metadata == sample.metadata


def test_best_of_n_keeps_the_highest_rewards_in_generation_order():
    sample = rollouts([[0.0, 1.0, 0.5, 1.0], [0.2, 0.1, 0.3, 0.0]])
    kept, stats = apply_rollout_filter(sample, RolloutFilter("rew_inf", group_size=2))
    # prompt 0: best two are responses 1 and 3 (1.0, 1.0); prompt 1: responses 0 and 2
    assert kept.data["rewards"].tolist() == pytest.approx([1.0, 1.0, 0.2, 0.3])
    assert kept.seqlens["packed_input_ids"] == [[2, 4], [2, 4]]
    assert stats["rollout/best_of_n_reward"] == pytest.approx((1 + 1 + 0.2 + 0.3) / 4)


def test_dynamic_sampling_drops_prompts_whose_rewards_all_agree():
    sample = rollouts([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    rule = RolloutFilter("rew_inf", group_size=2, drop_equal_reward_groups=True, max_rounds=3)
    kept, stats = apply_rollout_filter(sample, rule)
    assert kept.ids == ["q1", "q3"]
    assert stats["rollout/all_equal_fraction"] == 0.5
    assert stats["rollout/all_correct_fraction"] == 0.25  # q0


def test_dynamic_sampling_returns_none_when_no_prompt_is_useful():
    sample = rollouts([[1.0, 1.0], [0.0, 0.0]])
    rule = RolloutFilter("rew_inf", group_size=2, drop_equal_reward_groups=True)
    kept, stats = apply_rollout_filter(sample, rule)
    assert kept is None and stats["rollout/all_equal_fraction"] == 1.0


def test_discarded_counts_the_dropped_prompts_and_every_response_token_not_kept():
    # Response j of prompt i: i + j + 1 tokens, the first a prompt token (prompt_mask), so i + j
    # response tokens.
    sample = rollouts([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [0.0, 0.0, 0.0]])
    seqlens = sample.seqlens_of("packed_input_ids")  # [1, 2, 3, 2, 3, 4, 3, 4, 5]
    prompt_mask = torch.cat([torch.arange(n) == 0 for n in seqlens])
    sample.update_(SequenceSample.from_tensors(
        ids=sample.ids, seqlens={"prompt_mask": sample.seqlens["packed_input_ids"]},
        data={"prompt_mask": prompt_mask}))
    rule = RolloutFilter("rew_inf", group_size=2, drop_equal_reward_groups=True)
    kept, _ = apply_rollout_filter(sample, rule)
    # Best-of-2 keeps responses 0, 2 of q0 and 1, 2 of q1; q2's rewards agree: dropped. Thrown
    # away: q0's response 1 (1 token), q1's response 0 (1), all of q2 (2 + 3 + 4): 11 tokens.
    assert kept.ids == ["q0", "q1"]
    assert discarded_by_filter(sample, kept) == (1, 11)
    assert discarded_by_filter(sample, None) == (3, 18)  # every response token: 3 + 6 + 9
