"""Causal attention over packed sequences: every token attends only within its own sequence.

Notation: `total_tokens` tokens of `num_seqs` sequences are concatenated; `cu_seqlens`
[num_seqs + 1] holds the start offset of each sequence and the total at the end.

Kernels (`benchmarks/bench_attention.py` measures them on CPU):
- `flash`: flash-attn's varlen kernel; used on CUDA in fp16/bf16 when flash-attn imports.
- `padded`: scatter the sequences into a [num_seqs, max_len] batch and run one causal SDPA.
  Fastest on CPU for many short sequences: one kernel call, and far fewer autograd nodes
  (64 sequences of 32-64 tokens: 4x faster than `per_sequence` forward+backward). When all
  sequences have the same length the packed tensors are viewed as the batch (no copies).
- `per_sequence`: one causal SDPA per sequence; fastest once sequences are a few hundred
  tokens long (1.4-1.7x faster than `padded` at 16 x 64-256 and 4 x 512 tokens) and when
  lengths are uneven, where `padded` wastes most of its work on padding (8x slower at
  1 x 1024 + 31 x 16 tokens).
- `bucketed`: `padded` on groups of sequences of similar length (`length_buckets`), each
  padded to its own longest; sequences longer than 64 tokens run alone. One outlier then
  neither pads every sequence to its length nor turns the batch into one kernel call per
  sequence: 127 x 9-16 tokens + 1 x 40, forward+backward 25.5 ms against 45.3 for `padded`
  and 146 for `per_sequence`, which `auto` picked there before `bucketed` existed.
  The default `ppo-math` run has such a batch whenever one response runs to the token limit.
- `block_diagonal`: one SDPA over all tokens with a block-diagonal causal mask; quadratic in
  total_tokens and slowest everywhere, kept as a reference for tests.
`auto` picks `padded` for sequences of at most 128 tokens whose padding at most doubles the
attention work; otherwise `bucketed`, or `per_sequence` where every bucket would hold one
sequence (numbers from bench_attention.py on 1 CPU thread).

On CPU, `padded` batches of at most `MATMUL_ATTENTION_MAX_SEQLEN` tokens skip SDPA for two
batched matmuls and a softmax, with the query heads of each key/value head stacked so that
grouped-query attention needs no repeated keys (`_grouped_matmul_attention`). Forward+backward
on 1 thread, 4 query / 2 key-value heads of 64: 32 x 40 tokens 5.3 ms vs SDPA's 10.6 ms,
16 x 64 5.0 vs 6.7 ms, 8 x 128 the same (8.3 vs 8.2 ms), 4 x 256 slower (15.7 vs 12.3 ms).
In the benchmark model's forward+backward (5 layers, 32 x 40 tokens, 1 thread) that is
0.438-0.445 s -> 0.426-0.432 s.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

try:  # pragma: no cover - only on GPU machines with flash-attn installed
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover
    flash_attn_varlen_func = None

ATTENTION_KERNELS = ("auto", "padded", "bucketed", "per_sequence", "block_diagonal", "flash")
PADDED_MAX_SEQLEN = 128
MATMUL_ATTENTION_MAX_SEQLEN = 64


@dataclasses.dataclass
class PackedLayout:
    """Host-side description of a packed batch, built once per forward (one host sync)."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    seq_lens: list[int]
    max_seqlen: int
    sequence_index: torch.Tensor | None = None  # [total_tokens] which sequence owns a token
    index_in_sequence: torch.Tensor | None = None  # [total_tokens] offset within it
    buckets: list[list[int]] | None = None  # `length_buckets(seq_lens)`, once per forward
    bucket_parts: list[tuple[torch.Tensor, PackedLayout]] | None = None  # tokens and layout
    bucket_order_inverse: torch.Tensor | None = None  # [total_tokens] back to packed order

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> PackedLayout:
        offsets = cu_seqlens.tolist()
        seq_lens = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
        if any(length <= 0 for length in seq_lens):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {offsets}")
        return cls(cu_seqlens.to(torch.int32), seq_lens, max(seq_lens))

    def ensure_token_indices(self) -> None:
        if self.sequence_index is not None:
            return
        device = self.cu_seqlens.device
        lengths = torch.tensor(self.seq_lens, device=device)
        self.sequence_index = torch.repeat_interleave(
            torch.arange(len(self.seq_lens), device=device), lengths
        )
        starts = self.cu_seqlens[:-1].long()[self.sequence_index]
        self.index_in_sequence = torch.arange(self.sequence_index.shape[0], device=device) - starts

    def ensure_buckets(self) -> list[list[int]]:
        if self.buckets is None:
            self.buckets = length_buckets(self.seq_lens)
        return self.buckets

    def ensure_bucket_parts(self) -> None:
        """Each bucket's token positions (in packed order) and its own packed layout, and the
        permutation that puts the buckets' concatenated outputs back in packed order."""
        if self.bucket_parts is not None:
            return
        self.ensure_token_indices()
        device = self.cu_seqlens.device
        bucket_of_sequence = torch.empty(len(self.seq_lens), dtype=torch.long)
        for number, members in enumerate(self.ensure_buckets()):
            bucket_of_sequence[members] = number
        bucket_of_token = bucket_of_sequence.to(device)[self.sequence_index]
        self.bucket_parts = []
        for number, members in enumerate(self.buckets):
            lengths = [self.seq_lens[index] for index in sorted(members)]  # packed order
            cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            tokens = (bucket_of_token == number).nonzero().squeeze(1)
            layout = PackedLayout(cu_seqlens.to(device), lengths, max(lengths))
            self.bucket_parts.append((tokens, layout))
        order = torch.cat([tokens for tokens, _ in self.bucket_parts])
        self.bucket_order_inverse = torch.empty_like(order)
        self.bucket_order_inverse[order] = torch.arange(order.shape[0], device=device)


def length_buckets(seq_lens: list[int], max_padding: float = 2.0) -> list[list[int]]:
    """Sequence indices grouped for padded attention, longest first: a bucket takes the next
    longest sequences while padding them all to its first one's length costs at most
    `max_padding` times their exact attention work (sum of squared lengths). A sequence longer
    than `MATMUL_ATTENTION_MAX_SEQLEN` is a bucket of its own: batching longer ones through SDPA
    is no faster than one call each (16 x 64-256 tokens: 24-26 vs 20 ms forward).
    """
    order = sorted(range(len(seq_lens)), key=lambda index: -seq_lens[index])
    buckets: list[list[int]] = []
    exact_work = 0  # of the last bucket
    for index in order:
        length = seq_lens[index]
        if buckets:
            bucket = buckets[-1]
            longest = seq_lens[bucket[0]]
            padded_work = (len(bucket) + 1) * longest**2
            if longest <= MATMUL_ATTENTION_MAX_SEQLEN and padded_work <= max_padding * (
                exact_work + length**2
            ):
                bucket.append(index)
                exact_work += length**2
                continue
        buckets.append([index])
        exact_work = length**2
    return buckets


def causal_mask(query_len: int, key_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Bool [query_len, key_len]: True where a query (aligned to the key end) may attend."""
    query_positions = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key_positions = torch.arange(key_len, device=device)[None, :]
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    return allowed


def choose_kernel(requested: str, query: torch.Tensor, layout: PackedLayout) -> str:
    if requested not in ATTENTION_KERNELS:
        raise ValueError(
            f"unknown attention kernel {requested!r}; choose one of {ATTENTION_KERNELS}"
        )
    if requested != "auto":
        return requested
    if (
        flash_attn_varlen_func is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
    ):
        return "flash"
    padded_work = len(layout.seq_lens) * layout.max_seqlen**2
    exact_work = sum(length * length for length in layout.seq_lens)
    if layout.max_seqlen <= PADDED_MAX_SEQLEN and padded_work <= 2 * exact_work:
        return "padded"
    if len(layout.ensure_buckets()) == len(layout.seq_lens):
        return "per_sequence"
    return "bucketed"


def varlen_attention(
    query: torch.Tensor,  # [total_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [total_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [total_tokens, num_kv_heads, head_dim]
    layout: PackedLayout,
    sliding_window: int | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal attention within each packed sequence -> [total_tokens, num_heads, head_dim]."""
    kernel = choose_kernel(kernel, query, layout)
    if kernel == "flash":
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        return flash_attn_varlen_func(
            query,
            key,
            value,
            layout.cu_seqlens,
            layout.cu_seqlens,
            layout.max_seqlen,
            layout.max_seqlen,
            causal=True,
            window_size=window,
        )
    if kernel == "padded":
        return _padded_attention(query, key, value, layout, sliding_window)
    if kernel == "bucketed":
        return _bucketed_attention(query, key, value, layout, sliding_window)
    if kernel == "per_sequence":
        return _per_sequence_attention(query, key, value, layout, sliding_window)
    return _block_diagonal_attention(query, key, value, layout, sliding_window)


def _sdpa(query, key, value, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """SDPA on [batch, heads, len, head_dim] with grouped key/value heads."""
    grouped = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, enable_gqa=grouped
    )


def _per_sequence_attention(query, key, value, layout: PackedLayout, sliding_window):
    outputs = []
    start = 0
    for length in layout.seq_lens:
        end = start + length
        # [1, heads, length, head_dim]
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        if sliding_window is not None and length > sliding_window:
            mask = causal_mask(length, length, sliding_window, query.device)
            out = _sdpa(q, k, v, mask, is_causal=False)
        else:
            out = _sdpa(q, k, v, None, is_causal=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
        start = end
    return torch.cat(outputs, dim=0)


def _padded_attention(query, key, value, layout: PackedLayout, sliding_window):
    num_seqs, max_len = len(layout.seq_lens), layout.max_seqlen
    # Equal lengths (fixed-length rollouts, equal prompts): the packed tensors already are the
    # batch, so a view replaces the scatter and the gather (and their backward passes).
    equal_lengths = num_seqs * max_len == query.shape[0]
    if equal_lengths:

        def scatter(packed: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
            return packed.unflatten(0, (num_seqs, max_len)).transpose(1, 2)

    else:
        layout.ensure_token_indices()
        rows, cols = layout.sequence_index, layout.index_in_sequence

        def scatter(packed: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
            batch = packed.new_zeros(num_seqs, max_len, packed.shape[1], packed.shape[2])
            batch[rows, cols] = packed
            return batch.transpose(1, 2)

    q, k, v = scatter(query), scatter(key), scatter(value)
    # Causal masking alone never lets a real query see a padded key (pads sit after it).
    if query.device.type == "cpu" and max_len <= MATMUL_ATTENTION_MAX_SEQLEN:
        allowed = causal_mask(max_len, max_len, sliding_window, query.device)
        out = _grouped_matmul_attention(q, k, v, allowed)
    elif sliding_window is not None and max_len > sliding_window:
        out = _sdpa(q, k, v, causal_mask(max_len, max_len, sliding_window, query.device), False)
    else:
        out = _sdpa(q, k, v, None, is_causal=True)
    if equal_lengths:
        return out.transpose(1, 2).flatten(0, 1)  # [T, H, D]
    return out.transpose(1, 2)[rows, cols]  # [T, H, D]


def _bucketed_attention(query, key, value, layout: PackedLayout, sliding_window):
    layout.ensure_bucket_parts()
    outputs = []
    for tokens, bucket_layout in layout.bucket_parts:
        parts = [tensor.index_select(0, tokens) for tensor in (query, key, value)]
        outputs.append(_padded_attention(*parts, bucket_layout, sliding_window))
    return torch.cat(outputs).index_select(0, layout.bucket_order_inverse)


def _grouped_matmul_attention(query, key, value, allowed: torch.Tensor) -> torch.Tensor:
    """Attention of query [batch, heads, len, dim] over key/value [batch, kv_heads, len, dim]
    where `allowed` [len, len] is True, as matmul -> softmax (fp32) -> matmul.

    Query head h reads key/value head h // (heads / kv_heads), as Hugging Face's `repeat_kv`:
    the query heads of one key/value head are stacked along the length, so the scores are one
    [group * len, len] matrix per key/value head.
    """
    num_heads, length, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    stacked = query.reshape(query.shape[0], num_kv_heads, group * length, head_dim)
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=query.device)
    bias = bias.masked_fill(~allowed, float("-inf")).repeat(group, 1)  # [group * len, len]
    scores = torch.matmul(stacked, key.transpose(-1, -2)).float() * head_dim**-0.5 + bias
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)
    return out.view(query.shape)


def _block_diagonal_attention(query, key, value, layout: PackedLayout, sliding_window):
    layout.ensure_token_indices()
    same_sequence = layout.sequence_index[:, None] == layout.sequence_index[None, :]
    positions = layout.index_in_sequence
    allowed = same_sequence & (positions[None, :] <= positions[:, None])
    if sliding_window is not None:
        allowed &= positions[None, :] > positions[:, None] - sliding_window
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    out = _sdpa(q, k, v, allowed, is_causal=False)
    return out.squeeze(0).transpose(0, 1)
