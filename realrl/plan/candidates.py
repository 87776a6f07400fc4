"""The layouts one MFC may take on a cluster: a mesh, a data x tensor x pipeline split, and a
micro-batch count.

Meshes are blocks of consecutive ranks aligned to their size (the way ReaLHF's search places
them): ``m`` devices of one node where ``m`` divides ``n_devices_per_node``, or whole nodes
where ``m`` is a multiple of it, at offsets ``0, m, 2m, ...``. Tensor parallelism stays inside
a node (its all-reduces are the chattiest traffic) and must divide the model's heads, key/value
heads, vocabulary and MLP size (`realrl.api.allocation.validate_model_divisibility`); each
data-parallel rank gets at least one sequence. Generation and rule rewards take one
micro-batch (the decode batch is the whole rank's share); training and inference choose
from the work's own ``microbatch_choices`` (a launched run's configured count) or the
search's.
"""

from __future__ import annotations

from realrl.api.allocation import DeviceMesh, ParallelStrategy
from realrl.plan.costs import Cluster, Layout, MFCWork, WorkKind


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def meshes(cluster: Cluster) -> list[DeviceMesh]:
    """Every aligned block of consecutive ranks whose size fits the node structure."""
    per_node = cluster.n_devices_per_node
    sizes = [m for m in _divisors(per_node)]
    sizes += [n * per_node for n in _divisors(cluster.n_nodes) if n > 1]
    found = []
    for size in sizes:
        for start in range(0, cluster.size, size):
            found.append(DeviceMesh(cluster.n_nodes, per_node, tuple(range(start, start + size))))
    return found


def _tensor_sizes(work: MFCWork, mesh_size: int, per_node: int) -> list[int]:
    if work.model is None:
        return [1]
    model = work.model
    sharded = (model.num_attention_heads, model.num_key_value_heads, model.vocab_size,
               model.intermediate_size)
    return [t for t in _divisors(min(mesh_size, per_node))
            if mesh_size % t == 0 and all(value % t == 0 for value in sharded)]


def strategies(work: MFCWork, mesh_size: int, per_node: int,
               allow_pipeline: bool) -> list[ParallelStrategy]:
    found = []
    for tensor in _tensor_sizes(work, mesh_size, per_node):
        rest = mesh_size // tensor
        pipelines = [1]
        if allow_pipeline and work.model is not None:
            pipelines = [p for p in _divisors(rest) if p <= work.model.num_layers]
        for pipeline in pipelines:
            data = rest // pipeline
            # every rank needs a sample, and a train call a sample of each mini-batch
            if data * (work.optimizer_steps // work.epochs) <= work.samples:
                found.append(ParallelStrategy(data=data, tensor=tensor, pipeline=pipeline))
    return found


def candidate_layouts(work: MFCWork, cluster: Cluster, allow_pipeline: bool = False,
                      microbatch_choices: tuple[int, ...] = (1, 2, 4, 8)) -> list[Layout]:
    single = work.kind in (WorkKind.generate, WorkKind.rule)
    choices = work.microbatch_choices or microbatch_choices
    found = []
    for mesh in meshes(cluster):
        for strategy in strategies(work, mesh.size, cluster.n_devices_per_node, allow_pipeline):
            rows = work.num_sequences // strategy.data
            counts = [1] if single else [n for n in choices if n <= max(rows, 1)] or [1]
            found.extend(Layout(mesh, strategy, count) for count in counts)
    return found
