import logging

import numpy as np
import pytest
import torch

from realrl.datasets.arithmetic import as_paired_records, as_sft_records, make_arithmetic_records
from realrl.datasets.jsonl import DatasetError, write_jsonl
from realrl.datasets.loader import (
    EpochIterator,
    PairedDataset,
    PromptDataset,
    SFTDataset,
    make_paired_batch,
    make_prompt_batch,
    make_sft_batch,
)


def test_prompt_batch_packs_prompts_with_ids_and_answer_metadata(tokenizer, tmp_path):
    records = [
        {"query_id": "a", "prompt": "12+345=", "answer": "357"},
        {"query_id": "b", "prompt": "7-9=", "answer": "-2", "task": "math"},
    ]
    path = write_jsonl(records, tmp_path / "prompts.jsonl")
    dataset = PromptDataset.from_jsonl(path, tokenizer)
    batch = make_prompt_batch(dataset, [1, 0])
    expected = [tokenizer.encode("7-9="), tokenizer.encode("12+345=")]
    assert expected[0][0] == tokenizer.bos_token_id  # prompts carry the tokenizer's BOS
    assert batch.ids == ["b", "a"]
    assert batch.keys == {"packed_prompts"}
    assert batch.seqlens["packed_prompts"] == [[len(expected[0])], [len(expected[1])]]
    assert batch.data["packed_prompts"].tolist() == expected[0] + expected[1]
    assert batch.dtypes["packed_prompts"] == torch.int64
    assert batch.metadata["answer"] == ["-2", "357"]
    assert batch.metadata["task"] == ["math", "math"]
    assert batch.metadata["input_output"] == [None, None]
    batch.to_wire()  # metadata is JSON-serialisable


def test_prompts_longer_than_the_limit_are_dropped_and_counted(tokenizer, caplog):
    records = [
        {"query_id": "short", "prompt": "1+2="},
        {"query_id": "long", "prompt": "123+456+789+123+456="},
    ]
    limit = len(tokenizer.encode("1+2="))
    with caplog.at_level(logging.INFO, logger="realrl.datasets.loader"):
        dataset = PromptDataset(records, tokenizer, max_prompt_len=limit)
    assert dataset.ids == ["short"]
    assert "dropped 1 of 2 records whose prompt exceeds" in caplog.text
    with pytest.raises(DatasetError, match="all 2 records have a prompt longer than 1 tokens"):
        PromptDataset(records, tokenizer, max_prompt_len=1)


def test_sft_batch_masks_prompt_tokens_and_ends_each_sequence_with_eos(tokenizer):
    records = as_sft_records(make_arithmetic_records(3, seed=0))
    dataset = SFTDataset(records, tokenizer)
    batch = make_sft_batch(dataset, [0, 1, 2])
    input_ids, prompt_mask = batch.data["packed_input_ids"], batch.data["prompt_mask"]
    assert prompt_mask.dtype == torch.bool and prompt_mask.shape == input_ids.shape
    for record, sample in zip(records, batch.unpack()):
        ids, mask = sample.data["packed_input_ids"].tolist(), sample.data["prompt_mask"].tolist()
        prompt = tokenizer.encode(record["prompt"])
        answer = tokenizer.encode(record["answer"], add_special_tokens=False)
        assert ids == prompt + answer + [tokenizer.eos_token_id]
        assert mask == [True] * len(prompt) + [False] * (len(answer) + 1)
    assert batch.ids == [r["query_id"] for r in records]


def test_paired_batch_interleaves_positives_and_negatives(tokenizer):
    records = as_paired_records(make_arithmetic_records(2, seed=1), seed=1, num_pairs=2)
    batch = make_paired_batch(PairedDataset(records, tokenizer), [0, 1])
    assert [len(lens) for lens in batch.seqlens["packed_input_ids"]] == [4, 4]
    assert batch.seqlens["prompt_lens"] == [[1, 1], [1, 1]]
    first = batch.unpack()[0]
    prompt = tokenizer.encode(records[0]["prompt"])
    eos = [tokenizer.eos_token_id]
    expected = []
    for positive, negative in zip(records[0]["pos_answers"], records[0]["neg_answers"]):
        expected += prompt + tokenizer.encode(positive, add_special_tokens=False) + eos
        expected += prompt + tokenizer.encode(negative, add_special_tokens=False) + eos
    assert first.data["packed_input_ids"].tolist() == expected
    assert first.data["prompt_lens"].tolist() == [len(prompt), len(prompt)]


def test_datasets_reject_duplicate_ids(tokenizer):
    records = [{"query_id": "x", "prompt": "1=", "answer": "1"}] * 2
    with pytest.raises(DatasetError, match="duplicate query ids \\['x'\\]"):
        SFTDataset(records, tokenizer)


def test_epoch_iterator_visits_every_index_once_per_epoch():
    iterator = EpochIterator(dataset_size=10, batch_size=3, seed=0, drop_last=False)
    assert iterator.batches_per_epoch == 4
    first_epoch = list(iterator)
    assert [len(b) for b in first_epoch] == [3, 3, 3, 1]
    assert sorted(i for b in first_epoch for i in b) == list(range(10))
    second_epoch = list(iterator)
    assert iterator.epoch == 1 and second_epoch != first_epoch
    dropping = EpochIterator(10, 3, seed=0)
    assert [len(b) for b in dropping] == [3, 3, 3]


def test_resumed_iterator_yields_exactly_the_uninterrupted_batches():
    uninterrupted = EpochIterator(dataset_size=11, batch_size=4, seed=42)
    expected = [uninterrupted.next_batch() for _ in range(12)]  # crosses 5 epoch boundaries

    for stop_after in (0, 1, 2, 5, 11):
        interrupted = EpochIterator(11, 4, seed=42)
        served = [interrupted.next_batch() for _ in range(stop_after)]
        state = dict(interrupted.state_dict())  # what a checkpoint would hold
        resumed = EpochIterator(11, 4, seed=42)
        resumed.load_state_dict(state)
        served += [resumed.next_batch() for _ in range(12 - stop_after)]
        assert served == expected, stop_after


def test_iterator_resumed_with_another_batch_size_continues_from_the_same_sample(caplog):
    original = EpochIterator(12, 4, seed=7)
    original.next_batch()
    order = np.random.default_rng([7, 0]).permutation(12).tolist()  # the documented epoch order
    resumed = EpochIterator(12, 2, seed=7)
    with caplog.at_level(logging.WARNING, logger="realrl.datasets.loader"):
        resumed.load_state_dict(original.state_dict())
    assert "batch_size=2 (checkpoint: 4)" in caplog.text
    assert resumed.next_batch() == order[4:6]


def test_iterator_refuses_a_checkpoint_with_another_seed_or_size():
    state = EpochIterator(12, 4, seed=7).state_dict()
    with pytest.raises(ValueError, match="checkpoint has seed=7 but this run has seed=8"):
        EpochIterator(12, 4, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size=12 but this run has dataset_size=13"):
        EpochIterator(13, 4, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=5 exceeds the dataset's 4 records"):
        EpochIterator(4, 5, seed=0)


def test_epoch_iterator_without_drop_last_serves_every_sample_once_per_epoch():
    # 5 samples in batches of 2: [2, 2, 1]; a last batch of 1 cannot be split over 2
    # data-parallel ranks, so with min_batch_size=2 it joins the one before: [2, 3].
    for min_batch_size, sizes in ((1, [2, 2, 1]), (2, [2, 3])):
        iterator = EpochIterator(5, 2, seed=0, drop_last=False, min_batch_size=min_batch_size)
        assert iterator.batches_per_epoch == len(sizes)
        batches = [iterator.next_batch() for _ in sizes]
        assert [len(batch) for batch in batches] == sizes
        assert sorted(i for batch in batches for i in batch) == list(range(5))
        assert iterator.next_batch() and iterator.epoch == 1  # the next epoch starts whole
    with pytest.raises(ValueError, match="cannot be split over 4 data-parallel ranks"):
        EpochIterator(3, 2, seed=0, drop_last=False, min_batch_size=4)
