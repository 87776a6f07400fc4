"""The packed-sequence decoder-only transformer (Llama family: Llama 2/3, Qwen2, Qwen3, Mistral).

Notation: `total_tokens` tokens from `num_seqs` sequences are concatenated without padding;
`cu_seqlens` [num_seqs + 1] holds each sequence's start offset and the total at the end.

A block never decides how attention is computed: it projects queries/keys/values and hands
them to an `attend(layer_index, query, key, value)` callable. The packed training forward
passes a varlen-attention callable; the generation engine passes one that writes into and
reads from its key/value cache. So both paths share every weight and every line of math.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from realrl.models.attention import PackedLayout, varlen_attention
from realrl.models.config import ModelConfig
from realrl.models.layers import (
    LayerFactory,
    PlainLayerFactory,
    RMSNorm,
    RotaryTable,
    split_rotated_qkv,
)
from realrl.models.lm_head import lm_head_logprobs
from realrl.models.shared_prefix import find_shared_prefixes

if TYPE_CHECKING:
    from realrl.models.compiled import CompiledBlocks

logger = logging.getLogger(__name__)

# attend(layer_index, query [.., heads, head_dim], key, value [.., kv_heads, head_dim]) -> [.., heads, head_dim]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# The initialisers `reset_parameters` of torch's layers call (`torch.nn.init`).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                 "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def on_meta_device() -> Iterator[None]:
    """Build modules on the meta device (shapes, no storage) without running their random
    initialisers, for a model whose weights are assigned next or whose shapes are all that is
    wanted. On the meta device torch runs the initialisers through its Python reference
    kernels, and the first call imports torch._dynamo and sympy: 1.5 s of CPU in every worker
    that loads a checkpoint, measured on a 2-core machine, for values nobody reads. Not
    thread-safe: `torch.nn.init` is patched while it lasts."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}

    def skipped(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, skipped)
        with torch.device("meta"):
            yield
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor-parallel size {denominator}"
        )
    return numerator // denominator


class Attention(nn.Module):
    """Grouped-query self-attention with one fused query/key/value projection.

    The fused weight stacks [q heads; k heads; v heads] along the output dimension (HF's
    q_proj, k_proj, v_proj concatenated), so one matmul serves all three. `qkv_lora` and
    `output_lora` are LoRA adapters added to the projections' outputs
    (`realrl.models.lora.add_adapters`; None without).
    """

    def __init__(self, config: ModelConfig, factory: LayerFactory) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = _divide(config.num_attention_heads, factory.tp_size, "num_attention_heads")
        self.num_kv_heads = _divide(
            config.num_key_value_heads, factory.tp_size, "num_key_value_heads"
        )
        global_qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * self.head_dim
        self.qkv = factory.linear(config.hidden_size, global_qkv, config.qkv_bias, "column")
        global_out = config.num_attention_heads * self.head_dim
        self.output = factory.linear(global_out, config.hidden_size, False, "row")
        self.qkv_lora: nn.Module | None = None
        self.output_lora: nn.Module | None = None
        # Qwen3's per-head norms [head_dim]: every tp rank holds them whole and applies them to
        # its own heads, so each rank's gradient is a partial sum over heads; marked like a
        # sequence-parallel norm's, the optimizer backends sum them over the tp group.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        if config.qk_norm and factory.tp_size > 1:
            for norm in (self.q_norm, self.k_norm):
                norm.weight.sequence_parallel = True

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The `split_rotated_qkv` argument of the query and key norms (None without)."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """hidden [..., hidden_size] -> rotated query [..., heads, head_dim], key, value."""
        qkv = self.qkv(hidden)
        if self.qkv_lora is not None:
            qkv = qkv + self.qkv_lora(hidden)
        return split_rotated_qkv(qkv, self.num_heads, self.num_kv_heads, cos, sin,
                                 self.qk_norm())

    def project_output(self, attended: torch.Tensor) -> torch.Tensor:
        """attended [..., heads * head_dim] -> [..., hidden_size]."""
        output = self.output(attended)
        if self.output_lora is not None:
            output = output + self.output_lora(attended)
        return output


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused in one matmul;
    `gate_up_lora` and `down_lora` are LoRA adapters (None without)."""

    def __init__(self, config: ModelConfig, factory: LayerFactory) -> None:
        super().__init__()
        intermediate = config.intermediate_size
        self.local_intermediate = _divide(intermediate, factory.tp_size, "intermediate_size")
        self.gate_up = factory.linear(config.hidden_size, 2 * intermediate, False, "column")
        self.down = factory.linear(intermediate, config.hidden_size, False, "row")
        self.gate_up_lora: nn.Module | None = None
        self.down_lora: nn.Module | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(hidden)
        if self.gate_up_lora is not None:
            gate_up = gate_up + self.gate_up_lora(hidden)
        gate, up = gate_up.split(self.local_intermediate, dim=-1)
        activated = F.silu(gate) * up
        down = self.down(activated)
        if self.down_lora is not None:
            down = down + self.down_lora(activated)
        return down


class Block(nn.Module):
    def __init__(self, config: ModelConfig, factory: LayerFactory, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, factory)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, factory)

    def forward(self, hidden, cos, sin, attend: AttendFn) -> torch.Tensor:
        query, key, value = self.attention.project(self.attention_norm(hidden), cos, sin)
        attended = attend(self.layer_index, query, key, value)  # [..., heads, head_dim]
        hidden = hidden + self.attention.project_output(attended.flatten(-2))
        return hidden + self.mlp(self.mlp_norm(hidden))


def _eager_block(block: Block, hidden, cos, sin, attend: AttendFn) -> torch.Tensor:
    return block(hidden, cos, sin, attend)


class Transformer(nn.Module):
    """Decoder-only LM over packed sequences; with `config.is_critic` a scalar value model."""

    def __init__(self, config: ModelConfig, factory: LayerFactory | None = None) -> None:
        super().__init__()
        factory = factory or PlainLayerFactory()
        self.config = config
        self.tp_size = factory.tp_size
        # Its process group (None: one device) reduces the LM head's vocabulary slices.
        self.layer_factory = factory
        self.attention_kernel = "auto"
        # Run the tokens that consecutive packed sequences share from their start once in
        # `forward` (`realrl.models.shared_prefix`); the role's `share_prefixes` config key.
        self.share_prefixes = True
        # The LoRA adapters' settings (`realrl.models.lora.add_adapters`); None: no adapters.
        self.lora_config = None
        # Set by `realrl.models.compiled.enable_compiled_blocks`; None: eager blocks.
        self.compiled_blocks: CompiledBlocks | None = None
        # Activation checkpointing (`<role>.gradient_checkpointing`): forwards that build an
        # autograd graph keep each block's input only and recompute the block in the backward.
        self.gradient_checkpointing = False
        # Called between transformer layers, in the forward and (for tensors that need grad) in
        # the backward: a model worker re-balances its CPU threads there
        # (`realrl.workers.core_share`). Not called in decode steps.
        self.between_layers: Callable[[], None] | None = None
        self.embedding = factory.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, factory, i) for i in range(config.num_hidden_layers)
        )
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Sequence parallelism (`<role>.sequence_parallel`, Korthikanti et al. 2022): the
        # blocks' norms and residual adds run on this rank's share of the tokens
        # (`scatter_sequence` .. `gather_sequence`), so the norms' gradients are partial sums
        # that the optimizer backends all-reduce over the tp group (megatron's mark).
        self.sequence_parallel = factory.sequence_parallel
        if self.sequence_parallel:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.sequence_parallel = True
        self.rotary = RotaryTable(config)
        self.lm_head: nn.Module | None = None
        self.value_head: nn.Linear | None = None
        if config.is_critic:
            # Zero init: a fresh critic predicts 0 for every token and is trained from there.
            self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
            nn.init.zeros_(self.value_head.weight)
        else:
            self.lm_head = factory.lm_head(
                config.hidden_size, config.vocab_size, config.tie_word_embeddings
            )

    def hidden_states(
        self, packed_input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Final-normed hidden states [*ids.shape, hidden]; rotary capacity must be ensured."""
        hidden = self.embedding(packed_input_ids)
        cos, sin = self.rotary.lookup(position_ids, hidden.dtype)
        tokens = hidden.shape[0]
        hidden, cos, sin, attend = self.scatter_sequence(hidden, cos, sin, attend)
        compiled = self.compiled_blocks
        # Compiled graphs take packed [total_tokens, hidden] with at least 2 tokens (a size-1
        # dimension cannot be symbolic); anything else runs eager rather than recompile.
        use_compiled = compiled is not None and hidden.dim() == 2 and hidden.shape[0] >= 2
        between_layers = self.between_layers
        run_block = compiled if use_compiled else _eager_block
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                # Non-reentrant: works with tensors that need no grad, with the compiled parts
                # and with the tp layers' collectives (every tp rank recomputes the same
                # blocks in the same order). No block draws random numbers: no RNG to restore.
                hidden = checkpoint(
                    run_block, layer, hidden, cos, sin, attend,
                    use_reentrant=False, preserve_rng_state=False,
                )
            else:
                hidden = run_block(layer, hidden, cos, sin, attend)
            if between_layers is not None:
                between_layers()
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad: between_layers())
        return self.gather_sequence(self.final_norm(hidden), tokens)

    def scatter_sequence(self, hidden, cos, sin, attend: AttendFn):
        """Under sequence parallelism, embeddings [tokens, hidden] -> this rank's rows
        [ceil(tokens / tp), hidden], padded rotary tables and an `attend` that sees the real
        tokens only (`realrl.models.sequence_parallel`); otherwise unchanged."""
        if not self.sequence_parallel:
            return hidden, cos, sin, attend
        return self.layer_factory.scatter_sequence(hidden, cos, sin, attend)

    def gather_sequence(self, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
        """`scatter_sequence`'s inverse: every rank's rows gathered, padding dropped
        -> [tokens, hidden] (unchanged without sequence parallelism)."""
        if not self.sequence_parallel:
            return hidden
        return self.layer_factory.gather_sequence(hidden, tokens)

    def head(self, hidden: torch.Tensor, gather_vocab: bool = True) -> torch.Tensor:
        """LM logits [..., vocab] in the model dtype, or fp32 values [...] for a critic.

        A tensor-parallel model's head computes this rank's vocabulary slice
        [..., vocab / tp_size]; `gather_vocab` gathers the full logits (no gradient: generation
        samples from them), otherwise the slice is returned. Training and inference skip the head
        (`forward(..., apply_lm_head=False)` and `shifted_logprobs`).
        """
        if self.value_head is not None:
            return self.value_head(hidden).squeeze(-1).float()
        if self.tp_size > 1:
            tied = self.embedding.weight if self.config.tie_word_embeddings else None
            return self.lm_head(hidden, tied, gather_vocab)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.embedding.weight)

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab (/ tp_size), hidden]: the embedding's when tied."""
        weight = None if self.lm_head is None else self.lm_head.weight
        return self.embedding.weight if weight is None else weight

    def shifted_logprobs(
        self,
        hidden: torch.Tensor,
        packed_input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """fp32 log-probability [total_tokens - num_seqs] of each next token, from the final
        hidden states [total_tokens, hidden] of `forward(..., apply_lm_head=False)`: the LM head
        and the log-softmax fused, chunk by chunk (`realrl.models.lm_head`), never holding
        [total_tokens, vocab] logits; under tensor parallelism reduced over the tp group from
        each rank's vocabulary slice, without a gather."""
        logprobs, _ = lm_head_logprobs(
            hidden, self.lm_head_weight(), packed_input_ids, cu_seqlens, temperature,
            with_entropy=False, group=self.layer_factory.process_group,
        )
        return logprobs

    def shifted_logprobs_and_entropy(
        self,
        hidden: torch.Tensor,
        packed_input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`shifted_logprobs` and the fp32 entropy [total_tokens - num_seqs] of each next-token
        distribution (nats), from one pass over the logits' chunks. Detach the entropy when
        only logging it: its backward is then skipped."""
        logprobs, entropy = lm_head_logprobs(
            hidden, self.lm_head_weight(), packed_input_ids, cu_seqlens, temperature,
            with_entropy=True, group=self.layer_factory.process_group,
        )
        assert entropy is not None
        return logprobs, entropy

    def forward(
        self,
        packed_input_ids: torch.Tensor,  # [total_tokens]
        cu_seqlens: torch.Tensor,  # [num_seqs + 1]
        position_ids: torch.Tensor | None = None,  # [total_tokens]
        apply_lm_head: bool = True,
    ) -> torch.Tensor:
        """Logits [total_tokens, vocab] (critic: values [total_tokens], fp32); under tensor
        parallelism this rank's vocabulary slice [total_tokens, vocab / tp_size] (see `head`).
        Without `apply_lm_head` an LM returns its final hidden states [total_tokens, hidden],
        from which `shifted_logprobs` computes the head chunk by chunk: what training and
        inference use (the engine's forwards), so no [total_tokens, vocab] logits exist.

        Position ids default to 0..len-1 within each sequence. Costs one host sync to read
        the sequence lengths, and with `share_prefixes` one more to find the shared tokens.
        """
        layout = PackedLayout.from_cu_seqlens(cu_seqlens)
        if position_ids is None:
            layout.ensure_token_indices()
            position_ids = layout.index_in_sequence
            self.rotary.ensure_capacity(layout.max_seqlen, self.device)
        else:
            self.rotary.ensure_capacity(int(position_ids.max()) + 1, self.device)
        window, kernel = self.config.sliding_window, self.attention_kernel
        prefixes = None
        if self.share_prefixes:
            prefixes = find_shared_prefixes(packed_input_ids, position_ids, layout)
        if prefixes is None:

            def attend(layer_index, query, key, value):
                return varlen_attention(query, key, value, layout, window, kernel)

            hidden = self.hidden_states(packed_input_ids, position_ids, attend)
            return self._output(hidden, apply_lm_head)

        def attend_whole_sequences(layer_index, query, key, value):
            query, key, value = (prefixes.expand(t) for t in (query, key, value))
            return prefixes.compact(varlen_attention(query, key, value, layout, window, kernel))

        hidden = self.hidden_states(
            prefixes.compact(packed_input_ids),
            prefixes.compact(position_ids),
            attend_whole_sequences,
        )
        return self._output(prefixes.expand(hidden), apply_lm_head)

    def _output(self, hidden: torch.Tensor, apply_lm_head: bool) -> torch.Tensor:
        """`forward`'s result from the final hidden states [total_tokens, hidden]."""
        if apply_lm_head or self.value_head is not None:
            return self.head(hidden, gather_vocab=False)
        return hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device
