"""PPO policy / value losses: hand-computed cases and a padded per-sequence reference."""

import math

import pytest
import torch

from realrl.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_normaliser
from realrl.algo.layout import response_mask
from realrl.algo.losses import (
    cispo_policy_loss,
    entropy_bonus_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    value_loss,
)

# Five shifted entries; the last is masked out (it must not count anywhere).
RATIOS = [1.5, 0.5, 1.1, 4.0, 9.0]
ADVANTAGES = torch.tensor([1.0, -1.0, 2.0, -1.0, 5.0])
MASK = torch.tensor([True, True, True, True, False])


def _logprobs():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0])
    new = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return new, old


def test_ppo_loss_by_hand_with_clip_higher_and_dual_clip():
    # eps_clip 0.2 (low), eps_clip_high 0.28, dual_clip 3:
    # tok0 A=1,  r=1.5: max(-1.5, -1.28) = -1.28           clipped
    # tok1 A=-1, r=0.5: max(0.5, 0.8)    =  0.8            clipped
    # tok2 A=2,  r=1.1: max(-2.2, -2.2)  = -2.2            not clipped
    # tok3 A=-1, r=4.0: max(4.0, 1.28)   =  4.0 > 3*1 -> 3.0 dual clipped
    logprobs, old = _logprobs()
    out = ppo_policy_loss(
        logprobs, old, ADVANTAGES, MASK, eps_clip=0.2, eps_clip_high=0.28, dual_clip=3.0
    )
    torch.testing.assert_close(out.per_token_loss, torch.tensor([-1.28, 0.8, -2.2, 3.0, 0.0]))
    assert out.stats["clip_fraction"].item() == pytest.approx(2 / 4)
    assert out.stats["dual_clip_fraction"].item() == pytest.approx(1 / 4)
    # ratio mean (1.5 + 0.5 + 1.1 + 4.0) / 4 = 1.775
    assert out.stats["ratio_mean"].item() == pytest.approx(1.775)
    # k3 = (r - 1) - log r: 0.094535, 0.193147, 0.004690, 1.613706 -> mean 0.476519
    assert out.stats["approx_kl"].item() == pytest.approx(0.476519, abs=1e-5)
    assert out.stats["num_tokens"].item() == 4
    # gradient d loss / d logprob = -A * r on unclipped tokens, 0 on clipped ones
    out.per_token_loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 0.0, -2.2, 0.0, 0.0]))


def test_ppo_loss_without_dual_clip_keeps_the_large_negative_advantage_term():
    # symmetric eps 0.2: tok0 max(-1.5, -1.2) = -1.2; tok3 stays 4.0 with gradient -A*r = 4.0
    logprobs, old = _logprobs()
    out = ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, eps_clip=0.2)
    torch.testing.assert_close(out.per_token_loss, torch.tensor([-1.2, 0.8, -2.2, 4.0, 0.0]))
    out.per_token_loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 0.0, -2.2, 4.0, 0.0]))
    assert out.stats["dual_clip_fraction"].item() == 0.0


def test_ratio_early_stop_zeroes_the_micro_batch_when_mean_ratio_drifts():
    # mean ratio 1.775: |1.775 - 1| = 0.775 > 0.5 -> stopped; <= 1.0 -> kept
    logprobs, old = _logprobs()
    stopped = ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, ratio_early_stop=0.5)
    assert stopped.stats["early_stopped"].item() == 1.0
    assert torch.equal(stopped.per_token_loss, torch.zeros(5))
    stopped.per_token_loss.sum().backward()  # graph kept so backward still runs
    assert torch.equal(logprobs.grad, torch.zeros(5))
    kept = ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, ratio_early_stop=1.0)
    assert kept.stats["early_stopped"].item() == 0.0
    assert kept.per_token_loss.abs().sum() > 0


def test_dual_clip_must_exceed_one():
    logprobs, old = _logprobs()
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, dual_clip=0.9)


def test_gspo_loss_by_hand_clips_whole_sequences_by_their_mean_log_ratio():
    # Two packed sequences of 3 tokens: shifted entries [s0 t1, s0 t2, s1 t1, s1 t2], the first
    # of sequence 1 a prompt token. Sequence 0's token log-ratios 1e-4 and 3e-4: s0 = e^2e-4,
    # inside [1 - 3e-4, 1 + 4e-4]; sequence 1's one response token 1e-3: s1 = e^1e-3, above.
    cu_seqlens = torch.tensor([0, 3, 6], dtype=torch.int32)
    mask = torch.tensor([True, True, False, True])
    old = torch.tensor([-1.0, -2.0, -0.7, -0.5])
    new = (old + torch.tensor([1e-4, 3e-4, 0.5, 1e-3])).requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0])  # one per sequence, GRPO's
    out = gspo_policy_loss(new, old, advantages, mask, cu_seqlens, eps_clip=3e-4,
                           eps_clip_high=4e-4)
    s0 = math.exp(2e-4)
    torch.testing.assert_close(out.per_token_loss.detach(),
                               torch.tensor([-s0, -s0, 0.0, -1.0004]), atol=1e-7, rtol=0)
    out.per_token_loss.sum().backward()
    # d(-s_it)/d log pi_t = -s0 in sequence 0; sequence 1 is clipped whole: no gradient
    torch.testing.assert_close(new.grad, torch.tensor([-s0, -s0, 0.0, 0.0]), atol=1e-7, rtol=0)
    assert out.stats["clip_fraction"].item() == pytest.approx(1 / 3)  # its 1 of 3 tokens
    # the unclipped sequence ratios, per token
    assert out.stats["ratio_mean"].item() == pytest.approx((2 * s0 + math.exp(1e-3)) / 3,
                                                           abs=1e-6)


def test_gspo_per_token_loss_averaged_per_sequence_is_the_sequence_objective():
    # GSPO's eq. (5): mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t log-ratio); the
    # per-token form under seq-mean-token-mean gives its value and its gradient.
    generator = torch.Generator().manual_seed(2)  # sequences 0 and 1 clip, 2 and 3 not
    lengths = [5, 2, 7, 4]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = response_mask(torch.tensor([2, 1, 3, 1]), torch.tensor(lengths))
    old = -torch.rand(mask.numel(), generator=generator) - 0.5
    new = (old + 2e-3 * torch.randn(mask.numel(), generator=generator)).requires_grad_(True)
    sequence_advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    shifted = [length - 1 for length in lengths]
    advantages = torch.repeat_interleave(sequence_advantages, torch.tensor(shifted))
    out = gspo_policy_loss(new, old, advantages, mask, cu_seqlens, eps_clip=3e-4,
                           eps_clip_high=4e-4)
    normaliser = loss_normaliser("seq-mean-token-mean", mask, cu_seqlens)
    loss = aggregate_loss(out.per_token_loss, mask, cu_seqlens, "seq-mean-token-mean", normaliser)
    (ours,) = torch.autograd.grad(loss, new)
    reference_new = new.detach().clone().requires_grad_(True)
    terms = []
    for log_ratio, seq_mask, advantage in zip((reference_new - old).split(shifted),
                                              mask.split(shifted), sequence_advantages):
        s = torch.exp(log_ratio[seq_mask].mean())
        terms.append(torch.maximum(-advantage * s,
                                   -advantage * s.clamp(1 - 3e-4, 1 + 4e-4)))
    reference = torch.stack(terms).mean()
    (expected,) = torch.autograd.grad(reference, reference_new)
    torch.testing.assert_close(loss, reference, atol=1e-7, rtol=0)
    torch.testing.assert_close(ours, expected, atol=1e-7, rtol=0)
    # response tokens 3, 1, 4, 3 (lengths minus prompts): the first two sequences clip
    assert out.stats["clip_fraction"].item() == pytest.approx((3 + 1) / 11)


def test_cispo_truncates_the_weight_and_keeps_every_tokens_gradient():
    # RATIOS 1.5, 0.5, 1.1, 4.0 (masked: 9.0) with eps_clip 0.2, eps_clip_high 0.28: weights
    # 1.28, 0.8, 1.1, 1.28. PPO gives token 0 no gradient (A > 0 above the band), CISPO weight
    # 1.28; token 3 (A < 0, ratio 4) keeps PPO's unclipped weight 4, which CISPO truncates.
    logprobs, old = _logprobs()
    out = cispo_policy_loss(logprobs, old, ADVANTAGES, MASK, eps_clip=0.2, eps_clip_high=0.28)
    weights = torch.tensor([1.28, 0.8, 1.1, 1.28, 0.0])
    torch.testing.assert_close(out.per_token_loss.detach(), -weights * ADVANTAGES)
    out.per_token_loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, -weights * ADVANTAGES)  # d/d log pi
    assert out.stats["clip_fraction"].item() == pytest.approx(3 / 4)  # 1.5, 0.5, 4.0 truncated
    assert out.stats["ratio_mean"].item() == pytest.approx(1.775)


def test_value_loss_by_hand_takes_the_larger_clipped_error_with_half_factor():
    # old value 1.0, eps 0.2:
    # tok0 v=1.5 R=2: (1.5-2)^2 = 0.25; clip 1.2 -> (1.2-2)^2 = 0.64 -> 0.5*0.64 = 0.32 clipped
    # tok1 v=1.1 R=0: 1.21 both -> 0.605
    # tok2 v=0.5 R=0: 0.25; clip 0.8 -> 0.64 -> 0.32 clipped
    values = torch.tensor([1.5, 1.1, 0.5, 3.0], requires_grad=True)
    old, returns = torch.ones(4), torch.tensor([2.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([True, True, True, False])
    out = value_loss(values, old, returns, mask, value_eps_clip=0.2)
    torch.testing.assert_close(out.per_token_loss, torch.tensor([0.32, 0.605, 0.32, 0.0]))
    assert out.stats["value_clip_fraction"].item() == pytest.approx(2 / 3)
    out.per_token_loss.sum().backward()
    # clipped tokens have no gradient; tok1: d 0.5 (v - R)^2 / dv = v - R = 1.1
    torch.testing.assert_close(values.grad, torch.tensor([0.0, 1.1, 0.0, 0.0]))
    unclipped = value_loss(values, old, returns, mask, value_eps_clip=None)
    torch.testing.assert_close(unclipped.per_token_loss, torch.tensor([0.125, 0.605, 0.125, 0.0]))


def test_entropy_bonus_is_negative_coef_times_entropy_on_response_tokens():
    entropy = torch.tensor([2.0, 1.0, 4.0])
    bonus = entropy_bonus_loss(entropy, torch.tensor([True, False, True]), 0.01)
    torch.testing.assert_close(bonus, torch.tensor([-0.02, 0.0, -0.04]))
    assert torch.equal(
        entropy_bonus_loss(entropy, torch.ones(3, dtype=torch.bool), 0.0), torch.zeros(3)
    )


def _reference_losses(padded, lengths, eps_low, eps_high, dual_clip, value_eps, mode, norm_length):
    """Padded [num_seqs, max_len] tensors, scalar math, per-sequence Python loops."""
    policy_terms, value_terms = [], []
    for i, length in enumerate(lengths):
        seq_policy, seq_value = [], []
        for t in range(length):
            if not padded["mask"][i, t]:
                continue
            ratio = math.exp(padded["logprobs"][i, t] - padded["old_logprobs"][i, t])
            adv = float(padded["advantages"][i, t])
            loss = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
            if adv < 0:
                loss = min(loss, -dual_clip * adv)
            seq_policy.append(loss)
            value, old, ret = (float(padded[k][i, t]) for k in ("values", "old_values", "returns"))
            clipped = old + min(max(value - old, -value_eps), value_eps)
            seq_value.append(0.5 * max((value - ret) ** 2, (clipped - ret) ** 2))
        policy_terms.append(seq_policy)
        value_terms.append(seq_value)
    return _reference_aggregate(policy_terms, mode, norm_length), _reference_aggregate(
        value_terms, mode, norm_length
    )


def _reference_aggregate(per_sequence_terms, mode, norm_length):
    nonempty = [terms for terms in per_sequence_terms if terms]
    if mode == "token-mean":
        return sum(sum(t) for t in nonempty) / sum(len(t) for t in nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(t) for t in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(t) / len(t) for t in nonempty) / len(nonempty)
    return sum(sum(t) / norm_length for t in nonempty) / len(nonempty)


def _pack(padded_row_values, lengths):
    return torch.cat([row[:length] for row, length in zip(padded_row_values, lengths)])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_and_value_losses_match_padded_reference_on_random_inputs(mode):
    torch.manual_seed(3)
    prompt_lens = torch.tensor([2, 5, 1, 3, 4, 2])
    response_lens = torch.tensor([7, 0, 12, 3, 1, 9])
    seq_lens = prompt_lens + response_lens
    lengths = (seq_lens - 1).tolist()  # shifted entries per sequence
    num_seqs, max_len = len(lengths), max(lengths)
    padded = {
        "logprobs": -torch.rand(num_seqs, max_len, dtype=torch.float64) * 2,
        "old_logprobs": -torch.rand(num_seqs, max_len, dtype=torch.float64) * 2,
        "advantages": torch.randn(num_seqs, max_len, dtype=torch.float64),
        "values": torch.randn(num_seqs, max_len, dtype=torch.float64),
        "old_values": torch.randn(num_seqs, max_len, dtype=torch.float64),
        "returns": torch.randn(num_seqs, max_len, dtype=torch.float64),
    }
    positions = torch.arange(max_len)[None, :]
    padded["mask"] = (positions >= prompt_lens[:, None] - 1) & (positions < seq_lens[:, None] - 1)
    packed = {key: _pack(value, lengths) for key, value in padded.items()}
    assert torch.equal(packed["mask"], response_mask(prompt_lens, seq_lens))
    cu_seqlens = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0))

    policy = ppo_policy_loss(
        packed["logprobs"],
        packed["old_logprobs"],
        packed["advantages"],
        packed["mask"],
        eps_clip=0.2,
        eps_clip_high=0.3,
        dual_clip=2.5,
    )
    value = value_loss(
        packed["values"],
        packed["old_values"],
        packed["returns"],
        packed["mask"],
        value_eps_clip=0.3,
    )
    normaliser = loss_normaliser(mode, packed["mask"], cu_seqlens, norm_length=16)
    policy_loss = aggregate_loss(
        policy.per_token_loss, packed["mask"], cu_seqlens, mode, normaliser
    )
    critic_loss = aggregate_loss(value.per_token_loss, packed["mask"], cu_seqlens, mode, normaliser)
    ref_policy, ref_value = _reference_losses(padded, lengths, 0.2, 0.3, 2.5, 0.3, mode, 16)
    assert policy_loss.item() == pytest.approx(ref_policy, rel=1e-5)
    assert critic_loss.item() == pytest.approx(ref_value, rel=1e-5)
