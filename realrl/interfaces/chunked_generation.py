"""Generation requests in chunks of decode steps: the worker's half of interruptible generation.

With `rollout.mode=async` the master sends a generate MFC as a sequence of requests, each
asking for at most `rollout.decode_steps_per_chunk` more decode steps of the same *session*
(`realrl.workers.chunked_generation` is the master's half). The worker keeps the session's
state (`realrl.models.interruptible_generation.InterruptibleGeneration`: its KV cache and the
tokens so far) between the requests, and serves other requests meanwhile, among them the weight
transfers that bring the trainer's new weights: the next chunk names the new version and the
session goes on under it, with its cache recomputed or kept (`rollout.interrupt_kv_cache`).
The first request of a session carries the prompts; the last one's reply carries the rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from realrl.api.data import SequenceSample
from realrl.models.interruptible_generation import InterruptibleGeneration
from realrl.models.sampling import GenerationConfig


@dataclass(frozen=True)
class ChunkRequest:
    """One chunk's header (`"chunk"` in an `mfc` request)."""

    session: str  # unique per generate call of the master
    steps: int  # decode steps at most; 0: to the end
    version: int  # the weights' version this chunk runs on
    kv_cache: str  # recompute | keep, when `version` is newer than the last chunk's

    def header(self) -> dict:
        return {"session": self.session, "steps": self.steps, "version": self.version,
                "kv_cache": self.kv_cache}


@dataclass
class GenerationSession:
    """A generation in flight on this worker, between two of its chunks."""

    generation: InterruptibleGeneration
    prompts: SequenceSample  # the first request's data
    compute_s: float  # seconds spent in its chunks


class ChunkedGenerations:
    """The sessions in flight on this worker for one generate MFC."""

    def __init__(self) -> None:
        self.sessions: dict[str, GenerationSession] = {}  # by `ChunkRequest.session`

    def run(self, model, data: SequenceSample | None, request: ChunkRequest,
            config: Callable[[], GenerationConfig], generator) -> GenerationSession | None:
        """Start the session (`data` holds its prompts) or continue it by one chunk; returns
        it once done (and forgets it), else None."""
        started = time.perf_counter()
        session = self.sessions.get(request.session)
        if session is None:
            if data is None:
                raise ValueError(
                    f"chunked generation: no session {request.session!r} on this worker and no "
                    "prompts to start it (the master sends them with the first chunk)")
            generation = InterruptibleGeneration.start(
                model, data.data["packed_prompts"], data.cu_seqlens("packed_prompts"),
                config(), generator, request.version)
            session = self.sessions[request.session] = GenerationSession(generation, data, 0.0)
        done = session.generation.decode(model, request.steps, request.version,
                                         request.kv_cache)
        session.compute_s += time.perf_counter() - started
        if not done:
            return None
        return self.sessions.pop(request.session)
