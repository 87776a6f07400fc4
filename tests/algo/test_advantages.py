"""Advantage estimators: hand-computed cases (arithmetic in comments) and a GAE reference."""

import pytest
import torch

from realrl.algo.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    compute_advantages,
    get_advantage_estimator,
)
from realrl.algo.kl import kl_penalized_token_rewards
from realrl.algo.layout import response_mask

RAW = AdvantageSettings(gamma=1.0, lam=1.0, adv_norm=False)


def _batch(prompt_lens, response_lens):
    prompt_lens, response_lens = torch.tensor(prompt_lens), torch.tensor(response_lens)
    seq_lens = prompt_lens + response_lens
    cu_seqlens = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0))
    return cu_seqlens, response_mask(prompt_lens, seq_lens)


def _sequence_inputs(rewards, response_lens, group_ids=None, baseline_rewards=None):
    """Prompts of 2 tokens; the task reward sits on each sequence's last response token."""
    cu_seqlens, loss_mask = _batch([2] * len(rewards), response_lens)
    token_rewards = kl_penalized_token_rewards(
        torch.tensor(rewards), None, 0.0, loss_mask, cu_seqlens
    )
    return AdvantageInputs(
        token_rewards=token_rewards,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        group_ids=None if group_ids is None else torch.tensor(group_ids),
        baseline_rewards=None if baseline_rewards is None else torch.tensor(baseline_rewards),
    )


def _per_sequence(advantages, loss_mask, cu_seqlens):
    """The advantage of each sequence's response tokens, asserting it is constant."""
    out, start = [], 0
    for length in (cu_seqlens[1:] - cu_seqlens[:-1] - 1).tolist():
        entries = advantages[start : start + length][loss_mask[start : start + length]]
        assert torch.allclose(entries, entries[:1].expand_as(entries))
        out.append(entries[0].item() if entries.numel() else None)
        start += length
    return out


def test_gae_by_hand_with_eos_truncation_and_an_empty_response():
    # Sequence layout: 2 prompt tokens + 2 response tokens -> 3 shifted entries, mask [F, T, T].
    # values per token [0.5, 1.0, 2.0, 3.0]; token rewards [0, 0, 1]; gamma 0.9, lam 0.5.
    # EOS:       delta2 = 1 + 0.9*0 - 2.0 = -1.0;  delta1 = 0 + 0.9*2.0 - 1.0 = 0.8
    #            A2 = -1.0;  A1 = 0.8 + 0.45*(-1.0) = 0.35;  R = A + V -> [1.35, 1.0]
    # truncated: delta2 = 1 + 0.9*3.0 - 2.0 = 1.7;  A2 = 1.7;  A1 = 0.8 + 0.45*1.7 = 1.565
    #            R -> [2.565, 3.7]
    # third sequence: prompt of 2, no response -> one masked entry, all zeros.
    cu_seqlens, loss_mask = _batch([2, 2, 2], [2, 2, 0])
    token_rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    values = torch.tensor([0.5, 1.0, 2.0, 3.0] * 2 + [7.0, 7.0])
    inputs = AdvantageInputs(
        token_rewards,
        loss_mask,
        cu_seqlens,
        values=values,
        seq_no_eos=torch.tensor([False, True, False]),
    )
    out = compute_advantages("gae", inputs, AdvantageSettings(gamma=0.9, lam=0.5, adv_norm=False))
    expected_adv = [0.0, 0.35, -1.0, 0.0, 1.565, 1.7, 0.0]
    expected_ret = [0.0, 1.35, 1.0, 0.0, 2.565, 3.7, 0.0]
    torch.testing.assert_close(out.advantages, torch.tensor(expected_adv))
    torch.testing.assert_close(out.returns, torch.tensor(expected_ret))


def _reference_gae(token_rewards, values, loss_mask, cu_seqlens, no_eos, gamma, lam):
    """Per-sequence Python loop over response tokens, the textbook recursion."""
    advantages = torch.zeros_like(token_rewards)
    num_seqs = len(cu_seqlens) - 1
    for i in range(num_seqs):
        start, end = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        shifted_start = start - i
        seq_values = values[start:end]
        last_gae = 0.0
        for j in range(end - start - 2, -1, -1):
            if not loss_mask[shifted_start + j]:
                continue
            is_last = j == end - start - 2
            next_value = 0.0 if (is_last and not no_eos[i]) else seq_values[j + 1].item()
            delta = token_rewards[shifted_start + j] + gamma * next_value - seq_values[j]
            last_gae = delta + gamma * lam * (0.0 if is_last else last_gae)
            advantages[shifted_start + j] = last_gae
    return advantages


def test_gae_matches_reference_loop_on_random_batch():
    torch.manual_seed(1)
    prompt_lens, response_lens = [3, 1, 5, 2, 4], [6, 3, 0, 9, 1]
    cu_seqlens, loss_mask = _batch(prompt_lens, response_lens)
    token_rewards = torch.randn(loss_mask.numel(), dtype=torch.float64) * loss_mask
    values = torch.randn(int(cu_seqlens[-1]), dtype=torch.float64)
    no_eos = torch.tensor([True, False, False, True, False])
    inputs = AdvantageInputs(token_rewards, loss_mask, cu_seqlens, values=values, seq_no_eos=no_eos)
    out = compute_advantages("gae", inputs, AdvantageSettings(gamma=0.97, lam=0.9, adv_norm=False))
    expected = _reference_gae(token_rewards, values, loss_mask, cu_seqlens, no_eos, 0.97, 0.9)
    torch.testing.assert_close(out.advantages.double(), expected, rtol=1e-5, atol=1e-5)


def test_grpo_normalises_within_each_group_with_unbiased_std():
    # group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    #   -> +-0.5 / 0.57735 = +-0.866025
    # group 1 single sample -> 0; group 2 all equal [1, 1] -> 0
    inputs = _sequence_inputs(
        [1.0, 0.0, 0.0, 1.0, 0.7, 1.0, 1.0], [3, 1, 2, 4, 2, 1, 5], group_ids=[0, 0, 0, 0, 1, 2, 2]
    )
    out = compute_advantages("grpo", inputs, RAW)
    per_seq = _per_sequence(out.advantages, inputs.loss_mask, inputs.cu_seqlens)
    assert per_seq == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0], abs=1e-5)
    assert torch.equal(
        out.advantages[~inputs.loss_mask], torch.zeros(int((~inputs.loss_mask).sum()))
    )


def test_dr_grpo_only_subtracts_the_group_mean():
    # group 0 mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; group 1 [3, 1] mean 2 -> [1, -1]
    inputs = _sequence_inputs(
        [1.0, 0.0, 0.0, 1.0, 3.0, 1.0], [3, 1, 2, 4, 1, 1], [0, 0, 0, 0, 1, 1]
    )
    out = compute_advantages("dr_grpo", inputs, RAW)
    per_seq = _per_sequence(out.advantages, inputs.loss_mask, inputs.cu_seqlens)
    assert per_seq == pytest.approx([0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    assert get_advantage_estimator("dr_grpo").recommended_loss_agg_mode == "seq-mean-token-sum-norm"


def test_rloo_uses_the_mean_of_the_other_samples():
    # group 0 [1, 0, 0, 1]: 1 - (0 + 0 + 1)/3 = 2/3; 0 - (1 + 0 + 1)/3 = -2/3
    # group 1 [0.3, 0.9]: 0.3 - 0.9 = -0.6, 0.9 - 0.3 = 0.6; group 2 single -> 0
    inputs = _sequence_inputs(
        [1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 5.0], [1, 2, 3, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1, 2]
    )
    out = compute_advantages("rloo", inputs, RAW)
    per_seq = _per_sequence(out.advantages, inputs.loss_mask, inputs.cu_seqlens)
    assert per_seq == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -0.6, 0.6, 0.0], abs=1e-6)


def test_remax_subtracts_the_greedy_rollout_reward():
    # [1 - 0.5, 0 - 0.5, 0.2 - 0.8]
    inputs = _sequence_inputs([1.0, 0.0, 0.2], [2, 1, 3], baseline_rewards=[0.5, 0.5, 0.8])
    out = compute_advantages("remax", inputs, RAW)
    per_seq = _per_sequence(out.advantages, inputs.loss_mask, inputs.cu_seqlens)
    assert per_seq == pytest.approx([0.5, -0.5, -0.6])


def test_reinforce_plus_plus_discounts_then_whitens_globally():
    # seq 0 response token rewards [0.2, 1.0], gamma 0.5 -> G = [0.2 + 0.5*1.0, 1.0] = [0.7, 1.0]
    # seq 1 response token reward [0.0] -> G = [0.0]
    # mean 1.7/3 = 0.566667; population var ((0.1333)^2 + (0.4333)^2 + (0.5667)^2)/3 = 0.175556
    # std sqrt(0.175556 + 1e-5) = 0.419005 -> [0.318214, 1.034195, -1.352409]
    cu_seqlens, loss_mask = _batch([1, 1], [2, 1])  # shifted entries [T, T | T]
    inputs = AdvantageInputs(torch.tensor([0.2, 1.0, 0.0]), loss_mask, cu_seqlens)
    settings = AdvantageSettings(gamma=0.5, adv_norm=False)
    out = compute_advantages("reinforce_plus_plus", inputs, settings)
    torch.testing.assert_close(out.returns, torch.tensor([0.7, 1.0, 0.0]))
    torch.testing.assert_close(out.advantages, torch.tensor([0.318214, 1.034195, -1.352409]))
    # it already whitens, so ppo.adv_norm=True must not change it
    again = compute_advantages("reinforce_plus_plus", inputs, AdvantageSettings(gamma=0.5))
    torch.testing.assert_close(again.advantages, out.advantages)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    # one group, scores [1, 0], mean 0.5; gamma 1 -> returns seq0 [0.5, 0.5], seq1 [-0.5]
    # mean 1/6, population var ((1/3)^2 * 2 + (2/3)^2)/3 = 2/9, std sqrt(2/9 + 1e-5) = 0.471415
    # -> [0.707091, 0.707091, -1.414182]
    inputs = _sequence_inputs([1.0, 0.0], [2, 1], group_ids=[7, 7])
    out = compute_advantages("reinforce_plus_plus_baseline", inputs, RAW)
    mask = inputs.loss_mask
    torch.testing.assert_close(out.returns[mask], torch.tensor([0.5, 0.5, -0.5]))
    torch.testing.assert_close(out.advantages[mask], torch.tensor([0.707091, 0.707091, -1.414182]))


def test_reinforce_plus_plus_baseline_returns_are_rewards_to_go_minus_the_group_mean():
    # Per-token KL penalties in the rewards: [-0.5, 0, 1] and [-0.2, 0, 0] in one group.
    # Scores 0.5 and -0.2, mean 0.15; gamma 1 -> seq0 rewards-to-go [0.5, 1, 1] - 0.15
    # = [0.35, 0.85, 0.85] (score - mean = 0.35 only on the first token), seq1 [-0.2, 0, 0]
    # - 0.15 = [-0.35, -0.15, -0.15].
    cu_seqlens, loss_mask = _batch([2, 2], [3, 3])
    token_rewards = torch.zeros(loss_mask.shape)
    token_rewards[loss_mask] = torch.tensor([-0.5, 0.0, 1.0, -0.2, 0.0, 0.0])
    inputs = AdvantageInputs(token_rewards=token_rewards, loss_mask=loss_mask,
                             cu_seqlens=cu_seqlens, group_ids=torch.tensor([0, 0]))
    out = compute_advantages("reinforce_plus_plus_baseline", inputs, RAW)
    torch.testing.assert_close(
        out.returns[loss_mask], torch.tensor([0.35, 0.85, 0.85, -0.35, -0.15, -0.15])
    )


def test_adv_norm_whitens_sequence_level_advantages_over_response_tokens():
    # dr_grpo gives response tokens [0.5, 0.5, -0.5] (seq lengths 2 and 1); whitening as above
    inputs = _sequence_inputs([1.0, 0.0], [2, 1], group_ids=[0, 0])
    out = compute_advantages("dr_grpo", inputs, AdvantageSettings())
    torch.testing.assert_close(
        out.advantages[inputs.loss_mask], torch.tensor([0.707091, 0.707091, -1.414182])
    )


def test_zero_length_responses_get_no_advantage_and_do_not_break_estimators():
    # seq 1 has no response token: its reward has nowhere to sit, its score is 0.
    # group [1.0, (0.0), 0.0]: mean 1/3; dr_grpo -> seq0 2/3, seq2 -1/3
    inputs = _sequence_inputs([1.0, 9.0, 0.0], [2, 0, 1], group_ids=[0, 0, 0])
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        out = compute_advantages(name, inputs, RAW)
        assert torch.isfinite(out.advantages).all(), name
        assert (out.advantages[~inputs.loss_mask] == 0).all(), name
    per_seq = _per_sequence(
        compute_advantages("dr_grpo", inputs, RAW).advantages, inputs.loss_mask, inputs.cu_seqlens
    )
    assert per_seq == pytest.approx([2 / 3, None, -1 / 3])


def test_unknown_estimator_lists_the_valid_names():
    with pytest.raises(ValueError, match="Did you mean grpo") as error:
        get_advantage_estimator("gpro")
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "remax"):
        assert name in str(error.value)


def test_estimators_name_their_missing_inputs():
    inputs = _sequence_inputs([1.0], [1])
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", inputs, RAW)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", inputs, RAW)
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages("remax", inputs, RAW)
