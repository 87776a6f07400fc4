import pytest
import torch
from interface_helpers import EOS_ID, build_model, make_engine

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.sft import SFTInterface


def _sft_batch(tokenizer, pairs):
    tokens, prompt_mask, lengths = [], [], []
    for prompt, answer in pairs:
        prompt_ids, answer_ids = tokenizer.encode(prompt), tokenizer.encode(answer) + [EOS_ID]
        tokens += prompt_ids + answer_ids
        prompt_mask += [True] * len(prompt_ids) + [False] * len(answer_ids)
        lengths.append(len(prompt_ids) + len(answer_ids))
    return SequenceSample.from_default(
        ids=[f"s{i}" for i in range(len(pairs))],
        seqlens=lengths,
        data={"packed_input_ids": torch.tensor(tokens), "prompt_mask": torch.tensor(prompt_mask)},
    )


PAIRS = [("1+2=", "3"), ("40-3=", "37"), ("7*8=", "56")]


def _answer_nll_by_hand(model, tokenizer) -> float:
    """Mean over answer tokens of -log p(token | prefix), one sequence at a time."""
    total, count = 0.0, 0
    for prompt, answer in PAIRS:
        prompt_ids, answer_ids = tokenizer.encode(prompt), tokenizer.encode(answer) + [EOS_ID]
        ids = torch.tensor(prompt_ids + answer_ids)
        with torch.no_grad():
            logits = model(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
        logprobs = logits.float().log_softmax(-1)
        for position in range(len(prompt_ids), len(ids)):  # predicted from position - 1
            total -= logprobs[position - 1, ids[position]].item()
            count += 1
    return total / count


def test_sft_loss_is_the_answer_token_mean_and_ignores_prompt_tokens(tokenizer):
    model = build_model(len(tokenizer))
    engine = make_engine(model, tokenizer, lr=1e-3)
    expected = _answer_nll_by_hand(model, tokenizer)
    data = _sft_batch(tokenizer, PAIRS)
    interface = SFTInterface()
    assert interface.inference(engine, data, MicroBatchSpec()).stats["loss"] == pytest.approx(
        expected, rel=1e-5
    )
    stats = interface.train_step(engine, data, MicroBatchSpec(min_num_microbatches=3)).stats
    assert stats["loss"] == pytest.approx(expected, rel=1e-5)  # loss before the update
    assert stats["tokens"] == 2 + 3 + 3  # answer tokens incl. EOS: "3", "37", "56"
    assert stats["grad_norm"] > 0


def test_sft_gradients_do_not_depend_on_prompt_token_targets(tokenizer):
    # Changing the last prompt token changes the context of the answer, so instead change a
    # prompt token's *target* role: mark one more token as prompt and the loss must drop it.
    model = build_model(len(tokenizer))
    data = _sft_batch(tokenizer, PAIRS[:1])
    engine = make_engine(model, tokenizer, lr=None)
    full = SFTInterface().inference(engine, data, MicroBatchSpec()).stats
    masked = data.select(["packed_input_ids", "prompt_mask"])
    masked.data["prompt_mask"] = torch.tensor([True] * 5 + [False])  # "1+2=3" prompt, EOS answer
    reduced = SFTInterface().inference(engine, masked, MicroBatchSpec()).stats
    assert full["tokens"] == 2 and reduced["tokens"] == 1
    assert reduced["loss"] != pytest.approx(full["loss"])


def test_sft_one_and_three_microbatches_give_the_same_parameters(tokenizer):
    parameters = []
    for spec in (MicroBatchSpec(), MicroBatchSpec(min_num_microbatches=3)):
        engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=1e-3, adam_eps=1e-4)
        SFTInterface().train_step(engine, _sft_batch(tokenizer, PAIRS), spec)
        parameters.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
    torch.testing.assert_close(parameters[0], parameters[1], atol=1e-6, rtol=0)
