"""The requests of an asynchronous run (`rollout.mode=async`) from their start until trained,
and which finished groups each step trains on (`rollout.assembly`).

- ``data_order``: step `k` trains the data's batch `k`, once every request of it has finished
  (with `max_head_offpolicyness=0`, synchronous training bit for bit);
- ``finished_first`` (AReaL): step `k` trains the first `B` groups to finish, but first those
  whose admission version `a` satisfies `a <= v - eta` (`v` the trainer's version): trained
  any later, they would exceed the staleness bound, so the step waits for them. There are never
  more than `B` of them: the admission rule lets at most `(eta + a + 1) * B` groups start under
  version `a`, so at most `(v + 1) * B` under versions up to `v - eta`, of which `v * B` are
  trained. With `eta = 0` that is all of batch `k`: data order again. The rest is filled with
  finished groups in start order, a request's groups split over two steps when needed.

A request whose groups the rollout filter dropped (DAPO) holds fewer groups, or none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from realrl.api.config import BatchAssembly
from realrl.workers.staleness import FinishedRequest


@dataclass
class BufferedRequest:
    sequence: int  # start order
    batch_index: int  # the data batch (relative to the run's first step) its prompts come from
    admitted_version: int  # train steps done (in this process) when it was admitted
    finished: FinishedRequest | None = None
    taken: int = 0  # its groups already trained

    @property
    def size(self) -> int:
        """Its groups, once finished (after the rollout filter)."""
        data = None if self.finished is None else self.finished.result.data
        return 0 if data is None else data.bs

    @property
    def available(self) -> int:
        return self.size - self.taken


class RolloutBuffer:
    def __init__(self, assembly: BatchAssembly, batch_size: int, requests_per_batch: int,
                 max_head_offpolicyness: int):
        self.assembly = assembly
        self.batch_size = batch_size
        self.requests_per_batch = requests_per_batch
        self.eta = max_head_offpolicyness
        self.requests: dict[int, BufferedRequest] = {}  # by sequence, until trained
        self.next_sequence = 0

    def start(self, batch_index: int, version: int) -> BufferedRequest:
        request = BufferedRequest(self.next_sequence, batch_index, version)
        self.requests[request.sequence] = request
        self.next_sequence += 1
        return request

    def buffered_groups(self) -> int:
        """Groups finished and not trained."""
        return sum(request.available for request in self.requests.values())

    def untrained_ids(self) -> list[str]:
        """The query ids of the groups finished and not trained, in start order (what a
        checkpoint owes a resumed run; the running requests' are not known here)."""
        return [query_id for request in sorted(self.requests.values(), key=_start_order)
                if request.available > 0
                for query_id in request.finished.result.data.ids[request.taken:]]

    def _must_train(self, version: int) -> list[BufferedRequest]:
        return [request for request in self.requests.values()
                if request.admitted_version <= version - self.eta]

    def ready(self, batch_index: int, version: int) -> bool:
        """Whether the step of `batch_index` (data order) or of `version` (finished first) can
        take its batch now."""
        if self.assembly == BatchAssembly.data_order:
            finished = [request for request in self.requests.values()
                        if request.batch_index == batch_index and request.finished is not None]
            return len(finished) == self.requests_per_batch
        if any(request.finished is None for request in self._must_train(version)):
            return False
        return self.buffered_groups() >= self.batch_size

    def take(self, batch_index: int, version: int) -> list[FinishedRequest]:
        """The batch `ready` said is there, as requests (or parts of them) in start order."""
        if self.assembly == BatchAssembly.data_order:
            chosen = sorted((request for request in self.requests.values()
                             if request.batch_index == batch_index), key=_start_order)
            for request in chosen:
                del self.requests[request.sequence]
            return [request.finished for request in chosen]
        must = self._must_train(version)
        rest = [request for request in self.requests.values()
                if request.finished is not None and request not in must]
        parts, wanted = [], self.batch_size
        for request in sorted(must, key=_start_order) + sorted(rest, key=_start_order):
            count = min(wanted, request.available)
            if count > 0:
                parts.append((request, _part(request, count)))
                wanted -= count
        for request, _ in parts:
            if request.available == 0:
                del self.requests[request.sequence]
        for request in [r for r in self.requests.values() if r.finished and r.size == 0]:
            del self.requests[request.sequence]  # the filter dropped all its groups
        return [part for _, part in sorted(parts, key=lambda pair: pair[0].sequence)]


def _start_order(request: BufferedRequest) -> int:
    return request.sequence


def _part(request: BufferedRequest, count: int) -> FinishedRequest:
    """`count` more groups of a finished request; its timings go with its first part only."""
    finished, first = request.finished, request.taken
    request.taken += count
    if first == 0 and count == finished.result.data.bs:
        return finished
    data = finished.result.data.reorder(list(range(first, first + count)))
    result = replace(finished.result, data=data,
                     timing=finished.result.timing if first == 0 else {},
                     compute=finished.result.compute if first == 0 else {})
    return FinishedRequest(result, finished.busy_s if first == 0 else 0.0)
