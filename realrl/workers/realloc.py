"""Parameter reallocation: move (or blend) a role's newest weights between layouts.

A transfer goes from a *source* layout (the owner of the newest weights) to a *target* layout:
`target = eta * source + (1 - eta) * target`, with eta = 1 for a plain reallocation and
0 < eta < 1 for the EMA reference update. Ranks that hold both layouts blend locally; the others
receive the source's parameters by broadcast from the source's first rank over a process group
made at start-up, in buckets, never through the disk. Every rank of a transfer's group must call
`transfer_parameters` for the same transfer; the master sends the request to all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from realrl.backends.torch_engine import TorchEngine
from realrl.workers.run_plan import LayoutKey, RunPlan

BUCKET_BYTES = 64 * 1024 * 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def source_rank(source: LayoutKey) -> int:
    return source.ranks[0]


def transfer_group_ranks(source: LayoutKey, target: LayoutKey) -> list[int]:
    """The source's first rank plus every target rank that holds no source replica."""
    receivers = [rank for rank in target.ranks if rank not in source.ranks]
    return sorted({source_rank(source), *receivers}) if receivers else []


def transfer_ranks(source: LayoutKey, target: LayoutKey) -> list[int]:
    """Every rank with work in a transfer: the group plus ranks that blend locally."""
    local = [rank for rank in target.ranks if rank in source.ranks]
    return sorted(set(transfer_group_ranks(source, target)) | set(local))


@dataclass
class ProcessGroups:
    """Every process group the plan needs, created identically on all ranks at start-up."""

    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    plan: RunPlan | None = None

    @classmethod
    def create(cls, plan: RunPlan) -> ProcessGroups:
        groups = cls(plan=plan)
        for layout in plan.layouts():
            allocation = plan.allocation_of_layout(layout)
            if allocation.strategy.tensor > 1 or allocation.strategy.pipeline > 1:
                raise NotImplementedError(
                    f"layout {layout}: the torch backend runs data parallelism only; "
                    f"use a 'dN' layout (tensor/pipeline parallelism need the megatron backend)"
                )
            for ranks in allocation.data_groups() + allocation.tensor_groups():
                groups._make(ranks)
        for source, target in plan.transfers():
            groups._make(transfer_group_ranks(source, target))
        return groups

    def _make(self, ranks: list[int]) -> None:
        key = tuple(sorted(ranks))
        if len(key) > 1 and key not in self.by_ranks:
            self.by_ranks[key] = dist.new_group(list(key))

    def _group_with(self, groups: list[list[int]], rank: int) -> dist.ProcessGroup | None:
        ranks = next(tuple(sorted(g)) for g in groups if rank in g)
        return self.by_ranks.get(ranks)

    def data_group(self, layout: LayoutKey, rank: int) -> dist.ProcessGroup | None:
        return self._group_with(self.plan.allocation_of_layout(layout).data_groups(), rank)

    def tensor_group(self, layout: LayoutKey, rank: int) -> dist.ProcessGroup | None:
        return self._group_with(self.plan.allocation_of_layout(layout).tensor_groups(), rank)


def _buckets(parameters: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket, size = [], 0
    for parameter in parameters:
        bucket.append(parameter)
        size += parameter.numel() * parameter.element_size()
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


@torch.no_grad()
def _blend(target: torch.Tensor, source: torch.Tensor, eta: float) -> None:
    if eta == 1.0:
        target.copy_(source)
    else:
        target.copy_((eta * source.float() + (1.0 - eta) * target.float()).to(target.dtype))


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
) -> None:
    if rank in source.ranks and rank in target.ranks:
        for target_param, source_param in zip(target_engine.module.parameters(),
                                              source_engine.module.parameters(), strict=True):
            _blend(target_param, source_param, eta)
    group_ranks = transfer_group_ranks(source, target)
    if rank not in group_ranks:
        return
    group = groups.by_ranks[tuple(group_ranks)]
    sender = rank == source_rank(source)
    engine = source_engine if sender else target_engine
    source_dtype = DTYPES[plan.models[source.role].config.dtype.value]
    for bucket in _buckets(list(engine.module.parameters())):
        if sender:
            flat = torch.cat([p.detach().to(source_dtype).reshape(-1) for p in bucket])
        else:
            flat = torch.empty(sum(p.numel() for p in bucket), dtype=source_dtype,
                               device=engine.device)
        dist.broadcast(flat, src=source_rank(source), group=group)
        if not sender:
            offset = 0
            for parameter in bucket:
                _blend(parameter, flat[offset: offset + parameter.numel()].view_as(parameter), eta)
                offset += parameter.numel()
