"""The paired interfaces (`paired_rw`, `dpo`) report the same statistics on 1 and 2 gloo
data-parallel ranks, equal to the hand-computed ones.

The batch has four pairs: sample ``a`` holds two, samples ``b`` and ``c`` one each. Rank 0
takes ``a`` and rank 1 takes ``b`` and ``c``, so the ranks hold equal pair counts but a
different number of samples. Each pair's order (which completion is "positive") is chosen from
the model's own scores so that exactly 3 of the 4 pairs are ranked right: accuracy 0.75.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from interface_helpers import EOS_ID, build_model, make_engine
from rank_processes import start_ranks

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.backends.torch_engine import ParallelContext
from realrl.interfaces.configs import DPOConfig
from realrl.interfaces.dpo import DPOInterface
from realrl.interfaces.paired_rw import PairedRewardInterface
from realrl.interfaces.reference import ReferenceInterface

VOCAB_SIZE = 40
# (prompt, [(completion, completion), ...]) per sample; the order within a pair is set later.
SAMPLES = {
    "a": ([4, 13, 5, 17], [([6, EOS_ID], [7, 8, EOS_ID]), ([9, 9, EOS_ID], [10, EOS_ID])]),
    "b": ([7, 7, 17], [([20, 21, 22, EOS_ID], [23, EOS_ID])]),
    "c": ([30, 3, 17], [([11, EOS_ID], [12, 12, EOS_ID])]),
}
RANK_SAMPLES = (["a"], ["b", "c"])
# Pair 2 (sample b's) is put the wrong way round: the model scores its "negative" higher.
WRONG_WAY_PAIR = 2


def _batch(samples: dict) -> SequenceSample:
    tokens, seqlens, prompt_lens = [], [], []
    for prompt, pairs in samples.values():
        lengths = []
        for pair in pairs:
            for completion in pair:
                tokens += prompt + completion
                lengths.append(len(prompt) + len(completion))
            prompt_lens.append(len(prompt))
        seqlens.append(lengths)
    return SequenceSample.from_tensors(
        ids=list(samples),
        seqlens={
            "packed_input_ids": seqlens,
            "prompt_lens": [[1] * len(pairs) for _, pairs in samples.values()],
        },
        data={"packed_input_ids": torch.tensor(tokens), "prompt_lens": torch.tensor(prompt_lens)},
    )


def _ordered_samples(scores: torch.Tensor) -> dict:
    """`SAMPLES` with each pair ordered (higher score first) except `WRONG_WAY_PAIR`;
    ``scores [8]`` are per-sequence scores of `SAMPLES` in its own order."""
    ordered, pair_index = {}, 0
    for sample_id, (prompt, pairs) in SAMPLES.items():
        new_pairs = []
        for first, second in pairs:
            higher_first = scores[2 * pair_index] > scores[2 * pair_index + 1]
            right_way = higher_first != (pair_index == WRONG_WAY_PAIR)
            new_pairs.append((first, second) if right_way else (second, first))
            pair_index += 1
        ordered[sample_id] = (prompt, new_pairs)
    return ordered


def _sequence_scores(model, data: SequenceSample) -> torch.Tensor:
    """Each sequence's value at its last token, ``[num_seqs]``."""
    cu_seqlens = data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        values = model(data.data["packed_input_ids"], cu_seqlens)
    return values[cu_seqlens[1:].long() - 1]


def _rank_batch(data: SequenceSample, sample_ids: list[str]) -> SequenceSample:
    return data.reorder([data.ids.index(sample_id) for sample_id in sample_ids])


def _reward_model_stats(parallel: ParallelContext, sample_ids: list[str]) -> dict:
    model = build_model(VOCAB_SIZE, critic=True)
    data = _batch(_ordered_samples(_sequence_scores(model, _batch(SAMPLES))))
    engine = make_engine(model, None, lr=1e-3, parallel=parallel)
    return PairedRewardInterface().train_step(
        engine, _rank_batch(data, sample_ids), MicroBatchSpec()
    ).stats


def _dpo_stats(parallel: ParallelContext, sample_ids: list[str]) -> dict:
    data = _batch(SAMPLES)
    reference = make_engine(build_model(VOCAB_SIZE, seed=1), None, lr=None)
    data.update_(ReferenceInterface().inference(reference, data, MicroBatchSpec()).data)
    engine = make_engine(build_model(VOCAB_SIZE), None, lr=1e-3, parallel=parallel)
    return DPOInterface(DPOConfig(beta=0.5)).train_step(
        engine, _rank_batch(data, sample_ids), MicroBatchSpec()
    ).stats


def _worker(rank: int, rendezvous: str, output: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        parallel = ParallelContext(dp_rank=rank, dp_size=2, dp_group=dist.new_group([0, 1]))
        stats = {
            "paired_rw": _reward_model_stats(parallel, RANK_SAMPLES[rank]),
            "dpo": _dpo_stats(parallel, RANK_SAMPLES[rank]),
        }
        torch.save(stats, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _expected_reward_model_stats() -> dict:
    """Accuracy, mean scores and loss by hand from the model's scores of the ordered pairs."""
    model = build_model(VOCAB_SIZE, critic=True)
    data = _batch(_ordered_samples(_sequence_scores(model, _batch(SAMPLES))))
    scores = _sequence_scores(model, data)  # [8] pos0, neg0, pos1, neg1, ...
    positive, negative = scores[0::2], scores[1::2]
    return {
        "accuracy": 0.75,  # 3 of 4 pairs ranked right by construction
        "positive_score": positive.sum().item() / 4,
        "negative_score": negative.sum().item() / 4,
        "loss": -F.logsigmoid(positive - negative).sum().item() / 4,
    }


def test_paired_statistics_match_on_one_and_two_data_parallel_ranks(tmp_path):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    output = str(tmp_path / "result")
    start_ranks(_worker, (str(tmp_path / "rendezvous"), output), 2)
    ranks = [torch.load(f"{output}.rank{rank}") for rank in range(2)]
    all_samples = RANK_SAMPLES[0] + RANK_SAMPLES[1]

    expected = _expected_reward_model_stats()
    single = _reward_model_stats(ParallelContext(), all_samples)
    for stats in (single, ranks[0]["paired_rw"], ranks[1]["paired_rw"]):
        for name, value in expected.items():
            assert stats[name] == pytest.approx(value, abs=1e-5), name

    single_dpo = _dpo_stats(ParallelContext(), all_samples)
    for name in ("loss", "accuracy", "reward_margin", "chosen_reward", "rejected_reward"):
        for rank in range(2):
            assert ranks[rank]["dpo"][name] == pytest.approx(single_dpo[name], abs=1e-6), name
