"""Where each model function call (MFC) runs: device meshes and parallel layouts.

The cluster has ``n_nodes * n_devices_per_node`` workers with global ranks ``0..world-1``
(rank = node * n_devices_per_node + local device). Each MFC runs on a ``DeviceMesh`` (a set
of those ranks) with a ``ParallelStrategy`` whose product of data, tensor and pipeline sizes
equals the mesh size.

Rank layout inside a mesh: the mesh's ranks, in ascending order, are numbered by a local
index ``i``; tensor parallelism varies fastest, then pipeline, then data::

    i = (dp * pipeline + pp) * tensor + tp

so a tensor-parallel group is a run of consecutive ranks (on one node when the size allows),
which keeps the chattiest collectives on the fastest links.

The ``allocation_mode`` strings that produce allocations are parsed by
`realrl.api.allocation_mode`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import NamedTuple

logger = logging.getLogger(__name__)

_LAYOUT_EXAMPLES = "'d2t1p1', 'd4', 'd2p2t1', 't2'"
_LAYOUT_PATTERN = re.compile(r"([dtp])(\d+)")


class AllocationError(ValueError):
    """An allocation mode that cannot be placed on the cluster; the message lists every problem."""


@dataclasses.dataclass(frozen=True)
class ParallelStrategy:
    data: int = 1
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelStrategy.{name} must be a positive integer, got {value}")

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline

    def __str__(self) -> str:
        return f"d{self.data}t{self.tensor}p{self.pipeline}"

    @classmethod
    def parse(cls, text: str) -> ParallelStrategy:
        """Parse ``"d2t2"``/``"d2p2t1"``: letters in any order, each at most once, missing = 1."""
        compact = text.strip().lower()
        matches = list(_LAYOUT_PATTERN.finditer(compact))
        letters = [m.group(1) for m in matches]
        consumed = "".join(m.group(0) for m in matches)
        if not compact or consumed != compact or len(set(letters)) != len(letters):
            raise ValueError(
                f"invalid parallel layout {text!r}: write d (data), t (tensor) and p (pipeline) "
                f"each followed by a positive size, in any order, each at most once, e.g. "
                f"{_LAYOUT_EXAMPLES}"
            )
        sizes = {m.group(1): int(m.group(2)) for m in matches}
        if any(size < 1 for size in sizes.values()):
            raise ValueError(
                f"invalid parallel layout {text!r}: sizes must be >= 1, e.g. {_LAYOUT_EXAMPLES}"
            )
        return cls(data=sizes.get("d", 1), tensor=sizes.get("t", 1), pipeline=sizes.get("p", 1))


def parse_ranks(text: str) -> tuple[int, ...]:
    """Parse ``"0-3"``, ``"0,2"``, ``"0-1,4-5"`` into sorted global ranks."""
    ranks: list[int] = []
    for piece in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if match is None:
            raise ValueError(
                f"invalid rank list {text!r}: use ranges and lists like '0-3', '0,2', '0-1,4-5'"
            )
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) is not None else start
        if end < start:
            raise ValueError(f"invalid rank range {piece!r} in {text!r}: end before start")
        ranks.extend(range(start, end + 1))
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"rank list {text!r} names a rank twice")
    return tuple(sorted(ranks))


def format_ranks(ranks: tuple[int, ...]) -> str:
    """Compact form: ``(0, 1, 2, 3)`` -> ``"0-3"``, ``(0, 2, 3)`` -> ``"0,2-3"``."""
    pieces: list[str] = []
    index = 0
    while index < len(ranks):
        end = index
        while end + 1 < len(ranks) and ranks[end + 1] == ranks[end] + 1:
            end += 1
        if end > index:
            pieces.append(f"{ranks[index]}-{ranks[end]}")
        else:
            pieces.extend(str(r) for r in ranks[index : end + 1])
        index = end + 1
    return ",".join(pieces)


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """The global worker ranks one MFC uses (sorted, unique, inside the cluster)."""

    n_nodes: int
    n_devices_per_node: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = tuple(sorted(self.ranks))
        object.__setattr__(self, "ranks", ranks)
        if not ranks:
            raise ValueError("DeviceMesh needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"DeviceMesh ranks {ranks} contain duplicates")
        outside = [r for r in ranks if not 0 <= r < self.cluster_size]
        if outside:
            raise ValueError(
                f"DeviceMesh ranks {list(outside)} are outside the cluster of {self.cluster_size} "
                f"devices ({self.n_nodes} node(s) x {self.n_devices_per_node}; valid ranks "
                f"0-{self.cluster_size - 1})"
            )

    @classmethod
    def full(cls, n_nodes: int, n_devices_per_node: int) -> DeviceMesh:
        return cls(n_nodes, n_devices_per_node, tuple(range(n_nodes * n_devices_per_node)))

    @property
    def cluster_size(self) -> int:
        return self.n_nodes * self.n_devices_per_node

    @property
    def size(self) -> int:
        return len(self.ranks)

    def is_subset_of(self, other: DeviceMesh) -> bool:
        return set(self.ranks) <= set(other.ranks)

    def overlaps(self, other: DeviceMesh) -> bool:
        return bool(set(self.ranks) & set(other.ranks))

    def __str__(self) -> str:
        return format_ranks(self.ranks)


class ParallelCoordinates(NamedTuple):
    dp: int
    pp: int
    tp: int


@dataclasses.dataclass(frozen=True)
class MFCAllocation:
    """One MFC's mesh and layout; maps global ranks to (dp, pp, tp) coordinates."""

    mfc_name: str
    mesh: DeviceMesh
    strategy: ParallelStrategy

    def __post_init__(self) -> None:
        if self.strategy.world_size != self.mesh.size:
            raise AllocationError(size_mismatch_message(self.mfc_name, self.strategy, self.mesh))

    def coordinates_of(self, rank: int) -> ParallelCoordinates:
        if rank not in self.mesh.ranks:
            raise ValueError(f"rank {rank} is not in the mesh {self.mesh} of MFC {self.mfc_name!r}")
        local = self.mesh.ranks.index(rank)
        tensor, pipeline = self.strategy.tensor, self.strategy.pipeline
        return ParallelCoordinates(
            dp=local // (tensor * pipeline), pp=(local // tensor) % pipeline, tp=local % tensor
        )

    def rank_at(self, dp: int, pp: int, tp: int) -> int:
        strategy = self.strategy
        if not (
            0 <= dp < strategy.data and 0 <= pp < strategy.pipeline and 0 <= tp < strategy.tensor
        ):
            raise ValueError(f"coordinates (dp={dp}, pp={pp}, tp={tp}) outside layout {strategy}")
        return self.mesh.ranks[(dp * strategy.pipeline + pp) * strategy.tensor + tp]

    def ranks_of_dp_rank(self, dp: int) -> list[int]:
        """All ranks of data-parallel replica ``dp`` (pp-major, tp-minor order)."""
        return [
            self.rank_at(dp, pp, tp)
            for pp in range(self.strategy.pipeline)
            for tp in range(self.strategy.tensor)
        ]

    def dp_head_ranks(self) -> list[int]:
        """Per replica, the rank at tp=0 on the last pipeline stage: it returns the outputs."""
        last_stage = self.strategy.pipeline - 1
        return [self.rank_at(dp, last_stage, 0) for dp in range(self.strategy.data)]

    def tensor_groups(self) -> list[list[int]]:
        """Rank groups that share (dp, pp): one tensor-parallel process group each."""
        s = self.strategy
        return [
            [self.rank_at(dp, pp, tp) for tp in range(s.tensor)]
            for dp in range(s.data)
            for pp in range(s.pipeline)
        ]

    def pipeline_groups(self) -> list[list[int]]:
        s = self.strategy
        return [
            [self.rank_at(dp, pp, tp) for pp in range(s.pipeline)]
            for dp in range(s.data)
            for tp in range(s.tensor)
        ]

    def data_groups(self) -> list[list[int]]:
        """Rank groups that share (pp, tp): gradients are all-reduced within each."""
        s = self.strategy
        return [
            [self.rank_at(dp, pp, tp) for dp in range(s.data)]
            for pp in range(s.pipeline)
            for tp in range(s.tensor)
        ]


def suggest_layouts(strategy: ParallelStrategy, mesh_size: int) -> list[str]:
    """Layouts that fit ``mesh_size``: keep tensor x pipeline if it divides, else pure data."""
    suggestions = []
    model_parallel = strategy.tensor * strategy.pipeline
    if mesh_size % model_parallel == 0:
        kept = ParallelStrategy(mesh_size // model_parallel, strategy.tensor, strategy.pipeline)
        suggestions.append(str(kept))
    if mesh_size % strategy.data == 0 and strategy.data <= mesh_size:
        suggestions.append(str(ParallelStrategy(strategy.data, mesh_size // strategy.data, 1)))
    pure_data = str(ParallelStrategy(mesh_size))
    if pure_data not in suggestions:
        suggestions.append(pure_data)
    return suggestions


def describe_mfc(mfc_name: str) -> str:
    return "every MFC ('*')" if mfc_name == "*" else f"MFC {mfc_name!r}"


def size_mismatch_message(mfc_name: str, strategy: ParallelStrategy, mesh: DeviceMesh) -> str:
    options = " or ".join(f"'{s}'" for s in suggest_layouts(strategy, mesh.size))
    return (
        f"{describe_mfc(mfc_name)}: layout {strategy} uses {strategy.world_size} devices but its mesh "
        f"{mesh} has {mesh.size}; try {options}"
    )


def validate_model_divisibility(
    allocation: MFCAllocation,
    num_attention_heads: int,
    num_key_value_heads: int,
    vocab_size: int,
    intermediate_size: int,
    num_hidden_layers: int | None = None,
) -> list[str]:
    """Problems that stop ``allocation`` from sharding this model (empty list: it fits).

    Rule: the tensor-parallel size must divide the attention heads, the key/value heads (each
    rank owns whole kv heads; kv heads are never replicated), the vocabulary (the embedding and
    LM head are split by rows) and the MLP intermediate size. The pipeline size may not exceed
    the number of layers.
    """
    tensor = allocation.strategy.tensor
    sizes = {
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
        "intermediate_size": intermediate_size,
    }
    problems = [
        f"MFC {allocation.mfc_name!r}: tensor parallel size {tensor} does not divide "
        f"{field}={value}; use a tensor size among {_divisors_up_to(value, allocation.mesh.size)}"
        for field, value in sizes.items()
        if value % tensor != 0
    ]
    pipeline = allocation.strategy.pipeline
    if num_hidden_layers is not None and pipeline > num_hidden_layers:
        problems.append(
            f"MFC {allocation.mfc_name!r}: pipeline size {pipeline} exceeds "
            f"num_hidden_layers={num_hidden_layers}"
        )
    return problems


def _divisors_up_to(value: int, limit: int) -> list[int]:
    return [d for d in range(1, min(value, limit) + 1) if value % d == 0]


def format_allocation_table(allocations: dict[str, MFCAllocation]) -> str:
    """A text table: one row per MFC with its ranks, layout and each rank's (dp,tp,pp)."""
    header = ("MFC", "ranks", "layout", "per rank: (dp,tp,pp)")
    rows = [header]
    for name, allocation in allocations.items():
        coordinates = " ".join(
            f"{rank}:({c.dp},{c.tp},{c.pp})"
            for rank in allocation.mesh.ranks
            for c in [allocation.coordinates_of(rank)]
        )
        rows.append((name, str(allocation.mesh), str(allocation.strategy), coordinates))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    ]
    return "\n".join(lines)
