"""CPU ranks of a process group that share one machine's memory exchange tensors through it.

Why: gloo moves a tensor between ranks through TCP sockets, even between processes on one
machine. For the 4M-parameter benchmark model (16 MB of fp32) on 2 ranks, summing the
gradients that way cost ~25 ms of each rank's CPU per train step, ~7% of a compiled GRPO step,
with no idle core for the asynchronous all-reduce to hide on; sending the trained weights to
the generation layout cost ~20 ms of every PPO step (measured in `benchmarks/README.md`,
"Tenth pass").

How: tensors live in files in node-local shared memory (`/dev/shm`) that every rank of the group
maps, and gloo carries only barriers (small messages, ~0.2 ms each).

- `SharedMemorySum` (data-parallel gradients): every rank keeps its tensors in its own file. A
  sum is a reduce-scatter and an all-gather through that memory, with no copies through the
  kernel: (1) barrier: every rank has written its tensors; (2) rank r adds every peer's r-th
  slice of each tensor into its own r-th slice (peers read only their own slices of it
  meanwhile); (3) barrier; (4) rank r copies every peer's summed slice into its own tensors;
  (5) barrier: no rank reads another's memory any more. Each element is summed once, by one
  rank, so every rank ends with the same bits. For 16 MB on 2 ranks, (2) and (4) take ~1.5 ms
  each.
- `SharedMemoryBroadcast` (parameter reallocation): the sender's file holds a buffer that it
  writes and the receivers read between two barriers.
- `share_replica_weights` (frozen data-parallel replicas: the generation copy of a trained
  model, a reference split over several workers): every replica's parameters are views of one
  copy in the first rank's file. Two processes decoding at once, each with its own 15.7 MB copy
  of the benchmark model, took 0.19-0.21 s per compiled `generate` of 16 rows x 32 tokens, and
  0.166-0.172 s reading one shared copy: two copies compete for a 32 MiB L3. A reallocation
  then writes the new weights once, on one rank, instead of once per replica.

`connect_segments` works out whether this is possible and returns None (everyone falls back
to gloo) unless every rank created its file and opened every peer's: ranks on different
machines, or in containers with separate `/dev/shm`, cannot open each other's files and so
fall back on their own. Files are reserved with `posix_fallocate`, so a full `/dev/shm`
(64 MiB in a default Docker container) is a fallback, not a SIGBUS later. Each rank unlinks its
file once all peers have mapped it, so nothing is left behind even if a process dies later.
`REALRL_SHARED_MEMORY=0` turns all of this off.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHARED_MEMORY = Path("/dev/shm")
FILE_PREFIX = "realrl-shm-"
# Tensors start at multiples of this many bytes in a file (a cache line).
ALIGNMENT = 64


def connect_segments(
    group, sizes: list[int], purpose: str, directory: Path = SHARED_MEMORY
) -> list[mmap.mmap | None] | None:
    """Collective over `group`: each rank r creates a zeroed file of `sizes[r]` bytes (none for
    0) and every rank maps every file. Returns the maps by group rank (None where the size is
    0), or None on every rank when some rank could not create or map one."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    paths = [directory / f"{FILE_PREFIX}{token[0]}-{r}" for r in range(size)]
    maps: list[mmap.mmap | None] = [None] * size
    reason = None
    if sizes[rank]:
        try:
            maps[rank] = _create(paths[rank], sizes[rank])
        except OSError as error:
            reason = f"cannot reserve {sizes[rank]} bytes in {directory}: {error}"
    if _all_agree(reason is None, group):
        for peer in range(size):
            if peer != rank and sizes[peer] and reason is None:
                try:
                    maps[peer] = _open(paths[peer], sizes[peer])
                except OSError as error:
                    reason = f"cannot map rank {peer}'s {paths[peer]}: {error}"
        shared = _all_agree(reason is None, group)
    else:
        shared = False
        reason = reason or "another rank could not reserve its shared memory"
    # Every rank has mapped what it could: the names are no longer needed.
    paths[rank].unlink(missing_ok=True)
    if not shared:
        logger.info(
            "%s go through the process group: %s",
            purpose,
            reason or "another rank could not map this rank's shared memory",
        )
        return None
    return maps


def share_replica_weights(module: torch.nn.Module, group) -> mmap.mmap | None:
    """Collective over `group`, the data-parallel ranks of one frozen layout (their replicas
    hold the same weights): every rank's parameters become views of one copy, in the group's
    first rank's shared memory, holding that rank's values. Returns the memory (keep it while
    the module lives), or None on every rank, with nothing changed, when it cannot be shared.
    From then on one rank writes for all of them (`realrl.workers.realloc`)."""
    parameters = list(module.parameters())
    offsets, size = _layout([(p.numel(), p.dtype) for p in parameters])
    sizes = [size if r == 0 else 0 for r in range(dist.get_world_size(group))]
    maps = connect_segments(group, sizes, "replicas' weights")
    if maps is None:
        return None
    memory = maps[0]
    assert memory is not None
    views = [
        torch.frombuffer(memory, dtype=p.dtype, count=p.numel(), offset=offset).view(p.shape)
        for p, offset in zip(parameters, offsets, strict=True)
    ]
    if dist.get_rank(group) == 0:
        with torch.no_grad():
            for view, parameter in zip(views, parameters, strict=True):
                view.copy_(parameter)
    dist.barrier(group=group)  # the first rank has written the weights
    for view, parameter in zip(views, parameters, strict=True):
        parameter.data = view
    return memory


class SharedMemorySum:
    """This rank's tensors (`tensors`), held in memory every rank of `group` maps; `all_reduce`
    sums them over the group in place."""

    def __init__(
        self, group, rank: int, maps: list[mmap.mmap], specs: list[tuple[int, torch.dtype]]
    ) -> None:
        self.group = group
        self.rank = rank
        self.maps = maps  # one per rank of the group; kept alive while the views below exist
        offsets, _ = _layout(specs)
        self.views = [
            [
                torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset)
                if numel
                else torch.zeros(0, dtype=dtype)
                for (numel, dtype), offset in zip(specs, offsets)
            ]
            for memory in maps
        ]  # [rank][tensor]
        self.tensors = self.views[rank]
        self.chunks = [_chunks(numel, len(maps)) for numel, _ in specs]  # [tensor][rank]

    @classmethod
    def connect(
        cls,
        group,
        specs: list[tuple[int, torch.dtype]],
        directory: Path = SHARED_MEMORY,
    ) -> SharedMemorySum | None:
        """Collective over `group`: tensors of `specs` (numel, dtype) in shared memory, zeroed,
        or None on every rank when some rank cannot share memory with the others."""
        _, total = _layout(specs)
        size = dist.get_world_size(group)
        maps = connect_segments(group, [max(total, 1)] * size, "data-parallel sums", directory)
        if maps is None:
            return None
        return cls(group, dist.get_rank(group), [m for m in maps if m is not None], specs)

    def all_reduce(self) -> None:
        """Sum every tensor over the group; all ranks end with the same values."""
        mine = self.tensors
        peers = [r for r in range(len(self.views)) if r != self.rank]
        dist.barrier(group=self.group)
        for index, chunks in enumerate(self.chunks):
            start, end = chunks[self.rank]
            if end > start:
                own = mine[index][start:end]
                for peer in peers:
                    own.add_(self.views[peer][index][start:end])
        dist.barrier(group=self.group)
        for index, chunks in enumerate(self.chunks):
            for peer in peers:
                start, end = chunks[peer]
                if end > start:
                    mine[index][start:end].copy_(self.views[peer][index][start:end])
        dist.barrier(group=self.group)


class SharedMemoryBroadcast:
    """A buffer of `capacity` bytes in the sender's shared memory, mapped by every rank of
    `group`: the sender writes it (`buffer`), `publish` lets the receivers read it, and
    `release` lets the sender write it again."""

    def __init__(self, group, memory: mmap.mmap, capacity: int) -> None:
        self.group = group
        self.memory = memory  # kept alive while views of it exist
        self.capacity = capacity

    @classmethod
    def connect(
        cls, group, sender: int, capacity: int, directory: Path = SHARED_MEMORY
    ) -> SharedMemoryBroadcast | None:
        """Collective over `group`; `sender` is a global rank. None on every rank when some
        rank cannot map the sender's memory."""
        sender_index = dist.get_group_rank(group, sender)
        sizes = [capacity if r == sender_index else 0 for r in range(dist.get_world_size(group))]
        maps = connect_segments(group, sizes, "weight broadcasts", directory)
        if maps is None:
            return None
        memory = maps[sender_index]
        assert memory is not None
        return cls(group, memory, capacity)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of `dtype` at the start of the sender's memory, on every rank."""
        return torch.frombuffer(self.memory, dtype=dtype, count=numel)

    def publish(self, async_op: bool = False):
        """Barrier: the sender has written the buffer; with `async_op` the sender gets a handle
        instead of waiting for the receivers to arrive (they may come much later)."""
        return dist.barrier(group=self.group, async_op=async_op)

    def release(self, async_op: bool = False):
        """Barrier: every receiver is done reading; with `async_op` the sender gets a handle to
        wait on before it writes again."""
        return dist.barrier(group=self.group, async_op=async_op)


def write_tensor_file(tensors: dict[str, torch.Tensor],
                      directory: Path = SHARED_MEMORY) -> tuple[Path, list[tuple]]:
    """`tensors` copied into a new file in `directory`, for a process that knows no process
    group of this one (a vLLM engine's worker, `realrl.models.vllm_generation`). Returns the
    file and, per tensor, (name, dtype name, shape, byte offset) for `read_tensor_file`. The
    caller unlinks the file once the reader has read it."""
    offsets, size = _layout([(t.numel(), t.dtype) for t in tensors.values()])
    path = directory / f"{FILE_PREFIX}{secrets.token_hex(8)}-tensors"
    memory = _create(path, max(size, 1))
    specs = []
    with torch.no_grad():
        for (name, tensor), offset in zip(tensors.items(), offsets, strict=True):
            torch.frombuffer(memory, dtype=tensor.dtype, count=tensor.numel(),
                             offset=offset).copy_(tensor.reshape(-1))
            specs.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                          offset))
    memory.close()
    return path, specs


def read_tensor_file(path: Path, specs: list[tuple]) -> list[tuple[str, torch.Tensor]]:
    """The tensors `write_tensor_file` wrote to `path`, as (name, tensor) pairs: copies, so
    that the file may go at once."""
    fd = os.open(path, os.O_RDONLY)
    try:  # a private map: writable views (as torch wants), never written
        memory = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
    tensors = [
        (name, torch.frombuffer(memory, dtype=getattr(torch, dtype_name),
                                count=math.prod(shape), offset=offset).clone().view(shape))
        for name, dtype_name, shape, offset in specs
    ]
    memory.close()
    return tensors


def _layout(specs: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of the tensors of `specs` in one file, each aligned to `ALIGNMENT`, and the
    file's size."""
    offsets, offset = [], 0
    for numel, dtype in specs:
        offsets.append(offset)
        offset += -(-numel * dtype.itemsize // ALIGNMENT) * ALIGNMENT
    return offsets, offset


def _chunks(numel: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, end) element ranges covering `numel`, cut at multiples of
    `ALIGNMENT` elements so that no two ranks write one cache line."""
    step = -(-numel // (parts * ALIGNMENT)) * ALIGNMENT
    return [(min(numel, r * step), min(numel, (r + 1) * step)) for r in range(parts)]


def _create(path: Path, size: int) -> mmap.mmap:
    """A new zero-filled file of `size` bytes, its blocks reserved, mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _open(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _all_agree(ok: bool, group) -> bool:
    """Collective: whether `ok` holds on every rank of `group`."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
