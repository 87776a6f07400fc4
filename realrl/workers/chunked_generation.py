"""Interruptible generation, the master's half: a generate MFC sent as chunks of decode steps.

With `rollout.mode=async` and `rollout.decode_steps_per_chunk > 0`, a generate MFC that writes
per-token weight versions (`WEIGHT_VERSIONS_KEY`; `ppo_math` declares it in async mode) runs as
a sequence of requests to its mesh, each asking every unfinished data-parallel rank for at most
that many more decode steps of one session (`realrl.interfaces.chunked_generation` is the
worker's half). The generation ranks' locks are given back between two chunks, so the trainer's
new weights (`Master.refresh`, queued on those locks) arrive at a decode-step boundary; the next
chunk names the new version and goes on under it, its KV cache recomputed or kept
(`rollout.interrupt_kv_cache`). A request that finds its layout stale brings it up to date
itself first, as a whole call does. No chunk is dropped or repeated: each rank's session ends
exactly once, with the reply that carries its rollout.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef
from realrl.interfaces.chunked_generation import ChunkRequest
from realrl.workers.realloc import transfer_ranks
from realrl.workers.wire import Message

# The per-token key whose producer runs in chunks: the weight version that chose each token,
# shifted like `packed_logprobs` (-1 where the next token is a prompt token).
WEIGHT_VERSIONS_KEY = "packed_weight_versions"

_session_numbers = itertools.count()


@dataclass(frozen=True)
class ChunkSettings:
    decode_steps: int  # per chunk; 0: the whole generation in one request
    kv_cache: str  # recompute | keep
    version_offset: int  # added to the master's weight versions (train steps before this run)


def runs_in_chunks(mfc: MFCDef) -> bool:
    return WEIGHT_VERSIONS_KEY in mfc.output_keys


async def run_in_chunks(master, mfc: MFCDef, result, settings: ChunkSettings) -> None:
    """Run generate MFC `mfc` on `result.data` chunk by chunk and merge its outputs into it,
    as `Master._run_mfc` does for a whole call (`master` is that `Master`)."""
    allocation = master.plan.allocations[mfc.name]
    layout, owner = master.plan.layout_of(mfc.name), master.plan.owner_layout(mfc.model_role)
    inputs = result.data.select(mfc.input_keys)
    parts, _, backward_indices = inputs.split_data_parallel(allocation.strategy.data)
    session = f"{mfc.name}/{result.step}/{next(_session_numbers)}"
    outputs: dict[int, SequenceSample] = {}
    stats: dict[int, dict] = {}
    # The seconds of the chunks' requests only: between two, the ranks serve other requests.
    busy_s, compute_s, first = 0.0, 0.0, True
    while len(outputs) < len(parts):
        refresh = master.is_stale(mfc)
        ranks = set(allocation.mesh.ranks) | (set(transfer_ranks(owner, layout)) if refresh
                                              else set())
        async with master.locked(sorted(ranks), result.step):
            if refresh and master.is_stale(mfc):
                await master.refresh_layout(mfc, result)
            if first:
                master.record_policy_lag(mfc, result)
            request = ChunkRequest(session, settings.decode_steps,
                                   settings.version_offset + master.layout_version[layout],
                                   settings.kv_cache)
            started = time.perf_counter()
            replies = await _send_chunk(master, mfc, result.step, parts, outputs, request, first)
            busy_s += time.perf_counter() - started
        first = False
        compute_s += max(reply.header.get("compute_s", 0.0) for _, _, reply in replies)
        peak_key = f"{mfc.name}/peak_memory_gb"
        result.stats[peak_key] = max([result.stats.get(peak_key, 0.0)] + [
            reply.header.get("peak_memory_gb", 0.0) for _, _, reply in replies])
        for dp_rank, is_head, reply in replies:
            if is_head and reply.header.get("chunk_done"):
                outputs[dp_rank] = SequenceSample.from_wire(reply.header["data"], reply.tensors)
                stats[dp_rank] = reply.header.get("stats", {})
    result.timing[mfc.name] = busy_s
    result.compute[mfc.name] = compute_s
    for key in {key for values in stats.values() for key in values}:
        values = [values[key] for values in stats.values() if key in values]
        result.stats[f"{mfc.name}/{key}"] = sum(values) / len(values)
    merged = SequenceSample.gather([outputs[dp] for dp in range(len(parts))])
    result.data.update_(merged.reorder(backward_indices).select(mfc.output_keys))


async def _send_chunk(master, mfc: MFCDef, step: int, parts: list[SequenceSample],
                      finished: dict[int, SequenceSample], request: ChunkRequest,
                      first: bool) -> list[tuple[int, bool, Message]]:
    """One chunk to every rank of the data-parallel ranks not finished; (dp rank, whether the
    rank is its replica's head, reply) per rank. The first chunk carries the prompts."""
    allocation = master.plan.allocations[mfc.name]
    heads = set(allocation.dp_head_ranks())
    calls, where = [], []
    for dp_rank, part in enumerate(parts):
        if dp_rank in finished:
            continue
        meta, tensors = part.to_wire() if first else ({}, {})
        for rank in allocation.ranks_of_dp_rank(dp_rank):
            header = {"mfc": mfc.name, "step": step, "chunk": request.header()}
            if first:
                header["data"] = meta
            calls.append(master.request(rank, Message("mfc", header, tensors), mfc.name, step))
            where.append((dp_rank, rank in heads))
    replies = await asyncio.gather(*calls)
    return [(dp_rank, is_head, reply) for (dp_rank, is_head), reply in zip(where, replies)]
