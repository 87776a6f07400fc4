import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realrl.api.data import SequenceSample, balanced_partition


def make_group_sample() -> SequenceSample:
    """3 prompts; sample i has a prompt and a group of responses; rewards are per-sample scalars."""
    prompt_lens = [[2], [3], [1]]
    response_lens = [[1, 2], [4], [0, 3, 1]]
    return SequenceSample.from_tensors(
        ids=["a", "b", "c"],
        seqlens={
            "packed_prompts": prompt_lens,
            "packed_logprobs": response_lens,
            "rewards": [[1]] * 3,
        },
        data={
            "packed_prompts": torch.arange(6),  # [2 + 3 + 1]
            "packed_logprobs": torch.arange(11, dtype=torch.float32).reshape(11, 1),  # [3+4+4, 1]
            "rewards": torch.tensor([0.5, -1.0, 2.0]),  # [bs]
        },
        metadata={"answer": ["1", "2", "3"]},
    )


def test_from_default_gives_one_sequence_per_sample_and_scalar_keys_one_row():
    sample = SequenceSample.from_default(
        ids=[0, 1],
        seqlens=[3, 2],
        data={"packed_input_ids": torch.arange(5), "rewards": torch.tensor([1.0, 2.0])},
        scalar_keys=["rewards"],
    )
    assert sample.seqlens == {"packed_input_ids": [[3], [2]], "rewards": [[1], [1]]}
    assert sample.bs == 2
    assert sample.total_tokens("packed_input_ids") == 5
    assert sample.dtypes["rewards"] == torch.float32
    assert sample.trailing_shapes["packed_input_ids"] == ()


def test_sizes_and_cu_seqlens_flatten_the_groups():
    sample = make_group_sample()
    assert sample.seqlens_of("packed_logprobs") == [1, 2, 4, 0, 3, 1]
    assert sample.cu_seqlens("packed_logprobs").tolist() == [0, 1, 3, 7, 7, 10, 11]
    assert sample.cu_seqlens("packed_logprobs").dtype == torch.int32
    assert sample.total_tokens("packed_prompts") == 6
    # default weight: largest per-sample total over keys: max(2,3,1)=3, max(3,4,1)=4, max(1,4,1)=4
    assert sample.sample_token_counts() == [3, 4, 4]
    assert sample.sample_token_counts("packed_prompts") == [2, 3, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(data={"x": torch.arange(4)}), "'x': tensor shape (4,) but seqlens sum to 5"),
        (dict(data={"x": torch.zeros(5, 2)}), "'x': tensor trailing shape (2,)"),
        (dict(data={"x": torch.zeros(5)}), "'x': tensor dtype torch.float32"),
        (dict(ids=["a", "a"]), "duplicate sample ids ['a']"),
        (dict(metadata={"answer": ["1"]}), "metadata 'answer' has 1 values but the batch has 2"),
        (dict(seqlens={"x": [[3], [-1, 3]]}), "'x': negative sequence length"),
        (dict(seqlens={"x": [[5]]}), "'x': seqlens has 1 samples but there are 2 ids"),
        (dict(dtypes={}), "SequenceSample.dtypes has keys []"),
    ],
)
def test_constructor_rejects_inconsistent_fields_naming_the_key(kwargs, message):
    fields = dict(
        keys={"x"},
        ids=["a", "b"],
        seqlens={"x": [[3], [2]]},
        trailing_shapes={"x": ()},
        dtypes={"x": torch.int64},
        data={"x": torch.arange(5)},
        metadata={},
    )
    fields.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        SequenceSample(**fields)


def test_from_default_rejects_scalar_key_with_wrong_row_count():
    with pytest.raises(ValueError, match="scalar key 'rewards' has 3 rows but there are 2 samples"):
        SequenceSample.from_default(
            [0, 1], [1, 1], {"rewards": torch.zeros(3)}, scalar_keys=["rewards"]
        )


def test_unpack_then_gather_restores_the_batch():
    sample = make_group_sample()
    parts = sample.unpack()
    assert [p.ids for p in parts] == [["a"], ["b"], ["c"]]
    assert parts[2].data["packed_logprobs"].flatten().tolist() == [7.0, 8.0, 9.0, 10.0]
    assert parts[1].metadata == {"answer": ["2"]}
    assert SequenceSample.gather(parts).allclose(sample)


def test_reorder_moves_every_key_and_metadata_together():
    sample = make_group_sample().reorder([2, 0])
    assert sample.ids == ["c", "a"]
    assert sample.data["packed_prompts"].tolist() == [5, 0, 1]
    assert sample.data["rewards"].tolist() == [2.0, 0.5]
    assert sample.seqlens["packed_logprobs"] == [[0, 3, 1], [1, 2]]
    assert sample.metadata["answer"] == ["3", "1"]


def test_reorder_rejects_duplicate_or_out_of_range_indices():
    with pytest.raises(ValueError, match="distinct and in \\[0, 3\\)"):
        make_group_sample().reorder([0, 0])
    with pytest.raises(ValueError, match="distinct"):
        make_group_sample().reorder([3])


def test_gather_rejects_missing_key_and_mismatched_dtype():
    sample = make_group_sample()
    first, second = sample.unpack()[:2]
    with pytest.raises(ValueError, match="sample 1 lacks key\\(s\\) \\['rewards'\\]"):
        SequenceSample.gather([first, second.select(["packed_prompts", "packed_logprobs"])])
    other = second.select(["rewards"])
    other.data["rewards"] = other.data["rewards"].double()
    other.dtypes["rewards"] = torch.float64
    with pytest.raises(ValueError, match="key 'rewards' of sample 1 has trailing shape"):
        SequenceSample.gather([first, other], keys=["rewards"])


def test_microbatches_respect_budget_and_keep_oversized_sample_alone():
    sample = SequenceSample.from_default(
        ids=list(range(5)), seqlens=[4, 9, 3, 2, 5], data={"packed_input_ids": torch.arange(23)}
    )
    microbatches, forward, backward = sample.split_microbatches(max_tokens_per_microbatch=6)
    # ceil(23 / 6) = 4 parts; heaviest first to the lightest part: 9 -> p0, 5 -> p1, 4 -> p2,
    # 3 -> p3, 2 -> p3 (3 + 2 = 5 <= 6). The oversized 9 sits alone.
    assert [mb.ids for mb in microbatches] == [[0], [1], [2, 3], [4]]
    assert [mb.total_tokens("packed_input_ids") for mb in microbatches] == [4, 9, 5, 5]
    assert forward == [0, 1, 2, 3, 4]
    assert SequenceSample.gather(microbatches).reorder(backward).allclose(sample)


def test_microbatches_honour_minimum_count_capped_at_batch_size():
    sample = SequenceSample.from_default([0, 1], [3, 3], {"packed_input_ids": torch.arange(6)})
    microbatches, _, _ = sample.split_microbatches(None, min_num_microbatches=5)
    assert [mb.bs for mb in microbatches] == [1, 1]
    single, forward, _ = sample.split_microbatches(None)
    assert len(single) == 1 and forward == [0, 1]


def test_split_data_parallel_balances_tokens_and_rejects_small_batches():
    sample = SequenceSample.from_default(
        list("abcd"), [8, 1, 7, 2], {"packed_input_ids": torch.arange(18)}
    )
    parts, _, backward = sample.split_data_parallel(2)
    # LPT: 8 -> part0, 7 -> part1, 2 -> part1 (9), 1 -> part0 (9)
    assert sorted(p.total_tokens("packed_input_ids") for p in parts) == [9, 9]
    assert SequenceSample.gather(parts).reorder(backward).allclose(sample)
    with pytest.raises(ValueError, match="batch of 4 samples over 5 data-parallel ranks"):
        sample.split_data_parallel(5)


def test_select_rename_and_update_manage_keys():
    sample = make_group_sample()
    selected = sample.select(["rewards"])
    assert selected.keys == {"rewards"} and selected.data["rewards"] is sample.data["rewards"]
    renamed = sample.rename({"packed_logprobs": "packed_ref_logprobs"})
    assert "packed_ref_logprobs" in renamed.keys and "packed_logprobs" not in renamed.keys
    with pytest.raises(ValueError, match="two keys the same name"):
        sample.rename({"rewards": "packed_prompts"})
    with pytest.raises(KeyError, match="no key\\(s\\) \\['nope'\\]; available keys"):
        sample.select(["nope"])
    base = sample.select(["packed_prompts"])
    base.update_(renamed.select(["packed_ref_logprobs"]))
    assert base.keys == {"packed_prompts", "packed_ref_logprobs"}
    with pytest.raises(ValueError, match="ids differ"):
        base.update_(sample.reorder([1, 0, 2]))
    base.remap_keys_({"packed_prompts": "packed_input_ids"})
    assert base.keys == {"packed_input_ids", "packed_ref_logprobs"}


def test_update_on_a_derived_sample_leaves_the_original_untouched():
    original = make_group_sample()
    derived = original.reorder([0, 1, 2])
    derived.update_(original.rename({"rewards": "returns"}).select(["returns"]))
    assert "returns" in derived.keys and "returns" in derived.dtypes
    assert original.keys == {"packed_prompts", "packed_logprobs", "rewards"}
    assert set(original.dtypes) == set(original.data) == original.keys


def test_wire_round_trip_is_exact_through_json():
    sample = make_group_sample()
    meta, tensors = sample.to_wire()
    rebuilt = SequenceSample.from_wire(json.loads(json.dumps(meta)), tensors)
    assert rebuilt.allclose(sample, rtol=0, atol=0)


def test_wire_round_trip_keeps_bfloat16_and_data_free_keys():
    sample = SequenceSample.from_tensors(
        ids=[7],
        seqlens={"h": [[2]], "later": [[3]]},
        data={"h": torch.randn(2, 4).bfloat16(), "later": None},
        trailing_shapes={"later": ()},
        dtypes={"later": torch.int64},
    )
    meta, tensors = sample.to_wire()
    assert set(tensors) == {"h"}
    assert SequenceSample.from_wire(json.loads(json.dumps(meta)), tensors).allclose(sample)


def test_to_wire_rejects_metadata_that_is_not_json():
    sample = SequenceSample.from_default(["q"], [1], {"x": torch.zeros(1)}, {"obj": [object()]})
    with pytest.raises(ValueError, match="metadata 'obj' value for sample 0 \\(id 'q'\\)"):
        sample.to_wire()


def test_from_wire_rejects_tensor_set_that_disagrees_with_header():
    meta, tensors = make_group_sample().to_wire()
    del tensors["rewards"]
    with pytest.raises(ValueError, match="do not match the header's keys with data"):
        SequenceSample.from_wire(meta, tensors)


def test_balanced_partition_puts_each_item_in_exactly_one_part():
    groups = balanced_partition([5, 5, 5, 5], min_parts=2, max_weight_per_part=None)
    assert groups == [[0, 2], [1, 3]]


# ---------------------------------------------------------------- property tests


@st.composite
def random_samples(draw) -> SequenceSample:
    bs = draw(st.integers(1, 12))
    group_size = draw(st.integers(1, 4))
    prompt_lens = [[draw(st.integers(0, 20))] for _ in range(bs)]
    response_lens = [
        [draw(st.integers(0, 15)) for _ in range(draw(st.integers(1, group_size)))]
        for _ in range(bs)
    ]
    hidden = draw(st.integers(1, 3))
    total_prompt = sum(sum(x) for x in prompt_lens)
    total_response = sum(sum(x) for x in response_lens)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return SequenceSample.from_tensors(
        ids=[f"q{i}" for i in range(bs)],
        seqlens={
            "packed_prompts": prompt_lens,
            "packed_values": response_lens,
            "rewards": [[1]] * bs,
        },
        data={
            "packed_prompts": torch.randint(0, 100, (total_prompt,), generator=generator),
            "packed_values": torch.randn(total_response, hidden, generator=generator),
            "rewards": torch.randn(bs, generator=generator),
        },
        metadata={"answer": [str(i) for i in range(bs)]},
    )


@settings(max_examples=60, deadline=None)
@given(
    sample=random_samples(),
    budget=st.integers(1, 40),
    min_count=st.integers(1, 6),
    token_key=st.sampled_from([None, "packed_values", "packed_prompts"]),
)
def test_microbatch_split_is_a_lossless_permutation_within_budget(
    sample, budget, min_count, token_key
):
    microbatches, forward, backward = sample.split_microbatches(budget, min_count, token_key)
    assert len(microbatches) >= min(min_count, sample.bs)
    assert sorted(forward) == list(range(sample.bs))
    for mb in microbatches:
        assert mb.bs >= 1
        assert sum(mb.sample_token_counts(token_key)) <= budget or mb.bs == 1
    for key in sample.keys:
        assert sum(mb.total_tokens(key) for mb in microbatches) == sample.total_tokens(key)
    assert SequenceSample.gather(microbatches).reorder(backward).allclose(sample, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(sample=random_samples(), n=st.integers(1, 6))
def test_data_parallel_split_is_a_lossless_permutation_into_n_parts(sample, n):
    if sample.bs < n:
        with pytest.raises(ValueError, match="every rank needs at least one sample"):
            sample.split_data_parallel(n)
        return
    parts, forward, backward = sample.split_data_parallel(n)
    assert len(parts) == n and all(p.bs >= 1 for p in parts)
    assert [i for p in parts for i in p.ids] == [sample.ids[i] for i in forward]
    assert SequenceSample.gather(parts).reorder(backward).allclose(sample, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(sample=random_samples())
def test_wire_round_trip_is_exact_for_random_samples(sample):
    meta, tensors = sample.to_wire()
    rebuilt = SequenceSample.from_wire(json.loads(json.dumps(meta)), tensors)
    assert rebuilt.allclose(sample, rtol=0, atol=0)
