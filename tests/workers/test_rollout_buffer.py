"""Which finished groups an asynchronous step trains on (`realrl.workers.rollout_buffer`): data
order, and finished-first within the staleness bound, with and without a rollout filter that
drops groups, against a simulated generator whose requests finish in random order."""

from __future__ import annotations

import random

import pytest
import torch

from realrl.api.config import BatchAssembly
from realrl.api.data import SequenceSample
from realrl.workers.master import StepResult
from realrl.workers.rollout_buffer import RolloutBuffer
from realrl.workers.staleness import FinishedRequest, StalenessBound

BATCH_SIZE, GROUPS_PER_REQUEST, RUNNING = 4, 2, 3


def _finished(name: str, groups: int) -> FinishedRequest:
    data = SequenceSample.from_default(
        ids=[f"{name}.{i}" for i in range(groups)], seqlens=[1] * groups,
        data={"packed_prompts": torch.zeros(groups, dtype=torch.long)},
    ) if groups else None
    return FinishedRequest(StepResult(data=data, timing={"actor_gen": 1.0}), busy_s=1.0)


def _simulate(assembly: BatchAssembly, eta: int, steps: int, seed: int,
              drop_probability: float = 0.0) -> list[list[tuple[str, int]]]:
    """Run `steps` train steps; requests start as the admission rule allows (at most RUNNING at
    once) and finish in random order, the filter dropping each group with
    `drop_probability`. Returns each step's (group id, staleness) in batch order."""
    rng = random.Random(seed)
    buffer = RolloutBuffer(assembly, BATCH_SIZE, BATCH_SIZE // GROUPS_PER_REQUEST, eta)
    bound = StalenessBound(eta, BATCH_SIZE)
    # Finished first: requests as large as the bound allows (the filter's drops may leave
    # room for fewer groups than GROUPS_PER_REQUEST), as `AsyncRollout.produce` starts them.
    smallest = 1 if assembly == BatchAssembly.finished_first else GROUPS_PER_REQUEST
    running, batches, version, started = [], [], 0, 0
    while len(batches) < steps:
        while len(running) < RUNNING and bound.admits(smallest, version):
            size = min(GROUPS_PER_REQUEST, bound.capacity(version))
            bound.started += size
            request = buffer.start(started // (BATCH_SIZE // GROUPS_PER_REQUEST), version)
            running.append((request, size))
            started += 1
        if buffer.ready(len(batches), version):
            parts = buffer.take(len(batches), version)
            batches.append([(group, version - admitted) for part in parts
                            for group, admitted in zip(part.result.data.ids,
                                                       part.result.data.metadata["admitted"])])
            version += 1
            continue
        request, size = running.pop(rng.randrange(len(running)))
        kept = sum(rng.random() >= drop_probability for _ in range(size))
        request.finished = _finished(f"r{request.sequence}", kept)
        if kept:
            request.finished.result.data.metadata["admitted"] = [request.admitted_version] * kept
        bound.started -= size - kept
    return batches


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("drop_probability", [0.0, 0.3])
def test_finished_first_batches_are_full_unique_and_within_the_bound(eta, drop_probability):
    for seed in range(5):
        batches = _simulate(BatchAssembly.finished_first, eta, 12, seed, drop_probability)
        groups = [group for batch in batches for group, _ in batch]
        assert all(len(batch) == BATCH_SIZE for batch in batches)
        assert len(set(groups)) == len(groups)  # none trained twice
        assert max(staleness for batch in batches for _, staleness in batch) <= eta


def test_finished_first_takes_groups_that_finish_early_and_data_order_does_not():
    data_order = _simulate(BatchAssembly.data_order, 3, 12, seed=1)
    finished_first = _simulate(BatchAssembly.finished_first, 3, 12, seed=1)
    # Data order: batch k holds requests 2k and 2k + 1, whatever finished first.
    assert [[group for group, _ in batch] for batch in data_order] == [
        [f"r{2 * k}.0", f"r{2 * k}.1", f"r{2 * k + 1}.0", f"r{2 * k + 1}.1"] for k in range(12)]
    assert finished_first != data_order
    assert max(staleness for batch in data_order for _, staleness in batch) <= 3


def test_finished_first_with_eta_0_is_data_order():
    for seed in range(3):
        assert (_simulate(BatchAssembly.finished_first, 0, 6, seed)
                == _simulate(BatchAssembly.data_order, 0, 6, seed))


def test_a_request_splits_over_two_batches_and_its_timing_counts_once():
    buffer = RolloutBuffer(BatchAssembly.finished_first, 4, 2, max_head_offpolicyness=2)
    requests = [buffer.start(0, 0) for _ in range(3)]
    for request, groups in zip(requests, (3, 0, 2)):  # the filter dropped 1, 2 and 0 groups
        request.finished = _finished(f"r{request.sequence}", groups)
    assert buffer.ready(0, 0) and buffer.buffered_groups() == 5
    parts = buffer.take(0, 0)
    assert [part.result.data.ids for part in parts] == [["r0.0", "r0.1", "r0.2"], ["r2.0"]]
    assert [part.result.timing for part in parts] == [{"actor_gen": 1.0}, {"actor_gen": 1.0}]
    assert buffer.buffered_groups() == 1 and not buffer.ready(1, 1)
    rest = buffer.requests[2]
    assert rest.available == 1
    fourth = buffer.start(1, 1)
    fourth.finished = _finished("r3", 3)
    parts = buffer.take(1, 1)
    assert [part.result.data.ids for part in parts] == [["r2.1"], ["r3.0", "r3.1", "r3.2"]]
    assert parts[0].result.timing == {} and parts[0].busy_s == 0.0  # counted with r2.0


def test_untrained_ids_are_the_finished_groups_not_taken_in_start_order():
    """What a finished-first checkpoint owes a resumed run: the groups finished and not trained
    (the rest of a request split over two batches too), in start order; not the groups the
    filter dropped (thrown away as in an uninterrupted run), nor the trained ones."""
    buffer = RolloutBuffer(BatchAssembly.finished_first, 4, 2, max_head_offpolicyness=2)
    requests = [buffer.start(0, 0) for _ in range(4)]
    for request, groups in zip(requests, (3, 0, 2, 2)):  # the filter dropped 1, 2, 0 and 0
        request.finished = _finished(f"r{request.sequence}", groups)
    assert buffer.untrained_ids() == ["r0.0", "r0.1", "r0.2", "r2.0", "r2.1", "r3.0", "r3.1"]
    buffer.take(0, 0)  # r0's 3 groups and r2.0
    assert buffer.untrained_ids() == ["r2.1", "r3.0", "r3.1"]
    later = buffer.start(1, 1)  # running: its groups are owed only once it has finished
    assert buffer.untrained_ids() == ["r2.1", "r3.0", "r3.1"]
    later.finished = _finished("r4", 1)
    assert buffer.untrained_ids() == ["r2.1", "r3.0", "r3.1", "r4.0"]
