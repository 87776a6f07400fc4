"""Batched sampling with a preallocated key/value cache, in plain torch (CPU and GPU).

Two decode paths share the prefill, the token choice and the output:
- CUDA at tensor-parallel size 1 (`GenerationConfig.cuda_graphs`, on by default): static-shape
  steps over a state allocated once per batch-size bucket, captured as CUDA graphs and
  replayed, one launch per step (`realrl.models.cuda_graphs`, which says why and how); with
  `compile` the captured step is inductor's. The same steps run uncaptured on CPU in tests,
  where they give the tokens of the path below.
- Everything else (CPU, tensor parallelism, `cuda_graphs=False`): the steps described below,
  eager or compiled, launched from Python every step. They can run in several calls
  (`start_decoding`, `decode_steps`, `finish_decoding`), with the same tokens as one:
  interruptible generation (`realrl.models.interruptible_generation`) swaps weights between two.
On an H100 (0.5B-shaped model, bf16, 64 rows) a captured step takes 2.6 ms (1.8 compiled)
against 17.3 ms launched eagerly and a floor of 0.38 ms (docs/design.md, "Generation").

Notation: `num_prompts` prompts, each sampled `n` times, give `num_seqs = num_prompts * n`
sequences, grouped: the n samples of prompt 0 first, then those of prompt 1, and so on.

How it works. The prompts are run once through the packed forward (no padding), which
also writes their keys/values into a cache laid out left-padded: prompt b occupies columns
[max_prompt_len - len_b, max_prompt_len) of a key buffer and a value buffer, each
[num_seqs, kv_heads, max_prompt_len + max_new_tokens, head_dim] per layer (repeated n
times after prefill). Every decode step then writes one column shared by all rows, so the
cache write is a plain slice assignment, and attention reads the columns [0, current]
under a fixed padding mask. Rotary positions stay per row (len_b + step), so left padding
never changes the math.

Log-probabilities. `packed_logprobs` holds, for each sampled response token, its log-prob
under the model's *unmodified* next-token distribution: log_softmax of the raw logits at
temperature 1, with no top-k/top-p and no min_new_tokens masking. That is exactly what a
training forward computes for the same tokens, so the PPO ratio pi/pi_old starts at 1.
The log-probs of the distribution actually sampled from (temperature, top-k, top-p, EOS
masking applied) are returned as `packed_sampling_logprobs` when asked for.

Speed. At small model sizes a decode step is bound by per-op overhead and by streaming the
weights from memory, not by arithmetic, so a decode step issues few ops: fused qkv and
gate/up projections, one rotary call for queries and keys together, cos/sin precomputed for
every step, activations kept features-first on CPU (see below), one exp over the vocabulary
per step shared by the log-probs and the sampler, inverse-CDF sampling (one uniform per row;
two-level for large vocabularies), and a host sync ("all done?") only every `check_done_every`
steps. Finished rows keep decoding (their tokens are ignored): cheaper than compacting the
batch at these sizes. Small decode steps run on one CPU thread
(`SINGLE_THREAD_DECODE_MAX_WORK`): their matmuls are too small to split.

Features-first decoding on CPU. A decode step multiplies a few rows by every weight, and
streaming the weights through the cache is most of its matmul time. On CPU (tensor-parallel
size 1) the step keeps its activations as [features, rows] and multiplies the weights in their
stored [out, in] layout from the left, `weight @ hidden`, which MKL streams faster than either
`hidden @ weight.T` or `hidden @ (a transposed copy of weight)`. Measured on one thread over
the 20 weights of the benchmark model (5 layers, hidden 256): 16 rows 3.0 -> 2.3 ms per step,
32 rows 5.4 -> 4.4 ms; a whole compiled generate call of 16 rows x 32 tokens 0.20 -> 0.16 s.
It also needs no transposed copy of the weights, which cost ~11 ms per call. GPUs and
tensor-parallel shards run the blocks as they are (`Block.forward`).

Compiled decoding (`GenerationConfig.compile`). A decode step attends over the cache's
columns up to the one it writes. That count is marked dynamic, so `torch.compile` builds one
graph that serves every step of the first batch shape it sees (the cache is padded to a
multiple of `COMPILED_COLUMN_MULTIPLE` columns so that nearby prompt lengths share it).
Attending over every cache column under a mask would keep all shapes static, but a compiled
generate of 16 rows is then 7% slower at 32 new tokens and 17-22% slower at 128 (one thread,
the benchmark's model, alternating in one process). The first call with another batch shape
(a data-parallel split that gives this worker more or fewer prompts) compiles once more with
dynamic shapes, which then serves every shape; measured on 2 cores: 5.7 s, then 12.9 s once,
then never again over five other row counts. Fusing the element-wise ops makes small-model
decoding 20-25% faster on CPU (`benchmarks/bench_generation.py`).
The choice of the next tokens runs in the same graph (`_decode_and_choose`): `generate` draws
every step's uniforms from the torch.Generator before the loop, so a step has no random state
and no eager sampling ops around it (a compiled generate of 16 rows x 32 tokens 0.161 ->
0.151 s on one thread); eager decoding uses the same draws, so both give the same tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F

from realrl.models.attention import PackedLayout, varlen_attention
from realrl.models.compiled import explain_compile_failure
from realrl.models.cuda_graphs import decode_static
from realrl.models.layers import split_rotated_qkv
from realrl.models.sampling import (
    GenerationConfig,
    GenerationOutput,
    SamplingRule,
    choose_tokens,
    pack_outputs,
)
from realrl.models.transformer import Block, Transformer

__all__ = ["GenerationConfig", "GenerationOutput", "generate"]


@dataclasses.dataclass
class _Cache:
    keys: list[torch.Tensor]  # per layer [num_rows, kv_heads, num_columns, head_dim]
    values: list[torch.Tensor]  # per layer [num_rows, kv_heads, num_columns, head_dim]
    score_bias: torch.Tensor  # [num_rows, 1, 1, num_columns]: 0 where a column holds a token
    column_index: torch.Tensor  # [num_columns]: 0, 1, ...

    def repeat_rows(self, n: int) -> _Cache:
        def repeat(tensors):
            return [t.repeat_interleave(n, dim=0) for t in tensors]

        return _Cache(
            repeat(self.keys),
            repeat(self.values),
            self.score_bias.repeat_interleave(n, dim=0),
            self.column_index,
        )


def _prefill(model: Transformer, packed_prompts, layout: PackedLayout, cache: _Cache, pad_offsets):
    """Runs the prompts, fills the cache, returns last-token logits [num_prompts, vocab]."""
    layout.ensure_token_indices()
    rows, columns = (
        layout.sequence_index,
        pad_offsets[layout.sequence_index] + layout.index_in_sequence,
    )

    def attend(layer_index, query, key, value):
        cache.keys[layer_index][rows, :, columns] = key
        cache.values[layer_index][rows, :, columns] = value
        return varlen_attention(
            query, key, value, layout, model.config.sliding_window, model.attention_kernel
        )

    hidden = model.hidden_states(packed_prompts, layout.index_in_sequence, attend)
    last_hidden = hidden[layout.cu_seqlens[1:].long() - 1]  # [num_prompts, hidden]
    return model.head(last_hidden).float()


def _decode_step(
    model: Transformer,
    tokens: torch.Tensor,  # [rows]
    cos: torch.Tensor,  # [rows, 1, head_dim]
    sin: torch.Tensor,
    column: torch.Tensor,  # 0-d long: the cache column this step writes
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    score_bias: torch.Tensor,  # [rows, 1, 1, column + 1]: the cache's bias up to `column`
    column_index: torch.Tensor,  # [column + 1]
) -> torch.Tensor:
    """One token per row at cache column `column` -> logits [rows, vocab] (fp32).

    Attends over the cache's columns [0, column] (`score_bias` and `column_index` come sliced
    to them) under a mask: padding and, for Mistral, columns outside the sliding window are
    -inf. A row's keys and query shift by the same left padding, so the window is the same
    column range for every row.
    """
    seen = column_index.shape[0]
    bias = score_bias  # [rows, 1, 1, seen]
    window = model.config.sliding_window
    if window is not None:
        bias = torch.where(column_index > column - window, bias, float("-inf"))
    head_dim = model.config.head_dim
    # At one query per row, four small ops beat SDPA's CPU kernel (fp32 and bf16); GPUs keep SDPA.
    manual_attention = tokens.device.type == "cpu"
    where = column.view(1)

    def attend(layer_index, query, key, value):
        # query [rows, heads, dim]; key, value [rows, kv_heads, dim]
        layer_keys, layer_values = keys[layer_index], values[layer_index]
        layer_keys.index_copy_(2, where, key.unsqueeze(2))
        layer_values.index_copy_(2, where, value.unsqueeze(2))
        # The query heads sharing a kv head act as that head's queries: no kv repetition.
        layer_keys, layer_values = layer_keys[:, :, :seen], layer_values[:, :, :seen]
        grouped_query = query.unflatten(1, (layer_keys.shape[1], -1)) * head_dim**-0.5
        if not manual_attention:
            out = F.scaled_dot_product_attention(
                grouped_query, layer_keys, layer_values, attn_mask=bias, scale=1.0
            )
            return out.flatten(1, 2)
        scores = torch.matmul(grouped_query, layer_keys.transpose(-1, -2))  # [rows, kv, g, cols]
        scores.add_(bias)
        return torch.matmul(scores.softmax(-1), layer_values).flatten(1, 2)

    if model.device.type != "cpu" or model.tp_size != 1:
        hidden = model.embedding(tokens)
        hidden, cos, sin, attend = model.scatter_sequence(hidden, cos, sin, attend)
        for layer in model.layers:
            hidden = layer(hidden, cos, sin, attend)
        hidden = model.gather_sequence(model.final_norm(hidden), tokens.shape[0])
        return model.head(hidden).float()
    hidden = F.embedding(tokens, model.embedding.weight).t()  # [hidden, rows]
    for layer in model.layers:
        hidden = _features_first_block(layer, hidden, cos, sin, attend)
    final_norm = model.final_norm
    normed = _features_first_rms_norm(hidden, final_norm.weight, final_norm.eps)
    head = model.embedding if model.lm_head is None else model.lm_head
    return torch.mm(head.weight, normed).t().float().contiguous()  # [rows, vocab]


def _features_first_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float):
    """`rms_norm` of hidden [features, rows] over its features."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(0, keepdim=True) + eps)
    return weight[:, None] * normed.to(hidden.dtype)


def _features_first_block(
    block: Block,
    hidden: torch.Tensor,  # [hidden, rows]
    cos: torch.Tensor,  # [rows, 1, head_dim]
    sin: torch.Tensor,
    attend,
) -> torch.Tensor:
    """`Block.forward` on features-first activations -> [hidden, rows] (CPU decode only)."""
    attention, mlp = block.attention, block.mlp
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    normed = _features_first_rms_norm(hidden, block.attention_norm.weight, block.attention_norm.eps)
    qkv = _features_first_linear(attention.qkv, attention.qkv_lora, normed)
    if attention.qkv.bias is not None:  # [(heads + 2 * kv_heads) * head_dim, rows]
        qkv = qkv + attention.qkv.bias[:, None]
    query, key, value = split_rotated_qkv(qkv.t(), heads, kv_heads, cos, sin,
                                          attention.qk_norm())
    attended = attend(block.layer_index, query, key, value)  # [rows, heads, head_dim]
    hidden = hidden + _features_first_linear(
        attention.output, attention.output_lora, attended.flatten(1).t())
    normed = _features_first_rms_norm(hidden, block.mlp_norm.weight, block.mlp_norm.eps)
    gate_up = _features_first_linear(mlp.gate_up, mlp.gate_up_lora, normed)
    gate, up = gate_up.split(mlp.local_intermediate, 0)
    return hidden + _features_first_linear(mlp.down, mlp.down_lora, F.silu(gate) * up)


def _features_first_linear(layer, adapter, hidden: torch.Tensor) -> torch.Tensor:
    """A bias-free projection of features-first hidden [in, rows] -> [out, rows], with its
    LoRA adapter's delta when it has one (`realrl.models.lora`)."""
    output = torch.mm(layer.weight, hidden)
    if adapter is not None:
        output = output + adapter.features_first(hidden)
    return output


# Compiled decode steps pad the cache to a multiple of this many columns, so that prompts of
# similar lengths share one compiled graph.
COMPILED_COLUMN_MULTIPLE = 64


def _allocate_cache(model: Transformer, prompt_lens: torch.Tensor, num_columns: int) -> _Cache:
    """An empty cache whose prompts are left-padded to end at column `max(prompt_lens)`."""
    config = model.config
    num_kv_heads = model.layers[0].attention.num_kv_heads
    shape = (prompt_lens.shape[0], num_kv_heads, num_columns, config.head_dim)

    def buffers():
        return [
            torch.zeros(shape, dtype=model.dtype, device=model.device)
            for _ in range(config.num_hidden_layers)
        ]

    column_index = torch.arange(num_columns, device=model.device)
    max_prompt_len = prompt_lens.max()
    is_padding = column_index[None, :] < (max_prompt_len - prompt_lens)[:, None]  # [rows, columns]
    score_bias = torch.zeros(is_padding.shape, dtype=model.dtype, device=model.device)
    score_bias.masked_fill_(is_padding, float("-inf"))
    return _Cache(buffers(), buffers(), score_bias[:, None, None, :], column_index)


@dataclasses.dataclass
class _Record:
    """What every decode step writes: tokens, log-probs and stopping state per row."""

    tokens: torch.Tensor  # [num_seqs, max_new_tokens]
    logprobs: torch.Tensor  # [num_seqs, max_new_tokens] under the unmodified distribution
    sampling_logprobs: torch.Tensor | None  # [num_seqs, max_new_tokens]
    finished: torch.Tensor  # [num_seqs] bool: sampled EOS/stop
    response_lens: torch.Tensor  # [num_seqs]
    steps_done: int = 0

    @classmethod
    def allocate(cls, num_seqs: int, max_new: int, with_sampling: bool, device) -> _Record:
        logprobs = torch.zeros(num_seqs, max_new, dtype=torch.float32, device=device)
        return cls(
            tokens=torch.zeros(num_seqs, max_new, dtype=torch.long, device=device),
            logprobs=logprobs,
            sampling_logprobs=torch.zeros_like(logprobs) if with_sampling else None,
            finished=torch.zeros(num_seqs, dtype=torch.bool, device=device),
            response_lens=torch.zeros(num_seqs, dtype=torch.long, device=device),
        )

    def add(self, tokens, logprobs, sampling_logprobs, stop_ids: torch.Tensor) -> torch.Tensor:
        """Records this step's tokens [num_seqs] and log-probs; returns the tokens."""
        step = self.steps_done
        self.tokens[:, step] = tokens
        self.logprobs[:, step] = logprobs
        if self.sampling_logprobs is not None:
            self.sampling_logprobs[:, step] = sampling_logprobs
        self.response_lens += ~self.finished
        if stop_ids.numel() > 0:
            self.finished |= torch.isin(tokens, stop_ids)
        self.steps_done = step + 1
        return tokens

    def all_finished(self, check_every: int, has_stop_ids: bool) -> bool:
        """The only host sync of the loop, done every `check_every` steps."""
        if not has_stop_ids or self.steps_done % check_every != 0:
            return False
        return bool(self.finished.all())


def _prefill_and_expand(
    model: Transformer, packed_prompts, layout: PackedLayout, n: int, num_columns: int
):
    """Prefill the distinct prompts once, then repeat cache and logits n times per prompt."""
    prompt_lens = torch.tensor(layout.seq_lens, device=model.device)  # [num_prompts]
    prompt_cache = _allocate_cache(model, prompt_lens, num_columns)
    pad_offsets = layout.max_seqlen - prompt_lens
    logits = _prefill(model, packed_prompts, layout, prompt_cache, pad_offsets)
    return prompt_cache.repeat_rows(n), logits.repeat_interleave(n, dim=0), prompt_lens


def _decode_and_choose(
    model: Transformer,
    rule: SamplingRule,
    with_sampling_logprobs: bool,
    tokens: torch.Tensor,  # [rows]
    cos: torch.Tensor,  # [rows, 1, head_dim]
    sin: torch.Tensor,
    column: torch.Tensor,  # 0-d long
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    score_bias: torch.Tensor,  # [rows, 1, 1, column + 1]
    column_index: torch.Tensor,  # [column + 1]
    stop_mask: torch.Tensor,  # [vocab] bool: the stop tokens
    mask_stop: torch.Tensor,  # 0-d bool: stop tokens are masked out of sampling at this step
    draws: torch.Tensor,  # [rows, 1] uniforms
):
    """One decode step and the choice of the next tokens -> (tokens, log-probs, sampling
    log-probs or None), in one graph when compiled."""
    logits = _decode_step(model, tokens, cos, sin, column, keys, values, score_bias, column_index)
    return choose_tokens(logits, rule, stop_mask & mask_stop, draws, with_sampling_logprobs)


def _decode_function(model: Transformer, compile_step: bool):
    """The decode step with token choice; compiled per model when asked (see "Compiled
    decoding" above)."""
    if not compile_step:
        return functools.partial(_decode_and_choose, model)
    compiled = getattr(model, "compiled_decode_step", None)
    if compiled is None:
        # On CPU the compiled code's wrapper, which calls its ~100 kernels and matmuls per
        # step, is C++ rather than Python: a generate call 5-6% faster, ~3 s more to compile.
        options = {"cpp_wrapper": True} if model.device.type == "cpu" else None
        step = torch.compile(
            functools.partial(_decode_and_choose, model),
            fullgraph=True,
            dynamic=None,
            options=options,
        )

        def compiled(*args):
            with explain_compile_failure("gen.compile", "the decode step"):
                return step(*args)

        model.compiled_decode_step = compiled
    return compiled


# Decode steps whose largest matmul (rows x hidden x intermediate) is below this run on one CPU
# thread. Measured on 2 cores: a 32 x 256 x 768 matmul takes 151 us on one thread and 440 us of
# CPU (510 us wall) on two, which spend more waking each other than multiplying; the
# benchmark's decode costs 0.33 CPU s on one thread and 0.57 on two.
SINGLE_THREAD_DECODE_MAX_WORK = 2**24


@contextlib.contextmanager
def _decode_threads(model: Transformer, num_rows: int):
    """Run small CPU decode steps on one thread, restoring the thread count afterwards."""
    work = num_rows * model.config.hidden_size * model.config.intermediate_size
    threads = torch.get_num_threads()
    if model.device.type != "cpu" or threads == 1 or work >= SINGLE_THREAD_DECODE_MAX_WORK:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def uses_cuda_graphs(model: Transformer, config: GenerationConfig) -> bool:
    """Whether `generate` replays captured decode steps (`realrl.models.cuda_graphs`): on CUDA
    at tensor-parallel size 1 unless `config.cuda_graphs` is off."""
    return config.cuda_graphs and model.device.type == "cuda" and model.tp_size == 1


@torch.no_grad()
def generate(
    model: Transformer,
    packed_prompts: torch.Tensor,  # [total_prompt_tokens]
    prompt_cu_seqlens: torch.Tensor,  # [num_prompts + 1]
    config: GenerationConfig,
    generator: torch.Generator,
) -> GenerationOutput:
    """Sample `config.n` responses per prompt; see the module docstring for conventions.

    `generator` must live on the model's device; the same seed gives the same output.
    Costs two host syncs (reading the prompt lengths and, at the end, the response
    lengths) plus one "all finished?" check every `config.check_done_every` steps.
    """
    static_steps = uses_cuda_graphs(model, config)
    return _generate(model, packed_prompts, prompt_cu_seqlens, config, generator, static_steps)


@torch.no_grad()
def _generate(
    model: Transformer,
    packed_prompts: torch.Tensor,  # [total_prompt_tokens]
    prompt_cu_seqlens: torch.Tensor,  # [num_prompts + 1]
    config: GenerationConfig,
    generator: torch.Generator,
    static_steps: bool,
) -> GenerationOutput:
    """`generate`; with `static_steps` the decode steps of `realrl.models.cuda_graphs`
    (captured as CUDA graphs on CUDA, run as they are elsewhere: the tests' CPU twin)."""
    state = start_decoding(model, packed_prompts, prompt_cu_seqlens, config, generator,
                           static_steps)
    if not static_steps:
        decode_steps(model, config, state, config.max_new_tokens)
    return finish_decoding(state)


@dataclasses.dataclass
class DecodingState:
    """A generate call between two decode steps: what `decode_steps` continues from.

    `realrl.models.interruptible_generation` keeps one across requests, so that new weights can
    be swapped in between two chunks of steps (`next_step` is the step that runs next, 1-based:
    step 0 is the prefill's choice; the token it feeds, `tokens`, is chosen and recorded but not
    yet in the cache).
    """

    packed_prompts: torch.Tensor  # [total_prompt_tokens]
    prompt_lens: torch.Tensor  # [num_prompts]
    n: int
    cache: _Cache | None  # None once the static path's steps have run
    record: _Record
    decoding: _DynamicDecoding | None  # None on the static path
    masks: tuple[torch.Tensor, torch.Tensor]  # stop_mask [vocab], mask_stop [max_new]
    tokens: torch.Tensor  # [num_seqs]: the last chosen tokens
    next_step: int = 1
    done: bool = False


def start_decoding(
    model: Transformer,
    packed_prompts: torch.Tensor,  # [total_prompt_tokens]
    prompt_cu_seqlens: torch.Tensor,  # [num_prompts + 1]
    config: GenerationConfig,
    generator: torch.Generator,
    static_steps: bool = False,
) -> DecodingState:
    """Prefill and choose the first tokens; with `static_steps` also run every decode step
    (`realrl.models.cuda_graphs`), else leave them to `decode_steps`."""
    if model.config.is_critic:
        raise ValueError("generate() needs a language model, but this model is a critic")
    config.validate()
    device, max_new = model.device, config.max_new_tokens
    packed_prompts = packed_prompts.to(device)
    layout = PackedLayout.from_cu_seqlens(prompt_cu_seqlens.to(device))
    model.rotary.ensure_capacity(layout.max_seqlen + max_new, device)
    num_columns = layout.max_seqlen + max_new
    if static_steps:  # the prefill's cache holds the prompts; the static state the rest
        num_columns = layout.max_seqlen
    elif config.compile:
        num_columns = -(-num_columns // COMPILED_COLUMN_MULTIPLE) * COMPILED_COLUMN_MULTIPLE
    cache, logits, prompt_lens = _prefill_and_expand(
        model, packed_prompts, layout, config.n, num_columns
    )
    row_prompt_lens = prompt_lens.repeat_interleave(config.n)  # [num_seqs]
    stop_ids = config.resolved_stop_ids(model.config.eos_token_ids)
    stop_tensor = torch.tensor(stop_ids, dtype=torch.long, device=device)
    # Sampling happens inside the (compiled) step: its uniforms are drawn here, one per row and
    # step, and min_new_tokens becomes a per-step flag over a fixed stop-token mask.
    rule, with_sampling = SamplingRule.of(config), config.return_sampling_logprobs
    draws = torch.rand(max_new, len(row_prompt_lens), 1, generator=generator, device=device)
    stop_mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
    stop_mask[stop_tensor] = True
    mask_stop = torch.arange(max_new, device=device) < config.min_new_tokens  # [max_new]
    first = choose_tokens(logits, rule, stop_mask & mask_stop[0], draws[0], with_sampling)
    if static_steps:
        tables = (stop_mask, mask_stop, draws)
        decoded = decode_static(model, config, cache, first, row_prompt_lens, tables)
        record = _Record(*decoded)
        return DecodingState(packed_prompts, prompt_lens, config.n, None, record, None,
                             (stop_mask, mask_stop), first[0], record.steps_done, done=True)
    record = _Record.allocate(len(row_prompt_lens), max_new, with_sampling, device)
    record.add(*first, stop_tensor)
    decoding = _DynamicDecoding(layout.max_seqlen, row_prompt_lens, stop_tensor, draws)
    return DecodingState(packed_prompts, prompt_lens, config.n, cache, record, decoding,
                         (stop_mask, mask_stop), first[0])


def finish_decoding(state: DecodingState) -> GenerationOutput:
    """Cut and pack the recorded tokens (`pack_outputs`)."""
    record, steps = state.record, state.record.steps_done
    return pack_outputs(
        state.packed_prompts,
        state.prompt_lens,
        state.n,
        record.tokens[:, :steps],
        record.logprobs[:, :steps],
        None if record.sampling_logprobs is None else record.sampling_logprobs[:, :steps],
        record.response_lens,
        record.finished,
    )


@dataclasses.dataclass
class _DynamicDecoding:
    prompt_columns: int  # the longest prompt: the first decode step writes this column
    row_prompt_lens: torch.Tensor  # [num_seqs]
    stop_ids: torch.Tensor  # [num_stop_ids] long
    draws: torch.Tensor  # [max_new, num_seqs, 1] uniforms


def decode_steps(model, config, state: DecodingState, stop_step: int) -> bool:
    """Run the decode steps from `state.next_step` up to (not including) `stop_step`, or until
    every row has finished; returns whether the generation is done. The steps attend over one
    more column each (CPU, tensor parallelism, CUDA with `cuda_graphs` off), eager or compiled
    (`config.compile`); running them in several calls gives the tokens of one call."""
    device, max_new = model.device, config.max_new_tokens
    decoding, cache, record = state.decoding, state.cache, state.record
    prompt_columns = decoding.prompt_columns
    stop_mask, mask_stop = state.masks
    # cos/sin for every decode step up front: step s feeds its token at position len_b + s.
    step_offsets = torch.arange(max_new, device=device)[:, None]
    step_positions = decoding.row_prompt_lens[None, :] + step_offsets  # [max_new, rows]
    all_cos, all_sin = model.rotary.lookup(step_positions, model.dtype)  # [max_new, rows, 1, dim]
    # The cache column of every decode step, made once: no host-to-device copy per step.
    columns = torch.arange(prompt_columns, prompt_columns + max_new, device=device)
    rule, with_sampling = SamplingRule.of(config), config.return_sampling_logprobs
    has_stop_ids = decoding.stop_ids.numel() > 0
    tokens = state.tokens
    decode = _decode_function(model, config.compile)
    with _decode_threads(model, len(decoding.row_prompt_lens)):
        for step in range(state.next_step, min(stop_step, max_new)):
            if record.all_finished(config.check_done_every, has_stop_ids):
                state.done = True
                break
            seen = prompt_columns + step  # the columns up to the one this step writes
            score_bias, column_index = cache.score_bias[..., :seen], cache.column_index[:seen]
            if config.compile:  # compile one graph for every step, not one per column count
                torch._dynamo.mark_dynamic(score_bias, 3)
                torch._dynamo.mark_dynamic(column_index, 0)
            chosen = decode(
                rule,
                with_sampling,
                tokens,
                all_cos[step - 1],
                all_sin[step - 1],
                columns[step - 1],
                cache.keys,
                cache.values,
                score_bias,
                column_index,
                stop_mask,
                mask_stop[step],
                decoding.draws[step],
            )
            tokens = record.add(*chosen, decoding.stop_ids)
            state.next_step = step + 1
    state.tokens = tokens
    state.done = state.done or state.next_step >= max_new
    return state.done
