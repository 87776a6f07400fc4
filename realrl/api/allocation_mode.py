"""``allocation_mode`` strings -> one `MFCAllocation` per MFC (see `realrl.api.allocation`).

Allocation-mode strings (``allocation_mode=`` on the command line):

- ``"d2t1"``: one layout, every MFC on the whole cluster;
- ``"actor_gen:d4,actor_train:d2t2,*:d4"``: one layout per MFC, ``*`` for the rest;
- ``"actor_gen:d2@0-1,ref_inf:d2@2,3"``: an explicit mesh after ``@`` (ranges and lists);
- ``"auto"``: ``default_allocation``.

Every problem in a string is reported together, each with a suggestion that fits.
"""

from __future__ import annotations

import logging
import re

from realrl.api.allocation import (
    AllocationError,
    DeviceMesh,
    MFCAllocation,
    ParallelStrategy,
    describe_mfc,
    parse_ranks,
    size_mismatch_message,
)

logger = logging.getLogger(__name__)


def _split_entries(text: str) -> list[str]:
    """Split on commas, re-joining rank-list pieces that belong to the previous ``@`` mesh."""
    entries: list[str] = []
    for piece in text.split(","):
        piece = piece.strip()
        if entries and "@" in entries[-1] and re.fullmatch(r"\d+(-\d+)?", piece):
            entries[-1] += "," + piece
        else:
            entries.append(piece)
    return entries


def _parse_entry(
    entry: str, mfc_names: list[str], cluster: DeviceMesh
) -> tuple[str, ParallelStrategy, DeviceMesh]:
    """Parse ``name:layout[@ranks]``; raises ValueError with a message naming the entry."""
    name, separator, rest = entry.partition(":")
    name = name.strip()
    if not separator or not name:
        raise ValueError(
            f"entry {entry!r} is not 'mfc_name:layout[@ranks]' (e.g. 'actor_gen:d4', "
            "'ref_inf:d2@2-3', '*:d4')"
        )
    if name != "*" and name not in mfc_names:
        raise ValueError(
            f"unknown MFC {name!r}; valid names: {', '.join(mfc_names)} (or '*' for the rest)"
        )
    layout_text, at, ranks_text = rest.partition("@")
    try:
        strategy = ParallelStrategy.parse(layout_text)
        mesh = cluster
        if at:
            ranks = parse_ranks(ranks_text)
            mesh = DeviceMesh(cluster.n_nodes, cluster.n_devices_per_node, ranks)
    except ValueError as error:
        raise ValueError(f"{describe_mfc(name)}: {error}") from error
    if strategy.world_size != mesh.size:
        raise ValueError(size_mismatch_message(name, strategy, mesh))
    return name, strategy, mesh


def parse_allocation_mode(
    text: str,
    mfc_names: list[str],
    n_nodes: int,
    n_devices_per_node: int,
    is_gpu: bool = False,
) -> dict[str, MFCAllocation]:
    """Turn an ``allocation_mode`` string (see module docstring) into one allocation per MFC.

    Every problem is collected and raised together as one ``AllocationError``.
    """
    text = text.strip()
    if text == "auto":
        return default_allocation(mfc_names, n_nodes, n_devices_per_node, is_gpu)
    cluster = DeviceMesh.full(n_nodes, n_devices_per_node)
    if ":" not in text and "@" not in text:
        entries = [f"*:{text}"]  # one layout for every MFC on the whole cluster
    else:
        entries = _split_entries(text)
    entry_names = {entry.partition(":")[0].strip() for entry in entries}
    problems: list[str] = []
    specs: dict[str, tuple[ParallelStrategy, DeviceMesh]] = {}
    for entry in entries:
        try:
            name, strategy, mesh = _parse_entry(entry, mfc_names, cluster)
        except ValueError as error:
            problems.append(str(error))
            continue
        if name in specs:
            problems.append(f"MFC {name!r} is allocated twice; keep one entry")
        specs[name] = (strategy, mesh)
    unallocated = [n for n in mfc_names if n not in entry_names]
    if unallocated and "*" not in entry_names:
        problems.append(
            f"MFC(s) {', '.join(unallocated)} have no allocation; add 'name:layout' entries or a "
            "'*:layout' default"
        )
    if problems:
        raise AllocationError(
            f"allocation_mode {text!r} does not fit the cluster of {cluster.size} device(s) "
            f"({n_nodes} node(s) x {n_devices_per_node}):\n  - " + "\n  - ".join(problems)
        )
    default = specs.get("*")
    allocations = {}
    for name in mfc_names:
        strategy_and_mesh = specs.get(name, default)
        assert strategy_and_mesh is not None  # a missing allocation was reported above
        strategy, mesh = strategy_and_mesh
        allocations[name] = MFCAllocation(name, mesh, strategy)
    return allocations


def default_allocation(
    mfc_names: list[str], n_nodes: int, n_devices_per_node: int, is_gpu: bool = False
) -> dict[str, MFCAllocation]:
    """The ``allocation_mode=auto`` heuristic.

    - one worker: every MFC runs ``d1`` on rank 0;
    - CPU workers: every MFC is data parallel over all workers (gloo tensor parallelism costs
      more than it saves for the small models a CPU can train);
    - GPUs: MFCs whose name contains ``train`` use tensor parallelism inside a node (the
      largest divisor of ``n_devices_per_node`` that is at most 8) to shard parameters,
      gradients and optimizer state, and data parallelism across nodes; generation and
      inference MFCs hold no optimizer state and are throughput bound, so they use pure data
      parallelism over all devices. Override with an explicit mode when a model does not fit.
    """
    cluster = DeviceMesh.full(n_nodes, n_devices_per_node)
    allocations = {}
    for name in mfc_names:
        tensor = 1
        if is_gpu and "train" in name:
            tensor = max(
                t for t in range(1, min(8, n_devices_per_node) + 1) if n_devices_per_node % t == 0
            )
        strategy = ParallelStrategy(data=cluster.size // tensor, tensor=tensor)
        allocations[name] = MFCAllocation(name, cluster, strategy)
    logger.info(
        "allocation_mode=auto on %d device(s): %s",
        cluster.size,
        ", ".join(f"{n}:{a.strategy}" for n, a in allocations.items()),
    )
    return allocations
