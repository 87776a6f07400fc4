"""The LM head fused with the log-softmax: log-probs and entropies from hidden states, by chunks.

Training and inference read two numbers per token off the language model: the log-probability
of the next token and (PPO) the entropy of the next-token distribution. Computing them from
``[total_tokens, vocab]`` logits holds the logits (and, training, their gradient) whole: with
Qwen2.5's 151,936-token vocabulary that is 0.6 MB per token in fp32 for each copy, more than
the rest of a 0.5B model's activations. Here the head's matmul, the fp32 log-softmax and the
entropy are computed for one chunk of rows at a time from the final hidden states
``[total_tokens, hidden]``; only per-row statistics are kept. The backward recomputes each
chunk's logits and accumulates the hidden states' and the weight's gradients chunk by chunk
(the price: one more head matmul per training step). Peak memory beyond the hidden states and
the weight is one chunk's ``[chunk, vocab]`` temporaries (`realrl.algo.layout.logit_row_chunks`).

Numerics match the unfused path: the matmul runs in the weight's dtype (bf16 logits, as
``F.linear`` returns them), each chunk is upcast to fp32 for the softmax, and the weight's
gradient is summed over chunks in fp32 before it is cast back once.

Under tensor parallelism the weight is this rank's vocabulary slice ``[vocab / tp, hidden]``
(megatron's column-parallel LM head, or the vocab-parallel embedding when tied). Per chunk the
row maxima are all-reduced (MAX), then the label's logit, the sum of exponentials and (for the
entropy) their logit-weighted sum in one all-reduce (SUM): megatron's vocab-parallel
cross-entropy steps, with the layout's group, and never a gather of logits. The backward needs
this rank's slice only, and all-reduces the hidden states' gradient over the group, as the
column-parallel linear's backward does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.algo.layout import logit_row_chunks, prediction_rows


def lm_head_logprobs(
    hidden: torch.Tensor,  # [total_tokens, hidden]: final-normed hidden states
    weight: torch.Tensor,  # [vocab (/ tp), hidden]: the LM head (or tied embedding) weight
    packed_input_ids: torch.Tensor,  # [total_tokens]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1]
    temperature: float = 1.0,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``log softmax(hidden @ weight.T / temperature)[next token]`` and, with
    `with_entropy`, the entropy of that distribution (nats), both ``[total_tokens - num_seqs]``
    (the shifted layout of `realrl.algo.layout`); entropy is None without `with_entropy`.

    Differentiable w.r.t. `hidden` and `weight`. `group`: the tensor-parallel group whose ranks
    hold the vocabulary slices of `weight`, in order; every rank must call this with the same
    hidden states and tokens. None: `weight` holds the whole vocabulary.
    """
    if hidden.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"lm_head_logprobs reads final hidden states [total_tokens, {weight.shape[-1]}] "
            f"(the model's forward with apply_lm_head=False); got {tuple(hidden.shape)}. For "
            "logits you already hold use realrl.algo.layout.packed_shifted_logprobs"
        )
    rows = prediction_rows(cu_seqlens)
    labels = packed_input_ids[rows + 1].long()
    logprobs, entropy = _FusedLMHeadLogprobs.apply(
        hidden, weight, rows, labels, float(temperature), with_entropy, group
    )
    return logprobs, (entropy if with_entropy else None)


def _vocab_start(weight: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """First vocabulary id of this rank's slice (equal slices, in rank order)."""
    return 0 if group is None else weight.shape[0] * group.rank()


def _scaled_logits(hidden, weight, rows, temperature) -> torch.Tensor:
    """fp32 ``hidden[rows] @ weight.T / temperature`` ``[chunk, vocab (/ tp)]``, a fresh
    tensor (the in-place steps of the callers may overwrite it)."""
    logits = (hidden.index_select(0, rows) @ weight.T).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def _chunk_statistics(scaled, local_labels, with_entropy, group):
    """Per-row statistics of one chunk: log-probs of the labels, log-sum-exps and entropies
    (None without `with_entropy`), each ``[chunk]``. Overwrites `scaled` (z - max)."""
    row_max = scaled.max(dim=-1).values  # [chunk]
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled.sub_(row_max[:, None])  # z - max, [chunk, vocab (/ tp)]
    here = (local_labels >= 0) & (local_labels < shifted.shape[-1])
    label_logit = shifted.gather(-1, local_labels.clamp(0, shifted.shape[-1] - 1)[:, None])
    label_logit = label_logit.squeeze(-1) * here  # found on one rank, 0 on the others
    exp = shifted.exp()
    sums = [label_logit, exp.sum(-1)]
    if with_entropy:
        sums.append(torch.bmm(exp[:, None, :], shifted[:, :, None]).view(-1))  # sum e (z - max)
    totals = torch.cat(sums)  # [2 or 3 * chunk]: one all-reduce for all of them
    if group is not None:
        dist.all_reduce(totals, group=group)
    label_logit, sum_exp, *weighted = totals.split(row_max.numel())
    log_sum_exp = sum_exp.log()
    entropy = log_sum_exp - weighted[0] / sum_exp if with_entropy else None
    return label_logit - log_sum_exp, row_max + log_sum_exp, entropy


def _chunk_gradient(scaled, lse, entropy, local_labels, grad_logprobs, grad_entropy):
    """d loss / d z ``[chunk, vocab (/ tp)]`` for z = logits / T, overwriting `scaled`.

    With p = softmax(z): d log p_y / dz = onehot(y) - p and dH/dz = -p (z - E_p[z]), where
    z - E_p[z] = log p + H. A None incoming gradient contributes nothing.
    """
    log_probs = scaled.sub_(lse[:, None])  # log p
    probs = log_probs.exp()
    if grad_entropy is not None:
        per_logit = log_probs.add_(entropy[:, None]).mul_(grad_entropy[:, None])
        if grad_logprobs is not None:
            per_logit.add_(grad_logprobs[:, None])
        grad = probs.mul_(per_logit).neg_()
    else:
        grad = probs.mul_(-grad_logprobs[:, None])
    if grad_logprobs is not None:
        here = (local_labels >= 0) & (local_labels < grad.shape[-1])
        index = local_labels.clamp(0, grad.shape[-1] - 1)[:, None]
        grad.scatter_add_(-1, index, (grad_logprobs * here)[:, None])
    return grad


class _FusedLMHeadLogprobs(torch.autograd.Function):
    """(log-probs, entropies) of the labels from hidden states and the head weight; saves no
    tensor of width vocab (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, rows, labels, temperature, with_entropy, group):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        local_labels = labels - _vocab_start(weight, group)
        logprobs = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
        log_normalisers = torch.empty_like(logprobs)
        entropy = torch.empty(
            rows.numel() if with_entropy else 0, dtype=torch.float32, device=hidden.device
        )
        start = 0
        for chunk in logit_row_chunks(rows, weight.shape[0]):
            end = start + chunk.numel()
            scaled = _scaled_logits(hidden, weight, chunk, temperature)
            chunk_logprobs, lse, chunk_entropy = _chunk_statistics(
                scaled, local_labels[start:end], with_entropy, group
            )
            logprobs[start:end], log_normalisers[start:end] = chunk_logprobs, lse
            if with_entropy:
                entropy[start:end] = chunk_entropy
            start = end
        ctx.save_for_backward(hidden, weight, rows, local_labels, log_normalisers, entropy)
        ctx.temperature, ctx.group = temperature, group
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        hidden, weight, rows, local_labels, log_normalisers, entropy = ctx.saved_tensors
        if entropy.numel() == 0:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # Summed over chunks in fp32, cast once: bf16 partial sums would round per chunk.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        start = 0
        for chunk in logit_row_chunks(rows, weight.shape[0]):
            end = start + chunk.numel()
            span = slice(start, end)
            grad = _chunk_gradient(
                _scaled_logits(hidden, weight, chunk, ctx.temperature),
                log_normalisers[span],
                entropy[span] if grad_entropy is not None else None,
                local_labels[span],
                None if grad_logprobs is None else grad_logprobs[span],
                None if grad_entropy is None else grad_entropy[span],
            )
            grad_logits = grad.div_(ctx.temperature).to(weight.dtype)  # [chunk, vocab (/ tp)]
            if grad_hidden is not None:
                grad_hidden.index_copy_(0, chunk, grad_logits @ weight)
            if grad_weight is not None:
                chunk_hidden = hidden.index_select(0, chunk)
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.T, chunk_hidden)
                else:
                    grad_weight += (grad_logits.T @ chunk_hidden).float()
            start = end
        if grad_hidden is not None and ctx.group is not None:
            dist.all_reduce(grad_hidden, group=ctx.group)  # every vocabulary slice's share
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
