"""Parameter reallocation: move (or blend) a role's newest weights between layouts.

A transfer goes from a *source* layout (the owner of the newest weights) to a *target* layout:
`target = eta * source + (1 - eta) * target`, with eta = 1 for a plain reallocation and
0 < eta < 1 for the EMA reference update. Layouts may be tensor parallel (tp fastest in a
layout's ranks, so the tp group of data-parallel replica 0 is `ranks[:tensor]`).

Who does what, in buckets of whole parameters, never through the disk:
- *local* ranks hold a source shard identical in slicing to their target shard (same tensor
  size and tp rank; every data-parallel replica of the source is identical) and blend locally;
- the *sender* (the source's first rank) gathers the full parameters from the tp group of the
  source's replica 0 and broadcasts them over a process group made at start-up;
- *receivers* (every other target rank) take the full parameters and keep their own tp slice.
  On CPU, when every rank of the broadcast group can map the sender's shared memory
  (`realrl.backends.shared_memory`), the sender writes each bucket there and the receivers read
  it between two barriers, instead of a gloo broadcast through sockets. A rank that also blends
  locally does so while the receivers read. The benchmark's PPO actor, 16 MB from its train
  rank to both generation ranks every step: 15-21 -> 10 ms (two processes, one thread each).
  A posting sender (`pending`: CPU, it blends nothing) of a single bucket does not wait for
  the receivers at all, so the master may *split* a later transfer between the same layouts
  (`split_transfer_ranks`, `Master.refresh`): the sender is asked first and returns once its
  buffer is written, the receivers once their generation chunk is done, and the master's
  order of the two requests replaces the barriers (in gloo: the sender's broadcast is posted).
  The generation rank's part of the default actor's refresh: 6.1 ms with the two barriers
  (each waits for a thread of the busy train process to be scheduled), 1.7 ms without.
Frozen data-parallel layouts on CPU share one copy of their weights when their ranks can map
each other's shared memory (`share_replica_weights`); a transfer into one is then written by one
rank only (`shared_writer`), and the others take part in the broadcast without copying.
A role with LoRA adapters (`realrl.models.lora`) moves only what trains, its adapters (and a
critic's value head): its base weights are the checkpoint's in every layout and never change
(`moving_parameter_shapes`). So does the EMA hook into a reference that shares the actor's
base weights: it blends the actor's adapter into the reference's own, factor by factor.
Every rank named by `transfer_ranks` must call `transfer_parameters` for the same transfer; the
master sends the request to all of them. Each rank enters gathers and broadcasts in bucket
order, so ranks in both the gather group and the broadcast group cannot deadlock.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from realrl.api import environment
from realrl.api.allocation import ParallelStrategy
from realrl.backends import shared_memory
from realrl.backends.torch_engine import TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.lora import add_adapters, has_adapters, trained_parameter_names
from realrl.models.tensor_parallel import shard_state_dict, unshard_state_dicts
from realrl.models.transformer import Transformer, on_meta_device
from realrl.workers.run_plan import LayoutKey, RunPlan

BUCKET_BYTES = 64 * 1024 * 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------- who takes part


def tensor_size(layout: LayoutKey) -> int:
    return ParallelStrategy.parse(layout.strategy).tensor


def tensor_rank(layout: LayoutKey, rank: int) -> int:
    """`rank`'s tp coordinate in `layout` (tp varies fastest over the layout's ranks)."""
    return layout.ranks.index(rank) % tensor_size(layout)


def source_rank(source: LayoutKey) -> int:
    return source.ranks[0]


def gather_group_ranks(source: LayoutKey) -> list[int]:
    """The tp group of the source's data-parallel replica 0; the sender gathers from it."""
    return list(source.ranks[: tensor_size(source)])


def local_ranks(source: LayoutKey, target: LayoutKey) -> list[int]:
    """Target ranks whose own source shard has exactly the slicing of their target shard."""
    if tensor_size(source) != tensor_size(target):
        return []
    return [
        rank
        for rank in target.ranks
        if rank in source.ranks and tensor_rank(source, rank) == tensor_rank(target, rank)
    ]


def receiver_ranks(source: LayoutKey, target: LayoutKey) -> list[int]:
    """Target ranks that get the full parameters by broadcast from the sender."""
    local = local_ranks(source, target)
    return [rank for rank in target.ranks if rank not in local and rank != source_rank(source)]


def _sender_blends(source: LayoutKey, target: LayoutKey) -> bool:
    """The sender holds a target shard sliced differently: it blends from the full weights."""
    sender = source_rank(source)
    return sender in target.ranks and sender not in local_ranks(source, target)


def _needs_full_parameters(source: LayoutKey, target: LayoutKey) -> bool:
    return bool(receiver_ranks(source, target)) or _sender_blends(source, target)


def shared_writer(source: LayoutKey, target: LayoutKey) -> int:
    """The rank that writes a target whose replicas share their weights: a local blender if
    there is one (no broadcast needed), else the sender if it blends, else the first receiver."""
    local = local_ranks(source, target)
    if local:
        return local[0]
    if _sender_blends(source, target):
        return source_rank(source)
    return receiver_ranks(source, target)[0]


def share_replica_weights(engine: TorchEngine, layout: LayoutKey, private: bool) -> bool:
    """Collective over `layout`'s data-parallel group: make its replicas share one copy of their
    weights where that applies (a CPU layout with data parallelism and no tensor parallelism,
    shared memory on, not `private`: each replica of a trained layout, or of a bf16 EMA target
    with its fp32 EMA masters, keeps its own). Whether they do."""
    strategy = ParallelStrategy.parse(layout.strategy)
    if (private or strategy.tensor > 1 or strategy.data < 2 or engine.device.type != "cpu"
            or engine.shares_base or not environment.shared_memory_enabled()):
        return False
    engine.shared_weights = shared_memory.share_replica_weights(
        engine.module, engine.parallel.dp_group
    )
    return engine.shared_weights is not None


def transfer_group_ranks(source: LayoutKey, target: LayoutKey) -> list[int]:
    """The broadcast group: the sender plus every receiver (empty when nobody receives)."""
    receivers = receiver_ranks(source, target)
    return sorted({source_rank(source), *receivers}) if receivers else []


def transfer_ranks(source: LayoutKey, target: LayoutKey) -> list[int]:
    """Every rank with work in a transfer: local blenders, the gather group, sender, receivers."""
    ranks = set(transfer_group_ranks(source, target)) | set(local_ranks(source, target))
    if _needs_full_parameters(source, target):
        ranks |= {source_rank(source), *gather_group_ranks(source)}
    return sorted(ranks)


def split_transfer_ranks(source: LayoutKey, target: LayoutKey) -> tuple[list[int], list[int]] | None:
    """A transfer between disjoint layouts as its two sides, the ranks of `transfer_ranks` in
    the source (the sender and the tp group it gathers from) and those in the target (the
    receivers); None when a rank holds both layouts. A posting sender (CPU, `post_send`)
    needs nobody on the other side to do its part, so the master sends each side its request
    as soon as that side's ranks are free (`Master.refresh`)."""
    if set(source.ranks) & set(target.ranks):
        return None
    ranks = transfer_ranks(source, target)
    return ([rank for rank in ranks if rank in source.ranks],
            [rank for rank in ranks if rank in target.ranks])


# ---------------------------------------------------------------------- process groups


def collective_timeout(plan: RunPlan) -> datetime.timedelta:
    """How long a collective waits for its peers before it raises (`watchdog.collective_timeout_s`):
    the world group's and every group's below, so a dead or stalled peer ends in an error (gloo)
    or an aborted process (NCCL's watchdog) instead of a rank blocked for ever."""
    return datetime.timedelta(seconds=plan.base.watchdog.collective_timeout_s)


@dataclass
class ProcessGroups:
    """Every process group the plan needs, created identically on all ranks at start-up, each
    with the plan's `collective_timeout`."""

    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    plan: RunPlan | None = None

    @classmethod
    def create(cls, plan: RunPlan) -> ProcessGroups:
        groups = cls(plan=plan)
        for layout in plan.layouts():
            allocation = plan.allocation_of_layout(layout)
            if allocation.strategy.pipeline > 1:
                raise NotImplementedError(
                    f"layout {layout}: the torch backend runs data and tensor parallelism only; "
                    f"use a 'dNtM' layout without 'p' (pipeline parallelism is not supported yet)"
                )
            for ranks in allocation.data_groups() + allocation.tensor_groups():
                groups._make(ranks)
            strategy = allocation.strategy
            if groups._trains(layout) and strategy.data > 1 and strategy.tensor > 1:
                groups._make(list(layout.ranks))  # the megatron backend's gradient-norm group
        for source, target in plan.transfers():
            groups._make(transfer_group_ranks(source, target))
        return groups

    def _make(self, ranks: list[int]) -> None:
        key = tuple(sorted(ranks))
        if len(key) > 1 and key not in self.by_ranks:
            self.by_ranks[key] = dist.new_group(list(key), timeout=collective_timeout(self.plan))

    def _trains(self, layout: LayoutKey) -> bool:
        spec = self.plan.models[layout.role]
        return spec.trainable and layout == self.plan.owner_layout(layout.role)

    def layout_group(self, layout: LayoutKey) -> dist.ProcessGroup | None:
        """Every rank of a trained data- and tensor-parallel layout (None otherwise)."""
        return self.by_ranks.get(tuple(sorted(layout.ranks))) if self._trains(layout) else None

    def _group_with(self, groups: list[list[int]], rank: int) -> dist.ProcessGroup | None:
        ranks = next(tuple(sorted(g)) for g in groups if rank in g)
        return self.by_ranks.get(ranks)

    def data_group(self, layout: LayoutKey, rank: int) -> dist.ProcessGroup | None:
        return self._group_with(self.plan.allocation_of_layout(layout).data_groups(), rank)

    def tensor_group(self, layout: LayoutKey, rank: int) -> dist.ProcessGroup | None:
        return self._group_with(self.plan.allocation_of_layout(layout).tensor_groups(), rank)


# ---------------------------------------------------------------------- moving weights


# Building the meta model takes ~9 ms for a 5-layer model, paid on every rank of every
# transfer; configs do not change during a run.
_SHAPES: dict[str, list[tuple[str, torch.Size]]] = {}


def full_parameter_shapes(config: ModelConfig) -> list[tuple[str, torch.Size]]:
    """(name, full shape) of every parameter, in `named_parameters` order (equal for shards)."""
    key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    if key not in _SHAPES:
        with on_meta_device():
            model = Transformer(config)
        _SHAPES[key] = [(name, parameter.shape) for name, parameter in model.named_parameters()]
    return _SHAPES[key]


def moving_parameter_shapes(module: Transformer) -> list[tuple[str, torch.Size]]:
    """(name, full shape) of the parameters a transfer moves: all of them, or for a model with
    LoRA adapters only the ones that train (`trained_parameter_names`), in `named_parameters`
    order."""
    if not has_adapters(module):
        return full_parameter_shapes(module.config)
    lora = module.lora_config
    key = json.dumps([dataclasses.asdict(module.config), dataclasses.asdict(lora)],
                     sort_keys=True, default=str)
    if key not in _SHAPES:
        with on_meta_device():
            model = add_adapters(Transformer(module.config), lora, seed=0)
        trained = set(trained_parameter_names(model))
        _SHAPES[key] = [(name, parameter.shape) for name, parameter in model.named_parameters()
                        if name in trained]
    return _SHAPES[key]


def _buckets(shapes: list[tuple[str, torch.Size]], element_size: int) -> Iterator[list]:
    bucket, size = [], 0
    for name, shape in shapes:
        bucket.append((name, shape))
        size += shape.numel() * element_size
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _gather_bucket(
    engine: TorchEngine,
    names: list[str],
    dtype: torch.dtype,
    root: int,
    group: dist.ProcessGroup | None,
) -> dict[str, torch.Tensor] | None:
    """Full tensors of `names` on `root` (None elsewhere) from the shards of a tp group."""
    parameters = dict(engine.module.named_parameters())
    if group is None:  # tensor size 1: the root holds the full parameters
        return {name: parameters[name].detach().to(dtype) for name in names}
    flat = torch.cat([parameters[name].detach().to(dtype).reshape(-1) for name in names])
    is_root = dist.get_rank() == root
    pieces = (
        [torch.empty_like(flat) for _ in range(dist.get_world_size(group))] if is_root else None
    )
    dist.gather(flat, pieces, dst=root, group=group)
    if not is_root:
        return None
    sizes = [parameters[name].numel() for name in names]
    shards = [
        {
            name: part.view_as(parameters[name])
            for name, part in zip(names, piece.split(sizes), strict=True)
        }
        for piece in pieces
    ]
    return unshard_state_dicts(shards, engine.module.config)


# One flat buffer per (dtype, device), grown to the largest bucket and reused by every bucket of
# every transfer. Measured between two gloo processes for 63 MB: 96 ms per broadcast with a
# fresh `torch.cat` / `torch.empty` each time (most of it first-touch page faults), 39 ms
# with a reused buffer.
_FLAT_BUFFERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _flat_buffer(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    key = (dtype, torch.device(device))
    buffer = _FLAT_BUFFERS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _FLAT_BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


# Shared-memory broadcast buffers by (broadcast group ranks, sender), grown to the largest
# bucket sent; None where the group's ranks cannot share memory (they use gloo's broadcast).
_SHARED_BUFFERS: dict[tuple[tuple[int, ...], int], shared_memory.SharedMemoryBroadcast | None] = {}


def _shared_buffer(
    group_ranks: list[int], root: int, group: dist.ProcessGroup, nbytes: int, split: bool
) -> shared_memory.SharedMemoryBroadcast | None:
    """Collective over `group` the first time and whenever a bucket outgrows the buffer; in a
    split transfer (one side at a time) the buffer is the one an earlier transfer made."""
    key = (tuple(group_ranks), root)
    if key in _SHARED_BUFFERS and (
        _SHARED_BUFFERS[key] is None or _SHARED_BUFFERS[key].capacity >= nbytes
    ):
        return _SHARED_BUFFERS[key]
    if split:
        raise RuntimeError(f"a split transfer from rank {root} to {group_ranks} found no buffer "
                           "of its size: the master splits only transfers done together before")
    _SHARED_BUFFERS[key] = shared_memory.SharedMemoryBroadcast.connect(group, root, nbytes)
    return _SHARED_BUFFERS[key]


def _broadcast_bucket(
    full: dict[str, torch.Tensor] | None,
    bucket: list,
    dtype: torch.dtype,
    root: int,
    group: dist.ProcessGroup,
    device,
    shared: shared_memory.SharedMemoryBroadcast | None = None,
    pending: list[dist.Work] | None = None,
    split: bool = False,
) -> dict[str, torch.Tensor]:
    """The bucket's full tensors on every rank of `group`, as views into a reused buffer: use
    them before the next bucket. With `shared`, the buffer is the sender's shared memory and
    the caller must `release` it once this rank is done with the views. With `pending`, the
    sender only starts the broadcast (or in shared memory, the barrier that publishes the
    buffer) and appends its handle there: it need not wait for any receiver, and the buffer
    must not be written again before the handles complete. In a `split` transfer through
    shared memory nobody waits for anybody: the master asks the receivers only once the
    sender has replied, and the sender again only once they all have (`Master.refresh`)."""
    numel = sum(shape.numel() for _, shape in bucket)
    flat = _flat_buffer(numel, dtype, device) if shared is None else shared.buffer(numel, dtype)
    if full is not None:
        torch.cat([full[name].reshape(-1) for name, _ in bucket], out=flat)
    if shared is not None:
        if not split:
            published = shared.publish(async_op=pending is not None)
            if pending is not None:
                pending.append(published)
    elif pending is None:
        dist.broadcast(flat, src=root, group=group)
    else:
        pending.append(dist.broadcast(flat, src=root, group=group, async_op=True))
    sizes = [shape.numel() for _, shape in bucket]
    return {
        name: part.view(shape)
        for (name, shape), part in zip(bucket, flat.split(sizes), strict=True)
    }


@torch.no_grad()
def _blend(engine: TorchEngine, name: str, target: torch.Tensor, source: torch.Tensor,
           eta: float) -> None:
    """`target = eta * source + (1 - eta) * target` for `engine`'s parameter `name`; a frozen
    bf16 target blends in its fp32 EMA master and takes it rounded (`TorchEngine.ema_master`)."""
    if eta == 1.0:
        target.copy_(source)
        return
    master = engine.ema_master(name)
    base = master if master is not None else target.float()
    blended = eta * source.float() + (1.0 - eta) * base
    if master is not None:
        master.copy_(blended)
    target.copy_(blended)


@torch.no_grad()
def _blend_full_into(
    engine: TorchEngine, full: dict[str, torch.Tensor], target: LayoutKey, rank: int, eta: float
) -> None:
    """Blend full tensors into this rank's slice of them in `engine` (a `target` shard)."""
    size = tensor_size(target)
    if size > 1:
        full = shard_state_dict(full, tensor_rank(target, rank), size, engine.module.config)
    parameters = dict(engine.module.named_parameters())
    for name, tensor in full.items():
        _blend(engine, name, parameters[name], tensor.to(parameters[name].device), eta)


def gather_full_parameters(
    engine: TorchEngine, layout: LayoutKey, rank: int, groups: ProcessGroups,
    shapes: list[tuple[str, torch.Size]] | None = None,
) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) parameters of `layout`'s replica 0, on its first rank (None on the
    other ranks of that tp group, which must call too). Used for checkpoints. `shapes`:
    (name, full shape) of the parameters to gather; default every base parameter."""
    root = source_rank(layout)
    group = groups.tensor_group(layout, rank) if tensor_size(layout) > 1 else None
    dtype = engine.module.dtype
    full: dict[str, torch.Tensor] = {}
    shapes = full_parameter_shapes(engine.module.config) if shapes is None else shapes
    for bucket in _buckets(shapes, dtype.itemsize):
        gathered = _gather_bucket(engine, [name for name, _ in bucket], dtype, root, group)
        if gathered is not None:
            full.update(gathered)
    return full if rank == root else None


@torch.no_grad()
def transfer_parameters(
    source_engine: TorchEngine | None,
    target_engine: TorchEngine | None,
    source: LayoutKey,
    target: LayoutKey,
    rank: int,
    eta: float,
    groups: ProcessGroups,
    plan: RunPlan,
    pending: list[dist.Work] | None = None,
    split: bool = False,
) -> bool | None:
    """This rank's part of `target = eta * source + (1 - eta) * target` (see the module
    docstring); engines are None where this rank holds no shard of that layout.

    With `pending` (CPU only), a sender that blends nothing returns once its last bucket is
    copied out and that broadcast started (in shared memory: published), and appends its
    handles to `pending`: the receivers finish on their own, and the caller must wait for the
    handles before the next transfer (which reuses the buffer). Its parameters may change
    meanwhile. Returns, on the sender, whether its part waited for no receiver (it posted a
    single bucket: with several, each bucket waits for the receivers to read the one before);
    None on the other ranks. A `split` transfer is sent to one side at a time
    (`Master.refresh`): the sender's (with `pending`) first, then the receivers'.
    """
    # A sender's handles on its last broadcast (or publication) and on the receivers' last
    # release of its buffer.
    handles: list[dist.Work] = []
    alone = False  # the sender's part waited for no receiver
    # Replicas sharing one copy of the weights: one rank writes it (the master's next request
    # to any of them waits for every rank's reply).
    writes = (target_engine is None or target_engine.shared_weights is None
              or rank == shared_writer(source, target))
    if _needs_full_parameters(source, target):
        handles, alone = _send_full_parameters(
            source_engine, target_engine, source, target, rank, eta, groups, plan,
            posts=pending is not None, writes=writes, split=split,
        )
    # Local blends come last: in shared memory the receivers read the sender's buffer meanwhile.
    if rank in local_ranks(source, target) and writes:
        targets = dict(target_engine.module.named_parameters())
        sources = dict(source_engine.module.named_parameters())
        for name, _ in moving_parameter_shapes(target_engine.module):
            _blend(target_engine, name, targets[name], sources[name], eta)
    if pending is not None:
        pending.extend(handles)
    else:
        for handle in handles:
            handle.wait()
    return alone if rank == source_rank(source) else None


def _send_full_parameters(source_engine, target_engine, source: LayoutKey, target: LayoutKey,
                          rank: int, eta: float, groups: ProcessGroups, plan: RunPlan, *,
                          posts: bool, writes: bool,
                          split: bool) -> tuple[list[dist.Work], bool]:
    """Gather, broadcast and blend the full parameters, bucket by bucket, where this rank
    gathers or receives (`transfer_parameters`); blend only if it `writes`. Returns the handles
    a sender must wait on before its buffer is written again, and whether it posted its one
    bucket (so waited for no receiver)."""
    sender = source_rank(source)
    gathers = rank == sender or (tensor_size(source) > 1 and rank in gather_group_ranks(source))
    group_ranks = transfer_group_ranks(source, target)
    receives = rank != sender and rank in group_ranks
    if not (gathers or receives):
        return [], False
    gather_group = (
        groups.tensor_group(source, rank) if gathers and tensor_size(source) > 1 else None
    )
    broadcast_group = groups.by_ranks[tuple(group_ranks)] if rank in group_ranks else None
    engine = source_engine if gathers else target_engine
    wire_dtype = DTYPES[plan.models[source.role].config.dtype.value]
    blends = writes and (receives or (rank == sender and _sender_blends(source, target)))
    shapes = moving_parameter_shapes(engine.module)
    buckets = list(_buckets(shapes, wire_dtype.itemsize))
    posts = posts and rank == sender and not blends and engine.device.type == "cpu"
    shared = None
    if broadcast_group is not None and engine.device.type == "cpu" and environment.shared_memory_enabled():
        largest = max(sum(shape.numel() for _, shape in bucket) for bucket in buckets)
        shared = _shared_buffer(
            group_ranks, sender, broadcast_group, largest * wire_dtype.itemsize, split
        )
    if split and len(buckets) > 1:
        raise RuntimeError("a split transfer is one bucket: its sides do not meet in between")
    pending: list[dist.Work] = []
    released = None
    for index, bucket in enumerate(buckets):
        full = None
        if gathers:
            full = _gather_bucket(
                source_engine, [name for name, _ in bucket], wire_dtype, sender, gather_group
            )
        if broadcast_group is not None:
            last = index == len(buckets) - 1
            if released is not None:  # the buffer is free again
                released.wait()
            full = _broadcast_bucket(
                full, bucket, wire_dtype, sender, broadcast_group, engine.device, shared,
                pending if posts and last else None, split,
            )
        if blends:
            _blend_full_into(target_engine, full, target, rank, eta)
        if shared is not None and not split:  # this rank is done with the bucket's buffer
            released = shared.release(async_op=rank == sender)
    return pending + ([released] if released is not None else []), posts and len(buckets) == 1
