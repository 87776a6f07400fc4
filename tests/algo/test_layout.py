"""Packed-layout helpers checked by hand and against padded per-sequence references."""

import pytest
import torch

from realrl.algo import layout
from realrl.algo.layout import (
    last_true_index,
    packed_entropy,
    packed_shifted_logprobs,
    response_mask,
    segment_mean,
    segment_sum,
    shifted_cu_seqlens,
    shifted_values,
)


def test_shifted_cu_seqlens_removes_one_entry_per_sequence():
    # lengths 3, 1, 4 -> shifted lengths 2, 0, 3
    cu_seqlens = torch.tensor([0, 3, 4, 8])
    assert shifted_cu_seqlens(cu_seqlens).tolist() == [0, 2, 2, 5]


def test_response_mask_marks_entries_that_predict_response_tokens():
    # seq 0: 5 tokens, prompt 2 -> tokens 2,3,4 are response -> entries j=1,2,3 of 4 entries
    # seq 1: 3 tokens, prompt 3 (no response) -> 2 entries, all False
    # seq 2: 2 tokens, prompt 1 -> token 1 is response -> entry 0 True
    mask = response_mask(torch.tensor([2, 3, 1]), torch.tensor([5, 3, 2]))
    assert mask.tolist() == [False, True, True, True, False, False, True]


def test_response_mask_rejects_prompt_longer_than_sequence():
    with pytest.raises(ValueError, match="prompt_len <= seq_len"):
        response_mask(torch.tensor([4]), torch.tensor([3]))


def test_segment_sum_mean_and_last_index_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
    mask = torch.tensor([True, False, True, False, False])
    boundaries = torch.tensor([0, 3, 3, 5])  # an empty middle segment
    assert segment_sum(values, boundaries).tolist() == [6.0, 0.0, 30.0]
    # segment 0: (1 + 3) / 2 = 2; empty and fully-masked segments give 0
    assert segment_mean(values, mask, boundaries).tolist() == [2.0, 0.0, 0.0]
    assert last_true_index(mask, boundaries).tolist() == [2, -1, -1]


def test_shifted_values_drop_each_sequences_last_value():
    values = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])  # sequences of length 2 and 3
    assert shifted_values(values, torch.tensor([0, 2, 5])).tolist() == [0.0, 2.0, 3.0]


def _reference_logprobs_and_entropy(logits, input_ids, lengths, temperature):
    """Per-sequence loop with full log_softmax: the obvious, memory-hungry way."""
    logprobs, entropies, start = [], [], 0
    for length in lengths:
        seq_logits = logits[start : start + length - 1].double() / temperature
        log_softmax = torch.log_softmax(seq_logits, dim=-1)
        labels = input_ids[start + 1 : start + length]
        logprobs.append(log_softmax.gather(-1, labels[:, None]).squeeze(-1))
        entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
        start += length
    return torch.cat(logprobs), torch.cat(entropies)


@pytest.mark.parametrize("chunk_elements", [2**24, 7 * 11])  # one chunk; chunks of 7 rows
def test_packed_logprobs_and_entropy_match_per_sequence_reference(monkeypatch, chunk_elements):
    monkeypatch.setattr(layout, "_LOGIT_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(layout, "_MIN_CHUNK_ROWS", 1)
    torch.manual_seed(0)
    lengths, vocab, temperature = [5, 1, 9, 3, 12], 11, 0.7
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.randint(0, vocab, (sum(lengths),))
    logits = torch.randn(sum(lengths), vocab, dtype=torch.float64, requires_grad=True)
    reference_logits = logits.detach().clone().requires_grad_(True)

    logprobs = packed_shifted_logprobs(logits, input_ids, cu_seqlens, temperature)
    entropy = packed_entropy(logits, cu_seqlens, temperature)
    ref_logprobs, ref_entropy = _reference_logprobs_and_entropy(
        reference_logits, input_ids, lengths, temperature
    )
    assert logprobs.shape == (sum(lengths) - len(lengths),)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-6)

    weights_lp, weights_h = torch.randn_like(ref_logprobs), torch.randn_like(ref_entropy)
    ((logprobs.double() * weights_lp).sum() + (entropy.double() * weights_h).sum()).backward()
    ((ref_logprobs * weights_lp).sum() + (ref_entropy * weights_h).sum()).backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad, rtol=1e-5, atol=1e-6)


def test_packed_logprobs_are_fp32_from_bf16_logits_and_exact_by_hand():
    # vocab 2, logits [0, ln 3] -> softmax [1/4, 3/4]; seq = [tok0, tok1] predicts token 1
    logits = torch.tensor([[0.0, 1.0986123], [5.0, 5.0]], dtype=torch.bfloat16)
    logprobs = packed_shifted_logprobs(logits, torch.tensor([0, 1]), torch.tensor([0, 2]))
    assert logprobs.dtype == torch.float32
    # bf16 rounds ln 3 to 141 * 2^-7 = 1.1015625; log p(tok1) = -log(1 + e^-1.1015625)
    # = -log(1.332360) = -0.286945
    assert logprobs.item() == pytest.approx(-0.286945, abs=1e-5)
    entropy = packed_entropy(logits, torch.tensor([0, 2]))
    # q = 1 / 1.332360 = 0.750548, p = 0.249452, log p = -0.286945 - 1.1015625 = -1.388508
    # H = -(0.249452 * -1.388508 + 0.750548 * -0.286945) = 0.346366 + 0.215366 = 0.561727
    assert entropy.item() == pytest.approx(0.561727, abs=1e-5)
