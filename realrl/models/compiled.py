"""Opt-in torch.compile'd transformer blocks for packed training and inference forwards.

Between its matmuls a block runs a dozen element-wise ops (RMSNorm, rotary, SiLU * up,
residual adds and their backwards), each a separate pass over the activations in eager mode.
On CPU at small model sizes they cost as much as the matmuls; inductor fuses them into a few
loops, while matmuls stay the same aten calls. Attention is data-dependent (per-sequence or
padded kernels chosen from the packed layout) and stays eager, between two compiled parts:

    before_attention: norm -> qkv projection -> rotary           (query, key, value)
    after_attention:  output projection + residual -> norm -> SwiGLU MLP + residual

Both parts are plain functions of tensors: every weight is an argument, never a module
attribute, so dynamo has no module identity or layer index to guard on and all layers share one
compiled graph. The token dimension is marked dynamic on every call, so the first call compiles
a graph that serves every packed batch; nothing recompiles later. Dynamo does guard on grad
mode and on whether the weights require grad, so a process compiles each part once per use:
training (forward + backward), no-grad inference of a trained model (e.g. the prefill before
generation), and inference of a frozen model (and again per dtype and per CPU thread count; see
`CompiledBlocks`); each compile takes seconds. The graphs live on the code objects of the two
functions, so models of the same shape in one process (actor, critic, ref on one worker) share
them, and a process stays far below dynamo's limit of 8 graphs per function (past it, dynamo
would fall back to eager with a warning in the log).

Measured with `benchmarks/bench_train_compile.py` (the 4M-parameter benchmark model, 32 x 40
tokens, fp32, 2-core CPU): forward + backward 0.45 -> 0.39 s on one thread and 0.25 -> 0.22 s
on two (1.15-1.18x), a no-grad forward 1.12-1.16x; the first forward + backward compiles for
~4-6 s (28 s with a cold inductor cache). What is left is ~75% matmuls, which inductor leaves
to the same aten kernels, and attention; see benchmarks/README.md.

Tensor-parallel models are not compiled: their linear layers communicate through autograd
functions that dynamo would have to trace. `enable_compiled_blocks` refuses them, and
`realrl.workers.model_loading` leaves such a shard eager with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from realrl.models.layers import rms_norm, split_rotated_qkv

if TYPE_CHECKING:
    from realrl.models.transformer import AttendFn, Block, Transformer

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def explain_compile_failure(key: str, what: str) -> Iterator[None]:
    """Turn inductor's failure to build code (most often: no C++ compiler on CPU) into an error
    that names the config key that asked for compiling and both ways out."""
    try:
        yield
    except torch._dynamo.exc.BackendCompilerFailed as error:
        raise RuntimeError(
            f"{key}=true: torch.compile could not build {what} ({error}); install a working "
            f"C++ compiler (g++ or clang; set $CXX to choose one) or set {key}=false"
        ) from error


def before_attention(
    hidden: torch.Tensor,  # [total_tokens, hidden]
    norm_weight: torch.Tensor,  # [hidden]
    qkv_weight: torch.Tensor,  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None,  # [(heads + 2 * kv_heads) * head_dim]
    cos: torch.Tensor,  # [total_tokens, 1, head_dim]
    sin: torch.Tensor,  # [total_tokens, 1, head_dim]
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # Qwen3's, [head_dim]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Block`'s math up to attention: rotated query [total_tokens, heads, head_dim], key and
    value [total_tokens, kv_heads, head_dim] (same ops as `Attention.project`)."""
    qkv = F.linear(rms_norm(hidden, norm_weight, eps), qkv_weight, qkv_bias)
    return split_rotated_qkv(qkv, num_heads, num_kv_heads, cos, sin, qk_norm)


def after_attention(
    hidden: torch.Tensor,  # [total_tokens, hidden]: the block's input (residual)
    attended: torch.Tensor,  # [total_tokens, heads, head_dim]
    output_weight: torch.Tensor,  # [hidden, heads * head_dim]
    norm_weight: torch.Tensor,  # [hidden]
    gate_up_weight: torch.Tensor,  # [2 * intermediate, hidden]
    down_weight: torch.Tensor,  # [hidden, intermediate]
    eps: float,
) -> torch.Tensor:
    """`Block`'s math after attention -> the block's output [total_tokens, hidden] (same ops
    as `Block.forward` and `MLP.forward`)."""
    hidden = hidden + F.linear(attended.flatten(-2), output_weight)
    gate, up = F.linear(rms_norm(hidden, norm_weight, eps), gate_up_weight).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down_weight)


class CompiledBlocks:
    """Runs a `Block` as compiled `before_attention`, eager `attend`, compiled `after_attention`.

    `key` is the config key that turned compiling on (e.g. `actor.compile`), for the error
    raised when inductor cannot build code. `thread_counts`: every CPU thread count this
    process may run at (a model worker that borrows idle cores sets it,
    `realrl.workers.core_share`). Dynamo guards compiled code on the thread count, so the
    first call in each mode (training, inference, frozen inference, dtype) compiles the parts
    for all of those counts at once, on two tokens, instead of once more mid-run at whichever
    step a core is first lent. (With the token dimension dynamic, a forward that needs grad
    compiles its backward at the same time.)
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.before_attention: Callable = torch.compile(before_attention, fullgraph=True)
        self.after_attention: Callable = torch.compile(after_attention, fullgraph=True)
        self.thread_counts: tuple[int, ...] = ()
        self._modes_compiled: set[tuple] = set()

    def __call__(
        self,
        block: Block,
        hidden: torch.Tensor,  # [total_tokens, hidden]
        cos: torch.Tensor,  # [total_tokens, 1, head_dim]
        sin: torch.Tensor,
        attend: AttendFn,
    ) -> torch.Tensor:
        if self.thread_counts:
            weight = block.attention.qkv.weight
            mode = (torch.is_grad_enabled(), hidden.requires_grad, weight.requires_grad,
                    hidden.dtype)
            if mode not in self._modes_compiled:
                self._modes_compiled.add(mode)
                self._compile_for_thread_counts(block, hidden, cos, sin)
        return self._run(block, hidden, cos, sin, attend)

    def _compile_for_thread_counts(
        self, block: Block, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        threads = torch.get_num_threads()
        sample = hidden[:2].detach().requires_grad_(hidden.requires_grad)
        try:
            for count in self.thread_counts:
                torch.set_num_threads(count)
                # The query stands in for attention's output: same shape, same grad mode.
                self._run(block, sample, cos[:2], sin[:2], lambda _, query, key, value: query)
        finally:
            torch.set_num_threads(threads)

    def _run(
        self,
        block: Block,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: AttendFn,
    ) -> torch.Tensor:
        attention, mlp = block.attention, block.mlp
        # One graph for every token count: the first call compiles it with the token dimension
        # symbolic instead of specialising on this batch and recompiling on the next.
        for tensor in (hidden, cos, sin):
            torch._dynamo.mark_dynamic(tensor, 0)
        with explain_compile_failure(self.key, "the transformer block"):
            query, key, value = self.before_attention(
                hidden,
                block.attention_norm.weight,
                attention.qkv.weight,
                attention.qkv.bias,
                cos,
                sin,
                block.attention_norm.eps,
                attention.num_heads,
                attention.num_kv_heads,
                attention.qk_norm(),
            )
            # Contiguous (a no-op for every kernel but `block_diagonal`): a new stride pattern
            # from another attention kernel would otherwise recompile.
            attended = attend(block.layer_index, query, key, value).contiguous()
            torch._dynamo.mark_dynamic(attended, 0)
            return self.after_attention(
                hidden,
                attended,
                attention.output.weight,
                block.mlp_norm.weight,
                mlp.gate_up.weight,
                mlp.down.weight,
                block.mlp_norm.eps,
            )


def enable_compiled_blocks(model: Transformer, key: str) -> None:
    """Make `model`'s packed forwards (training and inference; not the decode step, which has
    `gen.compile`) run its blocks compiled. Refuses tensor-parallel models."""
    if model.tp_size != 1:
        raise ValueError(
            f"{key}=true: compiled blocks need tensor-parallel size 1, got {model.tp_size}"
        )
    if model.lora_config is not None:  # the parts below take the projections' weights only
        raise ValueError(f"{key}=true: compiled blocks do not run LoRA adapters; set {key}=false")
    model.compiled_blocks = CompiledBlocks(key)
    logger.info(
        "%s=true: transformer blocks run compiled; the first training and inference forwards "
        "compile them (seconds each)",
        key,
    )
