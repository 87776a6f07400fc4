"""Static-shape decode steps, captured once as CUDA graphs and replayed: `generate` on CUDA.

Why. An eager decode step of a 24-layer model launches ~700 kernels. On an H100 the
Qwen2.5-0.5B-shaped benchmark model spent 2.3 s of CPU and 0.3 s of GPU time on 128 steps at
64 rows (`benchmarks/results/gpu_generation_h100.txt`): the GPU waits for the launches. A
captured graph launches the whole step, token choice and bookkeeping included, in one
`replay()`, so a decode step costs its GPU time.

What is static. A graph replays fixed kernels on fixed addresses, so every tensor a step reads
or writes lives in a `StaticDecodeState` allocated once per batch-size bucket (`row_bucket`:
powers of two up to 64 rows, then multiples of 64; the extra rows decode padding that nobody
reads) and sized to a cache-length bucket (`CACHE_COLUMN_MULTIPLE` columns):

- the key/value cache, [rows, kv_heads, columns, head_dim] per layer, laid out left-padded as
  in `realrl.models.generation`; the prompts' keys/values are copied in after the prefill;
- the step's own state as device tensors: the tokens it feeds, their rotary positions, and the
  cache column it writes (a 0-d tensor the step itself advances, so nothing is copied in
  between replays);
- tables indexed by that column: the uniforms drawn before the loop, the per-step "stop tokens
  masked" flag of `min_new_tokens`, and the record of tokens and log-probs.

Per-sequence stopping masks instead of reshaping: a finished row keeps decoding (its tokens are
past its `response_lens` and never read), so the batch shape and the graphs never change.

Attention reads a prefix of the cache: the first `attended_columns(column)` columns, a multiple
of `ATTENDED_COLUMN_BLOCK` and never the whole cache (`state_columns`), under a mask (prompt
padding, columns after the one written, the sliding window). One graph per such prefix
(captured at the start of the first call that needs it, all sharing the state's buffers) keeps
the attention's reads within 32 columns of what the step needs; attending over the whole cache
would read ~2x the keys/values a decode of 128 new tokens needs on average.

Why `torch.cuda.CUDAGraph` around our own step, not `torch.compile(mode="reduce-overhead")`.
reduce-overhead's cudagraph trees copy every input that is not a parameter or a static-marked
buffer into their own placeholders at each replay (the KV cache included, unless each layer's
buffers are marked), re-record when a step changes a shape (every attended-prefix change) and
hold the outputs of one replay only until the next. Capturing our own step makes the addresses
explicit: the state is ours, the step writes its results into it, and nothing is copied per
replay. With `gen.compile=true` the step is first compiled by inductor (fusing its element-wise
ops) and the compiled code is what gets captured.

Weights. Graphs capture the weights' addresses. A train step that updates parameters in place
(`optimizer.step()`, `param.data.copy_`) is seen by the next replay; a parameter that is
reallocated (`model.to(...)`, a new tensor assigned to `.data`) changes the fingerprint of
addresses taken at every `generate` call, and every graph is dropped and captured again.
`release_decode_graphs(model)` frees the graphs and their states (the KV caches) for memory
that training needs; the next `generate` allocates and captures again.

Numerics. The step is `Block.forward`'s math with two differences: RMSNorm in one kernel
(`_norm`, bit-equal on CPU) and attention as four small ops over a masked prefix. In fp32 it
gives the launched path's tokens and log-probs within 1e-5 (tests on CPU, and against
transformers' greedy output on CUDA); in bf16 the rounding order differs, so greedy tokens agree
up to a near-tie (0.05 nats apart in fp32) and log-probs stay within 0.1 nats of a forward.

Speed on an H100 (`benchmarks/bench_gpu_generation.py`, 0.5B-shaped model, bf16, ms per step at
64 / 512 rows): captured 2.62 / 5.34, captured and compiled 1.84 / -, eager 17.3 / 20.1,
transformers 36.3 / 34.2, floor 0.38 / 0.68.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from realrl.models.compiled import explain_compile_failure
from realrl.models.sampling import SamplingRule, choose_tokens
from realrl.models.transformer import Block, Transformer

# A state's cache has a multiple of this many columns: calls whose prompts + new tokens fit in
# the same multiple reuse the state and its graphs.
CACHE_COLUMN_MULTIPLE = 128
# Attention reads the cache's columns up to a multiple of this many (see the module docstring).
ATTENDED_COLUMN_BLOCK = 32
# At most this many batch-size buckets keep a state (KV cache) and graphs; the least recently
# used one is freed first.
MAX_ROW_BUCKETS = 2
# Eager runs of a step before its capture (cuBLAS workspaces, inductor's first call).
WARMUP_STEPS = 2


def row_bucket(num_seqs: int) -> int:
    """Rows of the state that decodes `num_seqs` sequences: 1, 2, 4, ..., 64, 128, 192, ..."""
    if num_seqs <= 64:
        return 1 << max(num_seqs - 1, 0).bit_length()
    return -(-num_seqs // 64) * 64


def attended_columns(column: int) -> int:
    """How many cache columns a step that writes `column` attends over."""
    return -(-(column + 1) // ATTENDED_COLUMN_BLOCK) * ATTENDED_COLUMN_BLOCK


def state_columns(needed: int) -> int:
    """The fewest cache columns of a state for calls that write columns < `needed`: one block
    more than any step attends over, so that a step never attends over the whole cache (a
    compiled step would specialise on that case and compile again)."""
    return attended_columns(needed - 1) + ATTENDED_COLUMN_BLOCK


@dataclasses.dataclass
class StaticDecodeState:
    """Every tensor a decode step reads or writes, at fixed addresses. [rows]: a batch bucket;
    [columns]: the cache's columns. Response token j of a row is recorded at column
    `prompt_columns + j`, where `prompt_columns` is the longest prompt."""

    tokens: torch.Tensor  # [rows] long: the tokens the next step feeds
    positions: torch.Tensor  # [rows] long: their rotary positions
    column: torch.Tensor  # 0-d long: the cache column the next step writes
    cos_table: torch.Tensor  # [columns, head_dim] model dtype: positions < columns
    sin_table: torch.Tensor
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, columns, head_dim]
    values: list[torch.Tensor]
    score_bias: torch.Tensor  # [rows, 1, 1, columns]: -inf on prompt padding
    column_index: torch.Tensor  # [columns]: 0, 1, ...
    stop_mask: torch.Tensor  # [vocab] bool: the stop tokens
    mask_stop: torch.Tensor  # [columns] bool: stop tokens masked when choosing that column's token
    draws: torch.Tensor  # [columns, rows, 1]: the uniforms that choose that column's token
    record_tokens: torch.Tensor  # [rows, columns] long
    record_logprobs: torch.Tensor  # [rows, columns] fp32, raw distribution
    record_sampling_logprobs: torch.Tensor  # [rows, columns] fp32, sampled distribution
    finished: torch.Tensor  # [rows] bool: sampled a stop token
    response_lens: torch.Tensor  # [rows] long

    @classmethod
    def allocate(cls, model: Transformer, rows: int, columns: int) -> StaticDecodeState:
        config, device, dtype = model.config, model.device, model.dtype
        num_kv_heads = model.layers[0].attention.num_kv_heads
        cache_shape = (rows, num_kv_heads, columns, config.head_dim)

        def zeros(shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            tokens=zeros(rows, torch.long),
            positions=zeros(rows, torch.long),
            column=zeros((), torch.long),
            cos_table=zeros((columns, config.head_dim), dtype),
            sin_table=zeros((columns, config.head_dim), dtype),
            keys=[zeros(cache_shape, dtype) for _ in range(config.num_hidden_layers)],
            values=[zeros(cache_shape, dtype) for _ in range(config.num_hidden_layers)],
            score_bias=zeros((rows, 1, 1, columns), dtype),
            column_index=torch.arange(columns, device=device),
            stop_mask=zeros(config.vocab_size, torch.bool),
            mask_stop=zeros(columns, torch.bool),
            draws=zeros((columns, rows, 1)),
            record_tokens=zeros((rows, columns), torch.long),
            record_logprobs=zeros((rows, columns)),
            record_sampling_logprobs=zeros((rows, columns)),
            finished=zeros(rows, torch.bool),
            response_lens=zeros(rows, torch.long),
        )

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_columns(self) -> int:
        return self.column_index.shape[0]

    def reset_for_capture(self) -> None:
        """In-range indices for the warm-up runs before a capture (their writes are garbage
        that `fill` overwrites)."""
        self.column.zero_()
        self.positions.zero_()
        self.tokens.zero_()

    def fill(self, model: Transformer, prompt_cache, first: tuple, row_prompt_lens, tables):
        """Loads one call: the prompts' cache [num_seqs, kv_heads, prompt_columns, head_dim]
        per layer with its score bias, the first response tokens and log-probs (chosen from
        the prefill's logits), the rows' prompt lengths [num_seqs], and `tables`: the stop
        mask [vocab], the per-token "mask stop tokens" flags [max_new] and the uniforms
        [max_new, num_seqs, 1]."""
        num_seqs, prompt_columns = prompt_cache.keys[0].shape[0], prompt_cache.keys[0].shape[2]
        for static, prompt in zip(self.keys + self.values, prompt_cache.keys + prompt_cache.values):
            static[:num_seqs, :, :prompt_columns].copy_(prompt)
        self.score_bias.zero_()
        self.score_bias[:num_seqs, ..., :prompt_columns].copy_(prompt_cache.score_bias)
        model.rotary.ensure_capacity(self.num_columns, model.device)
        self.cos_table.copy_(model.rotary.cos_table[: self.num_columns])
        self.sin_table.copy_(model.rotary.sin_table[: self.num_columns])
        stop_mask, mask_stop, draws = tables
        self.stop_mask.copy_(stop_mask)
        steps = range(prompt_columns, prompt_columns + len(mask_stop))
        self.mask_stop.zero_()
        self.mask_stop[steps.start : steps.stop] = mask_stop
        self.draws.fill_(0.5)
        self.draws[steps.start : steps.stop, :num_seqs] = draws
        tokens, logprobs, sampling_logprobs = first
        for buffer, value in ((self.tokens, tokens), (self.positions, row_prompt_lens)):
            buffer.zero_()
            buffer[:num_seqs] = value
        self.column.fill_(prompt_columns)
        self.record_tokens[:num_seqs, prompt_columns] = tokens
        self.record_logprobs[:num_seqs, prompt_columns] = logprobs
        if sampling_logprobs is not None:
            self.record_sampling_logprobs[:num_seqs, prompt_columns] = sampling_logprobs
        self.finished.fill_(True)  # padding rows count as finished
        self.finished[:num_seqs] = self.stop_mask[tokens]
        self.response_lens.zero_()
        self.response_lens[:num_seqs] = 1


def _norm(hidden: torch.Tensor, norm) -> torch.Tensor:
    """`RMSNorm` in one kernel: `F.rms_norm` on bf16 input normalises in fp32 and rounds once,
    which is what `rms_norm`'s upcast, norm and downcast do in three (bit-equal on CPU); it
    saves the two dtype casts per norm that the eager decode profile shows (~100 per step)."""
    return norm.weight * F.rms_norm(hidden, norm.weight.shape, eps=norm.eps)


def _block(block: Block, hidden: torch.Tensor, cos, sin, attend) -> torch.Tensor:
    """`Block.forward` on hidden [rows, hidden] with `_norm`."""
    attention = block.attention
    query, key, value = attention.project(_norm(hidden, block.attention_norm), cos, sin)
    attended = attend(block.layer_index, query, key, value)  # [rows, heads, head_dim]
    hidden = hidden + attention.project_output(attended.flatten(-2))
    return hidden + block.mlp(_norm(hidden, block.mlp_norm))


def _step_logits(model: Transformer, attended: int, state: StaticDecodeState) -> torch.Tensor:
    """Feeds `state.tokens` at `state.column`, writing its keys/values there -> fp32 logits
    [rows, vocab]. Attends over the first `attended` columns with four small ops (scores,
    mask, softmax, weighted sum): one query per row, and every op capturable."""
    column = state.column
    bias = state.score_bias[..., :attended]  # [rows, 1, 1, attended]
    column_index = state.column_index[:attended]
    bias = torch.where(column_index <= column, bias, float("-inf"))
    window = model.config.sliding_window
    if window is not None:
        bias = torch.where(column_index > column - window, bias, float("-inf"))
    scale = model.config.head_dim**-0.5
    where = column.view(1)

    def attend(layer_index, query, key, value):
        # query [rows, heads, dim]; key, value [rows, kv_heads, dim]
        keys, values = state.keys[layer_index], state.values[layer_index]
        keys.index_copy_(2, where, key.unsqueeze(2))
        values.index_copy_(2, where, value.unsqueeze(2))
        keys, values = keys[:, :, :attended], values[:, :, :attended]
        # The query heads sharing a kv head act as that head's queries: no kv repetition.
        grouped_query = query.unflatten(1, (keys.shape[1], -1)) * scale
        scores = torch.matmul(grouped_query, keys.transpose(-1, -2))  # [rows, kv, g, attended]
        return torch.matmul((scores + bias).softmax(-1), values).flatten(1, 2)

    cos = state.cos_table[state.positions].unsqueeze(-2)  # [rows, 1, head_dim]
    sin = state.sin_table[state.positions].unsqueeze(-2)
    hidden = model.embedding(state.tokens)
    for layer in model.layers:
        hidden = _block(layer, hidden, cos, sin, attend)
    return model.head(_norm(hidden, model.final_norm)).float()


def decode_step(
    model: Transformer,
    rule: SamplingRule,
    with_sampling_logprobs: bool,
    attended: int,
    state: StaticDecodeState,
) -> None:
    """One decode step entirely in place on `state`: logits, token choice from the pre-drawn
    uniforms, the record, stopping, and the advance to the next column. No host syncs and no
    returned tensors, so it captures into a CUDA graph as it stands."""
    logits = _step_logits(model, attended, state)
    chosen_column = (state.column + 1).view(1)  # the column that records the chosen tokens
    masked = state.stop_mask & state.mask_stop.index_select(0, chosen_column)
    draws = state.draws.index_select(0, chosen_column).squeeze(0)  # [rows, 1]
    tokens, logprobs, sampling_logprobs = choose_tokens(
        logits, rule, masked, draws, with_sampling_logprobs
    )
    state.record_tokens.index_copy_(1, chosen_column, tokens[:, None])
    state.record_logprobs.index_copy_(1, chosen_column, logprobs[:, None])
    if sampling_logprobs is not None:
        state.record_sampling_logprobs.index_copy_(1, chosen_column, sampling_logprobs[:, None])
    state.response_lens.add_(~state.finished)
    state.finished.logical_or_(state.stop_mask[tokens])
    state.tokens.copy_(tokens)
    state.positions.add_(1)
    state.column.add_(1)


@dataclasses.dataclass
class _RowBucket:
    state: StaticDecodeState
    graphs: dict = dataclasses.field(default_factory=dict)  # (attended, rule, ...) -> graph


class DecodeGraphs:
    """The captured decode steps of one model (kept as `model.decode_graphs`): a state per
    batch-size bucket, and in it one graph per (attended columns, sampling rule, compiled)."""

    def __init__(self) -> None:
        self.buckets: collections.OrderedDict[int, _RowBucket] = collections.OrderedDict()
        self.weights_fingerprint: tuple[int, ...] | None = None
        self.captures = 0  # graphs captured so far (tests count recaptures)
        self.pool = torch.cuda.graph_pool_handle()  # replays never overlap: one memory pool

    def state_for(self, model: Transformer, num_seqs: int, num_columns: int) -> _RowBucket:
        """The bucket whose state fits `num_seqs` rows and `num_columns` columns; drops every
        graph when a parameter has been reallocated since the last call."""
        fingerprint = tuple(parameter.data_ptr() for parameter in model.parameters())
        if fingerprint != self.weights_fingerprint:
            self.buckets.clear()
            self.weights_fingerprint = fingerprint
        rows = row_bucket(num_seqs)
        bucket = self.buckets.pop(rows, None)
        if bucket is None or bucket.state.num_columns < state_columns(num_columns):
            bucket = None  # free the smaller cache before allocating its replacement
            while len(self.buckets) >= MAX_ROW_BUCKETS:
                self.buckets.popitem(last=False)
            columns = state_columns(num_columns)
            columns = -(-columns // CACHE_COLUMN_MULTIPLE) * CACHE_COLUMN_MULTIPLE
            bucket = _RowBucket(StaticDecodeState.allocate(model, rows, columns))
        self.buckets[rows] = bucket  # most recently used last
        return bucket

    def ensure_captured(self, bucket: _RowBucket, keys: list, step_for: Callable) -> None:
        """Captures the graphs `keys` names that `bucket` lacks; `step_for(key)` is the step to
        capture. Runs before the state is filled: warm-up runs write garbage into it."""
        state = bucket.state
        for key in keys:
            if key in bucket.graphs:
                continue
            step = step_for(key)
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                for _ in range(WARMUP_STEPS):
                    state.reset_for_capture()
                    step()
            torch.cuda.current_stream().wait_stream(side_stream)
            state.reset_for_capture()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step()
            bucket.graphs[key] = graph
            self.captures += 1


def decode_static(model: Transformer, config, prompt_cache, first, row_prompt_lens, tables):
    """The decode loop of `generate` with static steps: each step replays a captured graph on
    CUDA (or runs the same step uncaptured elsewhere). `prompt_cache` is generation's cache of
    the prompts (keys/values [num_seqs, kv_heads, prompt_columns, head_dim] per layer and their
    score bias); `first`, `row_prompt_lens` and `tables` as `StaticDecodeState.fill` takes them.

    Returns tokens, log-probs, sampling log-probs or None (each [num_seqs, steps], views of the
    state that the caller copies out before the next call), finished and response lengths
    ([num_seqs], copies) and the number of steps, in `generation._Record`'s field order."""
    num_seqs, max_new = len(row_prompt_lens), config.max_new_tokens
    prompt_columns = prompt_cache.keys[0].shape[2]
    rule, with_sampling = SamplingRule.of(config), config.return_sampling_logprobs
    capture = model.device.type == "cuda"
    step_for = functools.partial(_step_for, model, config.compile)
    last_columns = range(prompt_columns, prompt_columns + max_new - 1)  # the steps' columns
    if capture:
        graphs = getattr(model, "decode_graphs", None)
        if graphs is None:
            graphs = model.decode_graphs = DecodeGraphs()
        bucket = graphs.state_for(model, num_seqs, prompt_columns + max_new)
        state = bucket.state
        keys = sorted({attended_columns(column) for column in last_columns})
        keys = [(attended, rule, with_sampling, config.compile) for attended in keys]
        graphs.ensure_captured(bucket, keys, lambda key: step_for(key, state))
    else:
        columns = state_columns(prompt_columns + max_new)
        state = StaticDecodeState.allocate(model, row_bucket(num_seqs), columns)
    state.fill(model, prompt_cache, first, row_prompt_lens, tables)
    has_stop_ids, steps = bool(config.resolved_stop_ids(model.config.eos_token_ids)), 1
    for column in last_columns:
        if has_stop_ids and steps % config.check_done_every == 0:
            if bool(state.finished[:num_seqs].all()):  # the loop's only host sync
                break
        attended = attended_columns(column)
        if capture:
            bucket.graphs[(attended, rule, with_sampling, config.compile)].replay()
        else:
            step_for((attended, rule, with_sampling, config.compile), state)()
        steps += 1
    recorded = slice(prompt_columns, prompt_columns + steps)
    sampling_logprobs = state.record_sampling_logprobs[:num_seqs, recorded]
    return (
        state.record_tokens[:num_seqs, recorded],
        state.record_logprobs[:num_seqs, recorded],
        sampling_logprobs if with_sampling else None,
        state.finished[:num_seqs].clone(),
        state.response_lens[:num_seqs].clone(),
        steps,
    )


def _step_for(model: Transformer, compile_step: bool, key, state: StaticDecodeState):
    """A no-argument call of `decode_step` for graph key (attended columns,
    sampling rule, with sampling log-probs, compiled)."""
    attended, rule, with_sampling, _ = key
    step = decode_step
    if compile_step:
        step = getattr(model, "compiled_static_decode_step", None)
        if step is None:
            compiled = torch.compile(decode_step, fullgraph=True, dynamic=True)

            def step(*args):
                with explain_compile_failure("gen.compile", "the decode step"):
                    return compiled(*args)

            model.compiled_static_decode_step = step
    return functools.partial(step, model, rule, with_sampling, attended, state)


def release_decode_graphs(model: Transformer) -> None:
    """Frees the model's captured decode graphs and their states (KV caches)."""
    model.decode_graphs = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
