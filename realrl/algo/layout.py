"""The packed layout every `realrl.algo` function reads and writes.

Notation (shapes in comments use these names):

- ``num_seqs``      sequences in the batch, each prompt tokens followed by response tokens.
- ``total_tokens``  sum of all sequence lengths.
- ``packed_input_ids [total_tokens]``   the sequences concatenated, no padding.
- ``cu_seqlens [num_seqs + 1]``        cumulative lengths, ``cu_seqlens[i]:cu_seqlens[i+1]`` is
  sequence ``i``. Every function in ``realrl.algo`` takes this *unshifted* tensor.
- **shifted** per-token training quantities (log-probs, loss mask, token rewards, advantages,
  returns, per-token losses) have ``total_tokens - num_seqs`` entries: a sequence of length
  ``L`` owns ``L - 1`` entries and entry ``j`` refers to predicting token ``j + 1`` from tokens
  ``0..j``. Their boundaries are ``shifted_cu_seqlens(cu_seqlens) = cu_seqlens - arange``.
- ``loss_mask [total_tokens - num_seqs]`` is True iff token ``j + 1`` is a response token.
- critic values are per token, ``[total_tokens]``: the value of the prefix ending at each
  token. The value at position ``j`` is the state before action ``j + 1``; use
  `shifted_values` to line them up with the shifted quantities.

Per-sequence reductions (`segment_sum`, `segment_mean`, `last_true_index`) are vectorised with
``index_add_`` / ``scatter_reduce_``; there are no Python loops over sequences.
"""

from __future__ import annotations

import torch

# Rows of logits per chunk (`logit_row_chunks`): about `_LOGIT_CHUNK_ELEMENTS` logits (16 MiB of
# fp32 per temporary, which keeps the softmax's passes in cache), but never fewer rows than the
# device's minimum, since every chunk re-reads the whole LM head weight for its matmul
# (`realrl.models.lm_head`) and needs enough rows for that matmul to be bound by compute: on CPU
# ~100 rows (measured, benchmarks/README.md "Fused LM head"), on an H100 ~300 (989 bf16 TFLOP/s
# over 3.35 TB/s, 2 bytes per weight: arithmetic intensity = rows flops per byte).
_LOGIT_CHUNK_ELEMENTS = 2**22
_MIN_CHUNK_ROWS = 128
_MIN_CHUNK_ROWS_CUDA = 512


def sequence_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Lengths ``[num_seqs]`` from ``cu_seqlens [num_seqs + 1]``."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def shifted_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Boundaries ``[num_seqs + 1]`` of the shifted quantities: each sequence loses one entry."""
    offsets = torch.arange(cu_seqlens.numel(), device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return cu_seqlens - offsets


def segment_ids(segment_cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Which segment each packed entry belongs to: ``[segment_cu_seqlens[-1]]`` of longs.

    Pass ``shifted_cu_seqlens(cu_seqlens)`` for shifted per-token quantities.
    """
    lengths = sequence_lengths(segment_cu_seqlens).long()
    ids = torch.arange(lengths.numel(), device=segment_cu_seqlens.device)
    return torch.repeat_interleave(ids, lengths)


def positions_in_segment(segment_cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Offset of each packed entry from the start of its segment: ``[total]`` of longs."""
    ids = segment_ids(segment_cu_seqlens)
    total = ids.numel()
    return torch.arange(total, device=ids.device) - segment_cu_seqlens[:-1].long()[ids]


def segment_sum(values: torch.Tensor, segment_cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-segment sums ``[num_segments]`` of ``values [total]`` (differentiable)."""
    num_segments = segment_cu_seqlens.numel() - 1
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add(0, segment_ids(segment_cu_seqlens), values)


def segment_mean(
    values: torch.Tensor, mask: torch.Tensor, segment_cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Masked per-segment means ``[num_segments]``; a segment with no True entry gives 0."""
    mask_f = mask.to(values.dtype)
    sums = segment_sum(values * mask_f, segment_cu_seqlens)
    counts = segment_sum(mask_f, segment_cu_seqlens)
    return sums / counts.clamp(min=1)


def last_true_index(mask: torch.Tensor, segment_cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed index of the last True entry of each segment, or -1 where a segment has none."""
    num_segments = segment_cu_seqlens.numel() - 1
    positions = torch.arange(mask.numel(), device=mask.device)
    candidates = torch.where(mask.bool(), positions, torch.full_like(positions, -1))
    out = torch.full((num_segments,), -1, dtype=torch.long, device=mask.device)
    return out.scatter_reduce(0, segment_ids(segment_cu_seqlens), candidates, reduce="amax")


def broadcast_to_tokens(per_sequence: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Repeat a ``[num_seqs]`` tensor over each sequence's shifted entries ``[total - num_seqs]``."""
    return per_sequence[segment_ids(shifted_cu_seqlens(cu_seqlens))]


def response_mask(prompt_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Shifted loss mask ``[total_tokens - num_seqs]`` from per-sequence prompt and total lengths.

    Entry ``j`` of a sequence is True iff token ``j + 1`` is a response token, i.e.
    ``j >= prompt_len - 1``. A sequence with no response tokens contributes only False entries.
    """
    if bool((prompt_lens < 1).any()) or bool((prompt_lens > seq_lens).any()):
        raise ValueError(
            "response_mask: every prompt needs 1 <= prompt_len <= seq_len; got "
            f"prompt_lens={prompt_lens.tolist()} seq_lens={seq_lens.tolist()}"
        )
    cu_seqlens = torch.nn.functional.pad(seq_lens.long().cumsum(0), (1, 0))
    shifted = shifted_cu_seqlens(cu_seqlens)
    ids = segment_ids(shifted)
    return positions_in_segment(shifted) >= (prompt_lens.long() - 1)[ids]


def shifted_values(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Drop each sequence's last per-token value: ``[total_tokens] -> [total_tokens - num_seqs]``.

    Entry ``j`` is then V(prefix 0..j), the state in which token ``j + 1`` is chosen.
    """
    return values[prediction_rows(cu_seqlens)]


def prediction_rows(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed rows ``[total_tokens - num_seqs]`` whose logits predict a next token in-sequence."""
    shifted = shifted_cu_seqlens(cu_seqlens)
    ids = segment_ids(shifted)
    return torch.arange(ids.numel(), device=cu_seqlens.device) + ids


def logit_row_chunks(rows: torch.Tensor, vocab_size: int) -> list[torch.Tensor]:
    """``rows`` in chunks of logits of width ``vocab_size`` (the rule above): the log-prob and
    entropy functions, and the fused LM head (`realrl.models.lm_head`), hold one chunk's
    ``[chunk, vocab]`` in fp32 at a time. Equal on every rank of a tensor-parallel group (same
    rows, same vocabulary slice width), which the vocab-parallel head needs: each chunk is one
    round of all-reduces."""
    minimum = _MIN_CHUNK_ROWS_CUDA if rows.is_cuda else _MIN_CHUNK_ROWS
    rows_per_chunk = max(minimum, _LOGIT_CHUNK_ELEMENTS // max(vocab_size, 1), 1)
    return list(torch.split(rows, rows_per_chunk))


class _ShiftedLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[label] without materialising a full fp32 log-softmax.

    Forward keeps only the per-row log-sum-exp; backward recomputes the softmax chunk by chunk,
    so peak extra memory is one fp32 chunk instead of a ``[total_tokens, vocab]`` copy.
    """

    @staticmethod
    def forward(ctx, logits, rows, labels, temperature):  # type: ignore[override]
        out = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        log_normalisers = torch.empty_like(out)
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            chunk_logits = logits.index_select(0, chunk).float() / temperature  # [chunk, vocab]
            lse = torch.logsumexp(chunk_logits, dim=-1)
            picked = chunk_logits.gather(-1, labels[start:end, None]).squeeze(-1)
            out[start:end] = picked - lse
            log_normalisers[start:end] = lse
            start = end
        ctx.save_for_backward(logits, rows, labels, log_normalisers)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, rows, labels, log_normalisers = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            chunk_logits = logits.index_select(0, chunk).float() / ctx.temperature
            probs = torch.exp(chunk_logits - log_normalisers[start:end, None])
            grad_chunk = -grad_out[start:end, None] * probs
            grad_chunk.scatter_add_(-1, labels[start:end, None], grad_out[start:end, None])
            grad_logits[chunk] = (grad_chunk / ctx.temperature).to(logits.dtype)
            start = end
        return grad_logits, None, None, None


class _ShiftedEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / T) per row, chunked like `_ShiftedLogprobs`.

    With z = logits / T, p = softmax(z): H = lse(z) - sum_k p_k z_k and
    dH/dz_k = -p_k (z_k - E_p[z]), where E_p[z] = lse(z) - H.
    """

    @staticmethod
    def forward(ctx, logits, rows, temperature):  # type: ignore[override]
        entropy = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        log_normalisers = torch.empty_like(entropy)
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            chunk_logits = logits.index_select(0, chunk).float() / temperature
            lse = torch.logsumexp(chunk_logits, dim=-1)
            probs = torch.exp(chunk_logits - lse[:, None])
            entropy[start:end] = lse - (probs * chunk_logits).sum(-1)
            log_normalisers[start:end] = lse
            start = end
        ctx.save_for_backward(logits, rows, log_normalisers, entropy)
        ctx.temperature = temperature
        return entropy

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, rows, log_normalisers, entropy = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            chunk_logits = logits.index_select(0, chunk).float() / ctx.temperature
            probs = torch.exp(chunk_logits - log_normalisers[start:end, None])
            expected_logit = (log_normalisers[start:end] - entropy[start:end])[:, None]
            grad_chunk = -grad_out[start:end, None] * probs * (chunk_logits - expected_logit)
            grad_logits[chunk] = (grad_chunk / ctx.temperature).to(logits.dtype)
            start = end
        return grad_logits, None, None


def packed_shifted_logprobs(
    logits: torch.Tensor,
    packed_input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """fp32 log-probabilities ``[total_tokens - num_seqs]`` of each next token.

    ``logits [total_tokens, vocab]`` (any float dtype) are the model outputs for
    ``packed_input_ids [total_tokens]``; entry ``j`` of a sequence is
    ``log softmax(logits[j] / temperature)[input_ids[j + 1]]``. Differentiable w.r.t. logits;
    memory stays O(chunk * vocab) beyond the logits and their gradient. For logits already
    held: the models' training and inference never form them and read log-probs off their
    hidden states instead (`Transformer.shifted_logprobs`, `realrl.models.lm_head`).
    """
    rows = prediction_rows(cu_seqlens)
    labels = packed_input_ids[rows + 1].long()
    return _ShiftedLogprobs.apply(logits, rows, labels, float(temperature))


def packed_entropy(
    logits: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """fp32 entropy ``[total_tokens - num_seqs]`` of each next-token distribution (nats)."""
    rows = prediction_rows(cu_seqlens)
    return _ShiftedEntropy.apply(logits, rows, float(temperature))
