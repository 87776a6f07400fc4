"""Asynchronous rollouts' bookkeeping: AReaL's admission rule, the merge of a batch's requests
and the staleness metrics, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from realrl.api.config import BatchAssembly, RolloutConfig, RolloutMode
from realrl.api.data import SequenceSample
from realrl.workers.master import StepResult
from realrl.workers.staleness import (
    FinishedRequest,
    StalenessBound,
    group_versions,
    merge_requests,
    split_into_requests,
    staleness_stats,
    token_staleness_stats,
)


def test_admission_rule_allows_eta_plus_version_plus_one_batches():
    # eta=1, B=4 groups: at version 0, (1 + 0 + 1) * 4 = 8 groups may start in all.
    bound = StalenessBound(max_head_offpolicyness=1, batch_size=4)
    assert bound.capacity(version=0) == 8
    bound.started = 6
    assert bound.admits(2, version=0) and not bound.admits(3, version=0)  # 6 + 3 > 8
    bound.started = 8
    assert bound.capacity(0) == 0
    # One train step later: (1 + 1 + 1) * 4 - 8 = 4 more.
    assert bound.capacity(version=1) == 4
    # eta=0: only the batch of the current version, (0 + v + 1) * 4 - started.
    synchronous = StalenessBound(max_head_offpolicyness=0, batch_size=4, started=4)
    assert synchronous.capacity(version=0) == 0 and synchronous.capacity(version=1) == 4


def _simulate(eta: int, batch_size: int, steps: int) -> list[int]:
    """A generator that never waits for anything but the bound, one group per request, and a
    trainer that trains batch k as soon as its groups exist: the version that started each
    group; returns every group's staleness at training."""
    bound = StalenessBound(eta, batch_size)
    started_by: list[int] = []  # version at each group's start
    version = 0
    while version < steps:
        while bound.admits(1, version) and len(started_by) < steps * batch_size:
            started_by.append(version)
            bound.started += 1
        version += 1  # batch `version - 1` is complete: train it
    return [k // batch_size - started for k, started in enumerate(started_by)]


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_no_group_trains_more_than_eta_steps_after_the_weights_that_started_it(eta):
    staleness = _simulate(eta, batch_size=3, steps=8)
    assert max(staleness) == eta and min(staleness) == 0
    # Batch k (k >= eta) starts at version k - eta: exactly eta stale when the generator is
    # always ahead; the first eta batches start at version 0.
    assert staleness[3 * 6: 3 * 7] == [eta] * 3


def request(groups: int, version: int, stats: dict, generated_by: int, name: str):
    data = SequenceSample.from_default(
        ids=[f"{name}{i}" for i in range(groups)], seqlens=[2] * groups,
        data={"packed_prompts": torch.arange(2 * groups)},
        metadata={"weight_version": [version] * groups},
    )
    result = StepResult(data=data, stats=stats, timing={"actor_gen": 1.5},
                        compute={"actor_gen": 1.0}, generated_by={"actor": generated_by})
    return FinishedRequest(result, busy_s=1.5)


def test_merge_keeps_data_order_weights_statistics_by_groups_and_the_oldest_version():
    first = request(1, 3, {"actor_gen/response_length": 4.0, "actor_gen/peak_memory_gb": 1.0},
                     3, "a")
    second = request(3, 2, {"actor_gen/response_length": 8.0, "actor_gen/peak_memory_gb": 0.5},
                      2, "b")
    merged = merge_requests([first, second], step=7)
    assert merged.data.ids == ["a0", "b0", "b1", "b2"] and merged.step == 7
    assert merged.stats["actor_gen/response_length"] == 7.0  # (4 * 1 + 8 * 3) / 4
    assert merged.stats["actor_gen/peak_memory_gb"] == 1.0  # the larger peak
    assert merged.timing == {"actor_gen": 3.0} and merged.compute == {"actor_gen": 2.0}
    assert merged.generated_by == {"actor": 2}


def test_staleness_histogram_counts_groups_per_staleness():
    requests = [request(1, 3, {}, 3, "a"), request(3, 2, {}, 2, "b")]
    stats = staleness_stats(requests, version=4, max_head_offpolicyness=3)
    # staleness: 4 - 3 = 1 for one group, 4 - 2 = 2 for three: mean (1 + 6) / 4
    assert stats["async/staleness_mean"] == 1.75 and stats["async/staleness_max"] == 2.0
    assert [stats[f"async/staleness_{s}_groups"] for s in range(4)] == [0.0, 1.0, 3.0, 0.0]


def test_split_into_requests_keeps_the_batch_order():
    batch = request(4, 0, {}, 0, "p").result.data
    assert [part.ids for part in split_into_requests(batch, 2)] == [["p0", "p1"], ["p2", "p3"]]
    assert split_into_requests(batch, 4)[0] is batch


def test_async_settings_are_checked_with_the_key_and_a_fix():
    settings = RolloutConfig(mode=RolloutMode["async"], max_head_offpolicyness=-1,
                             groups_per_request=3, decode_steps_per_chunk=-1)
    problems = settings.validate("rollout", batch_size=8, pipeline_rollout=True,
                                 rollout_data_parallel=1, filter_drops_groups=True)
    assert len(problems) == 5
    assert "set pipeline_rollout=false" in problems[0]
    assert "`rollout.max_head_offpolicyness=-1`" in problems[1]
    assert "`rollout.groups_per_request=3` must divide `dataset.batch_size=8`" in problems[2]
    assert "`rollout.decode_steps_per_chunk=-1` must be >= 0" in problems[3]
    assert "set `rollout.assembly=finished_first`" in problems[4]
    finished_first = RolloutConfig(mode=RolloutMode["async"], assembly=BatchAssembly.finished_first)
    assert finished_first.validate("rollout", 8, False, 1, filter_drops_groups=True) == []
    # 0: one request a batch
    assert RolloutConfig(mode=RolloutMode["async"]).request_groups(batch_size=16) == 16
    assert RolloutConfig(mode=RolloutMode["async"], groups_per_request=4).request_groups(16) == 4
    below_dp = RolloutConfig(mode=RolloutMode["async"], groups_per_request=1)
    assert "data-parallel size 2" in below_dp.validate("rollout", 8, False, 2, False)[0]
    assert RolloutConfig().validate("rollout", 8, True, 2, True) == []  # mode=sync


def _versioned_groups() -> SequenceSample:
    """Two groups of two sequences each, per-token versions shifted like the log-probs (-1 where
    the next token is a prompt token): group a ran on 3 throughout; new weights (4, then 5)
    reached group b mid-way."""
    return SequenceSample.from_tensors(
        ids=["a", "b"], seqlens={"packed_weight_versions": [[3, 2], [4, 3]]},
        data={"packed_weight_versions": torch.tensor([-1, 3, 3, -1, 3,
                                                      -1, 3, 4, 4, -1, 4, 5])},
    )


def test_a_groups_version_is_its_oldest_tokens():
    assert group_versions(_versioned_groups(), default=9) == [3, 3]
    plain = request(2, 0, {}, 0, "p").result.data  # no per-token versions: the request's
    assert group_versions(plain, default=6) == [6, 6]


def test_token_staleness_counts_every_generated_token_and_the_interrupted_groups():
    stats = token_staleness_stats(_versioned_groups(), version=5)
    # Generated tokens' versions 3, 3, 3 | 3, 4, 4, 4, 5: staleness 2, 2, 2, 2, 1, 1, 1, 0,
    # mean 11 / 8; group b spans three versions.
    assert stats == {"async/token_staleness_mean": 11 / 8, "async/token_staleness_max": 2.0,
                     "async/interrupted_groups": 1.0}
    assert token_staleness_stats(request(1, 0, {}, 0, "p").result.data, 5) == {}


def test_a_bound_wait_still_going_on_counts_in_the_step_it_spans(monkeypatch):
    # The producer has waited on the bound since t=10.5; the trainer's step ran from t=10 to
    # t=11 with no request finishing: half the step was the bound's, none the generator's.
    # The next step (to t=12) gets the wait's remaining second, not the first half again.
    from realrl.workers import async_rollout

    clock = iter([11.0, 12.0])
    monkeypatch.setattr(async_rollout.time, "perf_counter", lambda: next(clock))
    rollout = async_rollout.AsyncRollout.__new__(async_rollout.AsyncRollout)
    rollout.busy_s = rollout.bound_wait_s = 0.0
    rollout.discarded_groups = rollout.discarded_tokens = 0.0
    rollout.last_mark, rollout.bound_waiting_since = 10.0, 10.5
    result = StepResult(step=1, data=None)
    result.timing["actor_train"] = 0.8
    first = rollout.interval_stats(result, ["actor_train"])
    assert first["async/bound_wait_fraction"] == pytest.approx(0.5)
    assert first["async/generator_busy_fraction"] == 0.0
    assert first["async/trainer_busy_fraction"] == pytest.approx(0.8)
    second = rollout.interval_stats(result, ["actor_train"])
    assert second["async/bound_wait_fraction"] == pytest.approx(1.0)
