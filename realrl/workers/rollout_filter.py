"""Which rollouts enter training: best-of-n selection and DAPO dynamic sampling.

Both act on the step's batch after the rollout MFCs (generation and reward), before anything
else runs. Best-of-n keeps, per prompt, the `group_size` responses with the highest reward out
of the `generation_size` generated (as AReaL does). Dynamic sampling (DAPO, Yu et al. 2025,
sec. 3.2) drops prompts whose responses all got the same reward (their group advantage is 0)
and generates for more prompts until the step has `batch_size` useful ones.
"""

from __future__ import annotations

import torch

from realrl.api.data import SequenceSample
from realrl.api.experiment import RolloutFilter


def select_sequences(sample: SequenceSample, keep: list[list[int]], keys: list[str]) -> SequenceSample:
    """Keep, in each sample i, only the sequences `keep[i]` of every key in `keys` (keys whose
    samples carry one entry per response); other keys are unchanged."""
    seqlens, data = dict(sample.seqlens), dict(sample.data)
    for key in keys:
        tensor, offsets, pieces, lengths = sample.data[key], 0, [], []
        for sample_index, sample_lengths in enumerate(sample.seqlens[key]):
            starts = [offsets + sum(sample_lengths[:j]) for j in range(len(sample_lengths))]
            kept = keep[sample_index]
            pieces += [tensor[starts[j]: starts[j] + sample_lengths[j]] for j in kept]
            lengths.append([sample_lengths[j] for j in kept])
            offsets += sum(sample_lengths)
        seqlens[key] = lengths
        data[key] = torch.cat(pieces) if pieces else tensor[:0]
    return SequenceSample(set(sample.keys), list(sample.ids), seqlens, dict(sample.trailing_shapes),
                          dict(sample.dtypes), data, dict(sample.metadata))


def per_response_keys(sample: SequenceSample, reward_key: str) -> list[str]:
    """Keys with one sequence per response (as many as rewards in every sample)."""
    counts = [len(lengths) for lengths in sample.seqlens[reward_key]]
    return sorted(key for key in sample.keys
                  if [len(lengths) for lengths in sample.seqlens[key]] == counts)


def apply_rollout_filter(sample: SequenceSample, rollout_filter: RolloutFilter
                         ) -> tuple[SequenceSample | None, dict[str, float]]:
    """Best-of-n then (optionally) drop all-equal-reward groups; returns the kept samples
    (None when none is kept) and statistics."""
    key = rollout_filter.reward_key
    rewards = sample.data[key].float().reshape(-1).tolist()
    counts = [len(lengths) for lengths in sample.seqlens[key]]
    per_sample, offset = [], 0
    for count in counts:
        per_sample.append(rewards[offset: offset + count])
        offset += count
    stats: dict[str, float] = {}
    if any(count > rollout_filter.group_size for count in counts):
        keep = [sorted(range(len(r)), key=lambda j, r=r: -r[j])[: rollout_filter.group_size]
                for r in per_sample]
        keep = [sorted(indices) for indices in keep]  # keep generation order within a group
        sample = select_sequences(sample, keep, per_response_keys(sample, key))
        per_sample = [[r[j] for j in indices] for r, indices in zip(per_sample, keep)]
        stats["rollout/best_of_n_reward"] = sum(map(sum, per_sample)) / sum(map(len, per_sample))
    if rollout_filter.drop_equal_reward_groups:
        useful = [i for i, r in enumerate(per_sample) if max(r) != min(r)]
        stats["rollout/all_equal_fraction"] = 1.0 - len(useful) / max(1, sample.bs)
        stats["rollout/all_correct_fraction"] = sum(
            1 for r in per_sample if min(r) == max(r) and min(r) > 0) / max(1, sample.bs)
        sample = sample.reorder(useful) if useful else None
    return sample, stats


def discarded_by_filter(before: SequenceSample, after: SequenceSample | None) -> tuple[int, int]:
    """(groups, generated tokens) that `apply_rollout_filter` threw away: the prompts it dropped
    and the response tokens (outside `prompt_mask`) of every response it did not keep."""
    def response_tokens(sample: SequenceSample | None) -> int:
        if sample is None:
            return 0
        return int(sample.data["prompt_mask"].logical_not().sum())

    kept_groups = 0 if after is None else after.bs
    return before.bs - kept_groups, response_tokens(before) - response_tokens(after)
