"""Peak memory per device of a whole plan (one `Layout` per MFC).

A device holds, for as long as the run lasts, one copy of the weights of every (role, layout)
pair that runs on it (`realrl.workers.realloc` keeps a copy per layout), and for a role trained
in that layout its gradients and Adam state. On top of that, while one of its MFCs runs, that
MFC's transient memory: activations of one micro-batch and one chunk of logits when
training, a chunk of logits and one layer's temporaries in inference, the KV cache and one
step's logits when generating. MFCs on
one device run one after another, so the peak is the held memory plus the largest transient.

Units: bytes; notation as in `realrl.plan.costs`.
"""

from __future__ import annotations

import numpy as np

from realrl.plan.costs import (
    ADAM_BYTES_PER_PARAMETER,
    DTYPE_BYTES,
    Layout,
    MFCWork,
    WorkKind,
)

LOGIT_BYTES = 4  # logits are float32 whatever the weights' dtype
# The LM head is fused with the log-softmax (`realrl.models.lm_head`): it holds one chunk of
# rows' logits at a time, at least 512 rows (GPU) or 2**22 logits (`realrl.algo.layout`).
LOGIT_CHUNK_ELEMENTS = 2**22
LOGIT_CHUNK_MIN_ROWS = 512


def activation_values_per_token_layer(hidden_size: int, intermediate_size: int) -> int:
    """Values a training forward keeps per token and layer: ~16 h + 4 f (the attention and
    MLP inputs, outputs and SwiGLU's intermediates; `<mfc>.max_tokens_per_microbatch`'s help
    text)."""
    return 16 * hidden_size + 4 * intermediate_size


def _logit_rows(tokens: float, vocab_size: int) -> float:
    return min(tokens, max(LOGIT_CHUNK_MIN_ROWS, LOGIT_CHUNK_ELEMENTS // max(vocab_size, 1)))


def held_bytes(work: MFCWork, layout: Layout, trains: bool, shard_optimizer: bool) -> float:
    """Weights of `work`'s role in `layout` on one device, with gradients and Adam state when
    `trains` (the role's train MFC uses this layout). `shard_optimizer`: the optimizer state
    is divided over the data-parallel ranks (megatron-core's distributed optimizer)."""
    if work.model is None:
        return 0.0
    strategy = layout.strategy
    parameters = work.model.num_parameters / (strategy.tensor * strategy.pipeline)
    weight_bytes = DTYPE_BYTES[work.dtype]
    held = parameters * weight_bytes
    if trains:
        optimizer = ADAM_BYTES_PER_PARAMETER + (4 if weight_bytes < 4 else 0)  # + fp32 master
        held += parameters * weight_bytes  # gradients
        held += parameters * optimizer / (strategy.data if shard_optimizer else 1)
    return held


def transient_bytes(work: MFCWork, layout: Layout) -> float:
    """The most one call of `work` adds while it runs, on one device of `layout`."""
    model = work.model
    if model is None:
        return 0.0
    strategy = layout.strategy
    value_bytes = DTYPE_BYTES[work.dtype]
    vocab = 0 if model.value_head else model.vocab_size / strategy.tensor
    layers = model.num_layers / strategy.pipeline
    if work.kind == WorkKind.generate:
        rows = work.num_sequences / strategy.data
        kv_shards = min(strategy.tensor, model.num_key_value_heads)
        cache = (rows * work.sequence_tokens * layers * 2 * model.key_value_size * value_bytes
                 / kv_shards)
        prefill = rows * work.prompt_tokens * 8 * model.hidden_size * value_bytes
        return cache + rows * vocab * LOGIT_BYTES + prefill
    chunks = layout.num_microbatches * (work.optimizer_steps if work.kind == WorkKind.train_step
                                        else 1)
    tokens = work.total_tokens / strategy.data / chunks
    logits = _logit_rows(tokens, model.vocab_size) * vocab * LOGIT_BYTES
    if work.kind == WorkKind.inference:  # one chunk of logits, one layer's temporaries
        return logits + tokens * 8 * model.hidden_size * value_bytes
    in_flight = min(strategy.pipeline, layout.num_microbatches) if strategy.pipeline > 1 else 1
    values = activation_values_per_token_layer(model.hidden_size, model.intermediate_size)
    activations = tokens * layers * values / strategy.tensor * value_bytes * in_flight
    return activations + 2 * logits  # a chunk's logits and their gradient


def _ranks_index(ranks: tuple[int, ...]) -> slice | list[int]:
    """A slice for a block of consecutive ranks (every searched mesh), else the list."""
    if ranks[-1] - ranks[0] + 1 == len(ranks):
        return slice(ranks[0], ranks[-1] + 1)
    return list(ranks)


def peak_bytes_array(works: dict[str, MFCWork], layouts: dict[str, Layout],
                     shard_optimizer: bool = False) -> np.ndarray:
    """[max rank + 1] peak bytes of the plan `layouts` (MFC name -> layout); ranks no MFC
    uses hold 0. numpy, because the search prices thousands of plans on up to 128 ranks."""
    trained_layouts = {(works[name].role, layouts[name].mesh, layouts[name].strategy)
                       for name in works if works[name].kind == WorkKind.train_step}
    held: dict[tuple, float] = {}
    for name, work in works.items():
        layout = layouts[name]
        key = (work.role, layout.mesh, layout.strategy)
        held[key] = max(held.get(key, 0.0),
                        held_bytes(work, layout, key in trained_layouts, shard_optimizer))
    size = 1 + max(layouts[name].mesh.ranks[-1] for name in works)
    peak, transient = np.zeros(size), np.zeros(size)
    for (_, mesh, _), num_bytes in held.items():
        peak[_ranks_index(mesh.ranks)] += num_bytes
    for name, work in works.items():
        index = _ranks_index(layouts[name].mesh.ranks)
        transient[index] = np.maximum(transient[index], transient_bytes(work, layouts[name]))
    return peak + transient


def peak_bytes_per_device(works: dict[str, MFCWork], layouts: dict[str, Layout],
                          shard_optimizer: bool = False) -> dict[int, float]:
    """Rank -> peak bytes of the plan `layouts`, for the ranks its MFCs use."""
    peaks = peak_bytes_array(works, layouts, shard_optimizer)
    used = {rank for layout in layouts.values() for rank in layout.mesh.ranks}
    return {rank: float(peaks[rank]) for rank in sorted(used)}
