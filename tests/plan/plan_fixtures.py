"""A hand-sized model and device for the plan-search tests: numbers small enough to check
with pen and paper."""

from __future__ import annotations

from realrl.api.allocation import DeviceMesh, ParallelStrategy
from realrl.plan.costs import Cluster, Layout, MFCWork, ModelShape, WorkKind
from realrl.plan.devices import DeviceSpec, Link

# L=2, h=8, f=16, 2 heads of 4, 1 kv head (kv size 4), vocabulary 10, untied head.
# One layer's matmuls: 8*(8 + 2*4) + 8*8 + 3*8*16 = 128 + 64 + 384 = 576 parameters.
# Parameters: 2*(576 + 2*8) + 10*8 (embedding) + 8 (final norm) + 10*8 (head) = 1352.
TINY = ModelShape(num_layers=2, hidden_size=8, intermediate_size=16, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=10)


def device(overhead_s: float = 0.0, memory_bytes: float = 1e12) -> DeviceSpec:
    return DeviceSpec(
        name="paper", flops_per_s={"float32": 1000.0}, memory_bytes=memory_bytes,
        memory_bandwidth_bytes_per_s=37856.0, intra_node=Link(100.0, 0.5),
        inter_node=Link(10.0, 2.0), host=Link(1e12, 0.0), kernel_overhead_s=overhead_s,
        is_gpu=False)


def cluster(n_nodes: int = 1, n_devices_per_node: int = 4, **device_options) -> Cluster:
    return Cluster(n_nodes, n_devices_per_node, device(**device_options))


def work(kind: WorkKind, name: str = "mfc", role: str = "actor", model=TINY,
         num_sequences: int = 3, prompt_tokens: int = 2, generated_tokens: int = 2,
         **options) -> MFCWork:
    return MFCWork(name, role, kind, model, num_sequences, prompt_tokens, generated_tokens,
                   transfer_bytes_per_token=0, **options)


def layout(ranks, data=1, tensor=1, pipeline=1, microbatches=1, n_nodes=1, per_node=4) -> Layout:
    return Layout(DeviceMesh(n_nodes, per_node, tuple(ranks)),
                  ParallelStrategy(data, tensor, pipeline), microbatches)
