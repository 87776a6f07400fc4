"""Sequence parallelism's token split around the blocks (Korthikanti et al. 2022).

Under tensor parallelism every tp rank runs the norms and residual adds of every token and
keeps their activations. With sequence parallelism (`<role>.sequence_parallel`) rank r holds
rows [r * padded / tp, (r + 1) * padded / tp) of the residual stream instead: megatron-core's
column-parallel linears (`sequence_parallel=True`) all-gather the rows before their matmul and
save only the rank's rows for the backward, and its row-parallel linears reduce-scatter their
output back to them (`realrl.models.megatron_layers`). This module enters and leaves that
split:

- `scatter_sequence` pads the embeddings [tokens, hidden] with zero rows to
  `padded = tp * ceil(tokens / tp)` and keeps this rank's rows; it pads the rotary tables
  alike (the projections hand attention all `padded` rows) and wraps `attend` so that
  attention sees the real tokens only and returns zero rows for the padding;
- `gather_sequence` all-gathers the final-normed rows and drops the padding, so the heads,
  prefix sharing, log-probs and generation see [tokens, hidden] as without it.

The padding never reaches a real token, an output or a loss: attention drops it, every other
layer works on each row alone, and the gather drops its rows, so they get no gradient.

megatron's mappings allocate on `torch.cuda.current_device()` and its linears gather into
`parallel_state`'s global memory buffer: realrl uses them on CUDA workers only (tests run them
on CPU ranks under `tests/megatron_cpu_shim.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel as megatron_tp

# attend(layer_index, query, key, value) -> attended, as `realrl.models.transformer.AttendFn`.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def scatter_sequence(
    hidden: torch.Tensor,  # [tokens, hidden], equal on every rank of `group`
    cos: torch.Tensor,  # [tokens, 1, head_dim]
    sin: torch.Tensor,
    attend: Attend,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Attend]:
    """This rank's rows [padded / tp, hidden] (the backward all-gathers their gradient), the
    rotary tables padded to [padded, 1, head_dim], and `attend` on the real tokens only."""
    tokens = hidden.shape[0]
    padding = -tokens % group.size()
    hidden, cos, sin = (_pad_rows(t, padding) for t in (hidden, cos, sin))
    rows = megatron_tp.scatter_to_sequence_parallel_region(hidden, group=group)

    def attend_real_tokens(layer_index, query, key, value):
        attended = attend(layer_index, query[:tokens], key[:tokens], value[:tokens])
        return _pad_rows(attended, padding)

    return rows, cos, sin, attend_real_tokens


def gather_sequence(
    hidden: torch.Tensor,  # [padded / tp, hidden]: this rank's rows
    tokens: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Every rank's rows all-gathered, padding dropped -> [tokens, hidden], equal on every
    rank. The heads after it give the full gradient of these rows on every rank (the LM head
    all-reduces it, a critic's replicated value head computes it alike), so the backward keeps
    this rank's slice (`tensor_parallel_output_grad=False`) instead of reduce-scattering."""
    gathered = megatron_tp.gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=False, group=group
    )
    return gathered[:tokens]


def ensure_global_memory_buffer() -> None:
    """megatron's sequence-parallel linears all-gather their input into a scratch buffer of
    `parallel_state` (`get_global_memory_buffer`; it holds no process group, and one per
    process serves every layout); `initialize_model_parallel`, which realrl never calls, would
    make it."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def _pad_rows(tensor: torch.Tensor, padding: int) -> torch.Tensor:
    """`tensor` [rows, ...] with `padding` zero rows appended."""
    if padding == 0:
        return tensor
    return torch.cat((tensor, tensor.new_zeros((padding, *tensor.shape[1:]))))
