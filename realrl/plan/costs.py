"""The cost of one MFC under one layout: compute, communication and peak memory per device.

Notation: ``L`` layers, ``h`` hidden size, ``f`` MLP size, ``V`` vocabulary, ``dp``/``tp``/``pp``
the layout's data/tensor/pipeline sizes, ``mb`` micro-batches per optimizer step. A
transformer layer's matmuls hold ``h(h + 2 kv) + h^2 + 3 h f`` parameters (q, k, v, o and
SwiGLU's three), and a forward costs 2 FLOPs per matmul parameter per token plus the attention
scores, ``4 h c`` per token and layer over a context of ``c`` keys (Kaplan et al. 2020, eq. 2.2;
a causal sequence of ``s`` tokens averages ``c = s / 2``). A backward costs twice a forward.

Times are what the slowest rank of the layout spends; the ranks of a layout work in lockstep.
Every function here is pure arithmetic, checked against hand-computed cases in
tests/plan/test_costs.py.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Iterable

from realrl.api.allocation import DeviceMesh, ParallelStrategy, format_ranks
from realrl.plan.devices import DeviceSpec, Link

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Adam's two moments in fp32, plus an fp32 master copy when the weights are in 16 bits.
ADAM_BYTES_PER_PARAMETER = 8


class WorkKind(str, enum.Enum):
    generate = "generate"
    inference = "inference"
    train_step = "train_step"
    rule = "rule"  # no model: a rule-based reward on the worker's CPU


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tied_embeddings: bool = False
    value_head: bool = False  # a critic: a scalar head instead of the LM head
    head_dim: int = 0  # 0: hidden_size / num_attention_heads (Qwen3's is its own: 128 at 1024)
    qk_norm: bool = False  # Qwen3's per-head query and key norms

    @classmethod
    def from_hf_config(cls, config: dict, value_head: bool = False) -> ModelShape:
        heads = config.get("num_attention_heads", config.get("n_head"))
        return cls(
            num_layers=config.get("num_hidden_layers", config.get("n_layer")),
            hidden_size=config.get("hidden_size", config.get("n_embd")),
            intermediate_size=config.get("intermediate_size") or 4 * config["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            value_head=value_head,
            head_dim=config.get("head_dim") or 0,
            qk_norm=config.get("model_type") == "qwen3",
        )

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def key_value_size(self) -> int:
        return self.num_key_value_heads * self.attention_head_dim

    @property
    def layer_matmul_parameters(self) -> int:
        h = self.hidden_size
        return (h * (self.query_size + 2 * self.key_value_size) + self.query_size * h
                + 3 * h * self.intermediate_size)

    @property
    def head_parameters(self) -> int:
        return self.hidden_size if self.value_head else self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Layers (matmuls and two norms, Qwen3's two per-head ones), embedding, final norm,
        and the head unless tied."""
        h = self.hidden_size
        norms = 2 * h + (2 * self.attention_head_dim if self.qk_norm else 0)
        untied_head = self.value_head or not self.tied_embeddings
        return (self.num_layers * (self.layer_matmul_parameters + norms) + self.vocab_size * h
                + h + (self.head_parameters if untied_head else 0))

    def forward_flops_per_token(self, context: float) -> float:
        return self.body_flops_per_token(context) + self.head_flops_per_token

    def body_flops_per_token(self, context: float) -> float:
        """The transformer layers' matmuls and attention scores."""
        return (2 * self.num_layers * self.layer_matmul_parameters
                + 4 * self.num_layers * self.query_size * context)

    @property
    def head_flops_per_token(self) -> float:
        return 2 * self.head_parameters


@dataclasses.dataclass(frozen=True)
class MFCWork:
    """What one MFC computes per step. Token counts cover all data-parallel ranks together."""

    name: str
    role: str
    kind: WorkKind
    model: ModelShape | None  # None: a rule reward
    num_sequences: int
    prompt_tokens: int  # per sequence
    generated_tokens: int  # per sequence
    dtype: str = "float32"
    role_is_trained: bool = False  # the role's weights change every step (its layouts realloc)
    optimizer_steps: int = 1  # train: PPO mini-batches x epochs
    epochs: int = 1  # train: passes over the batch
    transfer_bytes_per_token: int = 24  # master <-> worker: ids, masks, log-probs
    rule_seconds_per_sequence: float = 2e-4  # rule rewards: parse and verify one response
    microbatch_choices: tuple[int, ...] | None = None  # None: the search's choices
    # train: the MFCs its first forward reads from when the master sends that forward ahead of
    # the call (`MFCDef.forward_keys`); (): it runs within the call
    forward_ahead_after: tuple[str, ...] = ()
    # The samples (prompts with their responses) a call splits over its data-parallel ranks,
    # each rank at least one (`SequenceSample.split_data_parallel`); 0: one per sequence.
    num_samples: int = 0

    @property
    def samples(self) -> int:
        return self.num_samples or self.num_sequences

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def total_tokens(self) -> int:
        return self.num_sequences * self.sequence_tokens


@dataclasses.dataclass(frozen=True)
class Cluster:
    n_nodes: int
    n_devices_per_node: int
    device: DeviceSpec
    # How many of a node's devices run at full speed at once; None: all of them (each device
    # has its own hardware). CPU workers that outnumber the cores share them: with ``k`` of
    # a node's workers busy, each runs at ``min(1, parallel_devices_per_node / k)``.
    parallel_devices_per_node: int | None = None
    # How much a node's busy devices slow each other besides sharing cores (CPU workers and
    # the master on one machine's caches, memory bandwidth and spare core): with ``k`` busy,
    # ``k`` capped at the devices that run at once, each runs ``1 + contention x (k - 1)``
    # times slower. 0 for accelerators; fitted to a side-by-side probe run on CPU
    # (`realrl.plan.contention.fit_contention`).
    contention: float = 0.0

    @property
    def size(self) -> int:
        return self.n_nodes * self.n_devices_per_node

    @property
    def devices_interfere(self) -> bool:
        """Whether calls on different devices of a node slow each other (`speed` below 1)."""
        return self.parallel_devices_per_node is not None or self.contention > 0

    def devices_per_node(self, ranks: Iterable[int]) -> Counter[int]:
        """How many of `ranks` each node holds."""
        return Counter(rank // self.n_devices_per_node for rank in ranks)

    def speed(self, busy_per_node: Counter[int], ranks: tuple[int, ...]) -> float:
        """The fraction of full speed a call on `ranks` runs at while `busy_per_node[node]` of
        each node's devices (its own among them) are running calls."""
        if not self.devices_interfere:
            return 1.0
        slots = self.parallel_devices_per_node or self.n_devices_per_node
        speeds = []
        for node in self.devices_per_node(ranks):
            busy = max(busy_per_node[node], 1)
            speeds.append(min(1.0, slots / busy) / (1 + self.contention * (min(busy, slots) - 1)))
        return min(speeds)

    def solo_speed(self, ranks: tuple[int, ...]) -> float:
        """`speed` of a call on `ranks` with nothing else running (a calibration probe's)."""
        return self.speed(self.devices_per_node(ranks), ranks)

    def link_within(self, ranks: tuple[int, ...]) -> Link:
        """The slowest link between `ranks`: the node interconnect once they span nodes."""
        nodes = self.devices_per_node(ranks)
        return self.device.intra_node if len(nodes) <= 1 else self.device.inter_node


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate allocation of one MFC."""

    mesh: DeviceMesh
    strategy: ParallelStrategy
    num_microbatches: int = 1

    def text(self, name: str) -> str:
        """This layout as an `allocation_mode` entry, e.g. ``actor_train:d2t1p1@0-1``."""
        return f"{name}:{self.strategy}@{format_ranks(self.mesh.ranks)}"


def ring_all_reduce_seconds(num_bytes: float, group_size: int, link: Link) -> float:
    """Ring all-reduce: 2 (n - 1) steps, each moving bytes / n and paying the latency."""
    if group_size <= 1:
        return 0.0
    steps = 2 * (group_size - 1)
    return steps * link.latency_s + steps / group_size * num_bytes / link.bandwidth_bytes_per_s


def _tensor_link(layout: Layout, cluster: Cluster) -> Link:
    # Tensor-parallel groups are consecutive ranks (`realrl.api.allocation`): one node
    # whenever tp divides n_devices_per_node, which the candidates keep.
    group = layout.mesh.ranks[: layout.strategy.tensor]
    return cluster.link_within(group)


def _forward_seconds_per_token(model: ModelShape, context: float, dtype: str,
                               device: DeviceSpec) -> float:
    """The layers at the weights' dtype; the LM head's logits in float32, as the fused head
    computes them (`realrl.models.lm_head`), a value head at the weights' dtype."""
    head_dtype = dtype if model.value_head else "float32"
    return (model.body_flops_per_token(context) / device.flops(dtype)
            + model.head_flops_per_token / device.flops(head_dtype))


def compute_seconds(work: MFCWork, layout: Layout, device: DeviceSpec) -> float:
    """Matmul time on the slowest rank plus fixed per-layer overheads; pipeline bubbles."""
    if work.model is None:
        return work.num_sequences / layout.strategy.data * work.rule_seconds_per_sequence
    model, strategy = work.model, layout.strategy
    shard = strategy.tensor * strategy.pipeline
    layers_per_stage = model.num_layers / strategy.pipeline
    if work.kind == WorkKind.generate:
        return _generate_seconds(work, layout, device)
    tokens = work.total_tokens / strategy.data
    forward = tokens * _forward_seconds_per_token(model, work.sequence_tokens / 2, work.dtype,
                                                  device) / shard
    passes = 1 if work.kind == WorkKind.inference else 3 * work.epochs
    chunks = layout.num_microbatches * (work.optimizer_steps if work.kind == WorkKind.train_step
                                        else 1)
    overhead = passes * chunks * layers_per_stage * device.kernel_overhead_s
    bubble = (layout.num_microbatches + strategy.pipeline - 1) / layout.num_microbatches
    seconds = (passes * forward + overhead) * bubble
    if work.kind == WorkKind.train_step:  # Adam reads and writes weights, grads and moments
        parameters = model.num_parameters / shard
        bytes_touched = parameters * (3 * DTYPE_BYTES[work.dtype] + 2 * ADAM_BYTES_PER_PARAMETER)
        seconds += work.optimizer_steps * bytes_touched / device.memory_bandwidth_bytes_per_s
    return seconds


def _generate_seconds(work: MFCWork, layout: Layout, device: DeviceSpec) -> float:
    """Prefill (compute bound) and one decode step per generated token: the larger of its
    FLOPs and the bytes it reads (weights and KV cache), plus the layers' fixed overheads.
    Pipeline stages run one after another for a token, so pp shards memory, not time."""
    model, strategy = work.model, layout.strategy
    assert model is not None
    rows = work.num_sequences / strategy.data
    prefill = (rows * work.prompt_tokens
               * _forward_seconds_per_token(model, work.prompt_tokens / 2, work.dtype, device)
               / strategy.tensor)
    seconds = prefill + model.num_layers * device.kernel_overhead_s
    weight_bytes = model.num_parameters * DTYPE_BYTES[work.dtype] / strategy.tensor
    for step in range(work.generated_tokens):
        context = work.prompt_tokens + step
        compute = (rows * _forward_seconds_per_token(model, context, work.dtype, device)
                   / strategy.tensor)
        cache = (rows * context * model.num_layers * 2 * model.key_value_size
                 * DTYPE_BYTES[work.dtype] / strategy.tensor)
        memory = (weight_bytes + cache) / device.memory_bandwidth_bytes_per_s
        seconds += max(compute, memory) + model.num_layers * device.kernel_overhead_s
    return seconds


def tensor_parallel_seconds(work: MFCWork, layout: Layout, cluster: Cluster) -> float:
    """Two all-reduces of the [tokens, h] activations per layer and forward (after attention
    and after the MLP), two more per backward; decode all-reduces one row per sequence."""
    strategy = layout.strategy
    if work.model is None or strategy.tensor == 1:
        return 0.0
    link = _tensor_link(layout, cluster)
    layers = work.model.num_layers / strategy.pipeline
    value_bytes = work.model.hidden_size * DTYPE_BYTES[work.dtype]
    rows = work.num_sequences / strategy.data
    if work.kind == WorkKind.generate:
        prefill = 2 * layers * ring_all_reduce_seconds(
            rows * work.prompt_tokens * value_bytes, strategy.tensor, link)
        decode = 2 * layers * ring_all_reduce_seconds(rows * value_bytes, strategy.tensor, link)
        return prefill + work.generated_tokens * decode
    chunks = layout.num_microbatches * (work.optimizer_steps if work.kind == WorkKind.train_step
                                        else 1)
    chunk_bytes = rows * work.sequence_tokens * value_bytes / chunks
    per_layer = 2 if work.kind == WorkKind.inference else 4 * work.epochs
    return chunks * per_layer * layers * ring_all_reduce_seconds(chunk_bytes, strategy.tensor,
                                                                 link)


def pipeline_seconds(work: MFCWork, layout: Layout, cluster: Cluster) -> float:
    """Point-to-point sends of each micro-batch's activations between consecutive stages
    (and their gradients back, when training)."""
    strategy = layout.strategy
    if work.model is None or strategy.pipeline == 1 or work.kind == WorkKind.generate:
        return 0.0
    link = cluster.link_within(layout.mesh.ranks)
    tokens = work.total_tokens / strategy.data / layout.num_microbatches
    send = link.seconds(tokens * work.model.hidden_size * DTYPE_BYTES[work.dtype])
    directions = 1 if work.kind == WorkKind.inference else 2 * work.epochs
    return directions * layout.num_microbatches * (strategy.pipeline - 1) * send


def gradient_seconds(work: MFCWork, layout: Layout, cluster: Cluster) -> float:
    """Data-parallel gradient sum: one all-reduce of the rank's gradient shard per optimizer
    step, over the data-parallel group (it crosses nodes once the mesh does)."""
    strategy = layout.strategy
    if work.kind != WorkKind.train_step or work.model is None or strategy.data == 1:
        return 0.0
    gradient_bytes = (work.model.num_parameters * DTYPE_BYTES[work.dtype]
                      / (strategy.tensor * strategy.pipeline))
    link = cluster.link_within(layout.mesh.ranks)
    return work.optimizer_steps * ring_all_reduce_seconds(gradient_bytes, strategy.data, link)


def transfer_seconds(work: MFCWork, layout: Layout, cluster: Cluster) -> float:
    """The master sends each data-parallel rank its part of the batch and gathers the
    outputs: one request per rank, the batch's bytes once over the master's link."""
    link = cluster.device.host
    return (layout.strategy.data * link.latency_s
            + work.total_tokens * work.transfer_bytes_per_token / link.bandwidth_bytes_per_s)


def realloc_seconds(model: ModelShape, dtype: str, source: Layout, target: Layout,
                    cluster: Cluster) -> float:
    """Move a role's newest weights from `source`'s layout to `target`'s (the pre-hook of
    `realrl.workers.realloc`): each target rank receives its shard, all ranks at once, over
    the slowest link between the two meshes. Free when the layouts are the same."""
    if source.mesh == target.mesh and source.strategy == target.strategy:
        return 0.0
    shard_bytes = (model.num_parameters * DTYPE_BYTES[dtype]
                   / (target.strategy.tensor * target.strategy.pipeline))
    link = cluster.link_within(tuple(sorted(set(source.mesh.ranks) | set(target.mesh.ranks))))
    return link.seconds(shard_bytes)


def mfc_seconds(work: MFCWork, layout: Layout, cluster: Cluster) -> float:
    """Everything one call costs but reallocation, which depends on the neighbouring calls."""
    return (compute_seconds(work, layout, cluster.device)
            + tensor_parallel_seconds(work, layout, cluster)
            + pipeline_seconds(work, layout, cluster)
            + gradient_seconds(work, layout, cluster)
            + transfer_seconds(work, layout, cluster))
