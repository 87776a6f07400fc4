import math

import pytest
import torch
import torch.nn.functional as F
from interface_helpers import EOS_ID, build_model, make_engine

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.common import loss_mask_from_prompt_mask
from realrl.interfaces.configs import DPOConfig
from realrl.interfaces.dpo import DPOInterface
from realrl.interfaces.paired_rw import PairedRewardInterface
from realrl.interfaces.reference import ReferenceInterface

# Two samples: one prompt with two (positive, negative) pairs, one with a single pair.
RECORDS = [
    ([4, 13, 5, 17], [([6, EOS_ID], [7, 8, EOS_ID]), ([9, 9, EOS_ID], [10, EOS_ID])]),
    ([7, 7, 17], [([20, 21, 22, EOS_ID], [23, EOS_ID])]),
]


def _paired_batch() -> SequenceSample:
    tokens, seqlens, prompt_lens = [], [], []
    for prompt, pairs in RECORDS:
        lengths = []
        for positive, negative in pairs:
            for completion in (positive, negative):
                tokens += prompt + completion
                lengths.append(len(prompt) + len(completion))
            prompt_lens.append(len(prompt))
        seqlens.append(lengths)
    return SequenceSample.from_tensors(
        ids=["a", "b"],
        seqlens={"packed_input_ids": seqlens, "prompt_lens": [[1, 1], [1]]},
        data={"packed_input_ids": torch.tensor(tokens), "prompt_lens": torch.tensor(prompt_lens)},
    )


def test_reward_model_with_zero_scores_has_loss_log_two(tokenizer):
    # A zero value head scores every sequence 0: each pair costs -log sigmoid(0) = log 2, and no
    # pair is ranked correctly (margin 0 is not > 0).
    model = build_model(len(tokenizer), critic=True)
    torch.nn.init.zeros_(model.value_head.weight)
    stats = (
        PairedRewardInterface()
        .train_step(make_engine(model, tokenizer), _paired_batch(), MicroBatchSpec())
        .stats
    )
    assert stats["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert stats["accuracy"] == 0.0


def test_reward_model_loss_matches_bradley_terry_on_last_token_scores(tokenizer):
    model = build_model(len(tokenizer), critic=True)
    engine = make_engine(model, tokenizer, lr=1e-3)
    data = _paired_batch()
    interface = PairedRewardInterface()
    scores = interface.inference(engine, data, MicroBatchSpec(min_num_microbatches=2)).data
    assert scores.seqlens["rm_scores"] == [[1, 1, 1, 1], [1, 1]]
    ids, cu_seqlens = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        values = model(ids, cu_seqlens)
    last = values[cu_seqlens[1:].long() - 1]  # [6] scores at each sequence's last token
    torch.testing.assert_close(scores.data["rm_scores"], last)
    expected_loss = -F.logsigmoid(last[0::2] - last[1::2]).mean().item()  # 3 pairs
    expected_accuracy = (last[0::2] > last[1::2]).float().mean().item()
    stats = interface.train_step(engine, data, MicroBatchSpec(min_num_microbatches=2)).stats
    assert stats["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert stats["accuracy"] == pytest.approx(expected_accuracy)
    for _ in range(10):
        stats = interface.train_step(engine, data, MicroBatchSpec()).stats
    assert stats["loss"] < expected_loss and stats["accuracy"] == 1.0


def _with_reference(engine, data, chosen_offset: float, prompt_noise: bool) -> SequenceSample:
    reference = ReferenceInterface().inference(engine, data, MicroBatchSpec()).data
    cu_seqlens = data.cu_seqlens("packed_input_ids")
    prompt_mask = torch.cat(
        [
            torch.arange(length) < prompt_len
            for length, prompt_len in zip(
                data.seqlens_of("packed_input_ids"),
                data.data["prompt_lens"].repeat_interleave(2).tolist(),
            )
        ]
    )
    response = loss_mask_from_prompt_mask(prompt_mask, cu_seqlens)  # shifted
    shifted_lengths = [n - 1 for n in data.seqlens_of("packed_input_ids")]
    is_chosen = torch.cat([torch.full((n,), i % 2 == 0) for i, n in enumerate(shifted_lengths)])
    logprobs = reference.data["packed_ref_logprobs"]
    logprobs = logprobs - chosen_offset * (response & is_chosen)
    if prompt_noise:
        logprobs = logprobs + 5.0 * torch.rand(logprobs.shape) * ~response
    reference.data["packed_ref_logprobs"] = logprobs
    data = data.select(["packed_input_ids", "prompt_lens"])
    data.update_(reference)
    return data


def test_dpo_loss_matches_equation_seven_by_hand(tokenizer):
    # The reference equals the policy except that every chosen response token is 0.5 nats less
    # likely under the reference. Chosen responses have 2, 3 and 4 tokens, so the margins are
    # beta * 0.5 * T = 0.1, 0.15, 0.2 (beta 0.1) and the loss is
    # mean(log(1 + exp(-margin))) = (0.644397 + 0.620957 + 0.598139) / 3 = 0.621164.
    # Noise on the reference's prompt positions must not matter.
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3)
    data = _with_reference(engine, _paired_batch(), chosen_offset=0.5, prompt_noise=True)
    stats = (
        DPOInterface(DPOConfig(beta=0.1))
        .train_step(engine, data, MicroBatchSpec(min_num_microbatches=2))
        .stats
    )
    assert stats["loss"] == pytest.approx(0.621164, abs=1e-5)
    assert stats["reward_margin"] == pytest.approx(0.15, abs=1e-5)
    assert stats["accuracy"] == 1.0
    assert stats["rejected_reward"] == pytest.approx(0.0, abs=1e-5)


def test_dpo_against_an_identical_reference_starts_at_log_two(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3)
    data = _with_reference(engine, _paired_batch(), chosen_offset=0.0, prompt_noise=False)
    interface = DPOInterface(DPOConfig(beta=0.5))
    first = interface.train_step(engine, data, MicroBatchSpec()).stats
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for _ in range(5):
        last = interface.train_step(engine, data, MicroBatchSpec()).stats
    assert last["loss"] < first["loss"] and last["reward_margin"] > 0


def test_paired_interfaces_reject_odd_sequence_counts(tokenizer):
    data = SequenceSample.from_tensors(
        ids=["a"],
        seqlens={"packed_input_ids": [[3, 3, 3]]},
        data={"packed_input_ids": torch.tensor([4, 5, 6] * 3)},
    )
    engine = make_engine(build_model(len(tokenizer), critic=True), tokenizer)
    with pytest.raises(ValueError, match="odd number of sequences"):
        PairedRewardInterface().train_step(engine, data, MicroBatchSpec())
