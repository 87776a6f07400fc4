"""Tensor-parallel layers of the packed transformer, from megatron-core (Shoeybi et al. 2019).

`TensorParallelLayerFactory(process_group, dtype)` makes megatron-core's
`ColumnParallelLinear`, `RowParallelLinear` and `VocabParallelEmbedding`, each with an explicit
`tp_group=`: nothing here reads megatron's `parallel_state` globals or calls
`initialize_model_parallel`, so one process can hold several layouts of a model at once, each
on its own tp group (realrl's layouts differ per MFC). They run on CPU (gloo) as shipped and use
none of megatron's globals but one scratch buffer under sequence parallelism (below);
megatron-core 0.15 and older read the global tp group regardless of `tp_group=`. Tested with 0.16.0, 0.16.1 and 0.17.1 (the range `pyproject.toml` pins), and 0.18.2
and 0.19.2, which need triton to import.

Layout of the weights (what `realrl.models.tensor_parallel.shard_state_dict` produces):
- column-parallel (`qkv`, `gate_up`): weight [out / tp, in], bias [out / tp]; input replicated,
  output split (`gather_output=False`), the input's gradient all-reduced in the backward;
- row-parallel (`attention.output`, `mlp.down`): weight [out, in / tp], input split
  (`input_is_parallel=True`), outputs all-reduced in the forward; a bias would be replicated
  and added after the all-reduce (`skip_bias_add=False`; the Llama family has none);
- vocab-parallel embedding: weight [vocab / tp, hidden], rank r holds rows
  [r * vocab / tp, (r + 1) * vocab / tp);
- LM head: column-parallel over the vocabulary, the same slices; a tied head owns no weight
  (`skip_weight_param_allocation=True`) and multiplies by the embedding's.
megatron marks every split parameter with `tensor_model_parallel=True` (and `partition_dim`),
which `realrl.backends.torch_engine.sharded_parameter_ids` reads. (0.16 marks a split weight
only when it initialises it; the factory leaves weights uninitialised and marks them itself.)

The LM head returns this rank's vocabulary slice of the logits [..., vocab / tp]: training and
inference read log-probabilities and entropies off the slices (`vocab_parallel_shifted_logprobs`,
`vocab_parallel_entropy`, an all-reduce of a few numbers per token) instead of gathering
[tokens, vocab] logits. Generation gathers them for sampling (`gather_vocab=True`).

Sequence parallelism (`TensorParallelLayerFactory(..., sequence_parallel=True)`): the column-
and row-parallel layers get megatron's `sequence_parallel=True`, the LM head does not; the
token split around the blocks is `realrl.models.sequence_parallel`'s.

Two parts of megatron-core 0.16.1 are deliberately not used:
- its gather of a column-parallel output (`gather_output`, `runtime_gather_output`,
  `gather_from_tensor_model_parallel_region`) allocates on `torch.cuda.current_device()` and
  fails on CPU; the head gathers with `torch.distributed.all_gather` instead (no gradient,
  sampling only);
- its cross-entropies: `vocab_parallel_cross_entropy` has no group argument and reduces over
  megatron's *global* tp group (wrong for realrl's groups), and
  `fused_vocab_parallel_cross_entropy(logits, target, tp_group)` casts the logits' gradient to
  bf16 whatever their dtype and subtracts the max from fp32 logits in place (the caller's
  tensor: PPO reads entropies off the same logits). The functions below run megatron's
  `VocabParallelCrossEntropy` steps on a fresh fp32 copy of each chunk of rows, with the
  layout's group, and keep realrl's chunked memory bound (`realrl.algo.layout`).

Importing megatron.core costs ~3 s of CPU per process (it pulls in torch._inductor and
wandb), so only a process that builds a tensor-parallel model imports this module
(`realrl.workers.model_loading.shard_module`).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

from realrl.algo.layout import logit_row_chunks, prediction_rows
from realrl.models.layers import LinearKind

# Printed at import and on the first backward of each process; they concern CUDA-only fusions
# and Megatron-FSDP (imported by megatron.core, not used here).
warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed", UserWarning)
warnings.filterwarnings("ignore", "When using async grad allreduce", UserWarning)
logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)

from megatron.core import tensor_parallel as megatron_tp  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy  # noqa: E402
from megatron.core.tensor_parallel.utils import VocabUtility  # noqa: E402

from realrl.models import sequence_parallel as sequence_split  # noqa: E402


def megatron_config(
    tp_size: int, dtype: torch.dtype, sequence_parallel: bool = False
) -> ModelParallelConfig:
    """The `ModelParallelConfig` every layer gets: weights made on the default device (CPU, or
    the device of an enclosing `torch.device` context) and left uninitialised, because a
    tensor-parallel module is always filled from a full state dict (`shard_module`).
    `sequence_parallel`: column-parallel layers all-gather a token-split input and row-parallel
    ones reduce-scatter their output (Korthikanti et al. 2022)."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        sequence_parallel=sequence_parallel,
    )


def _not_initialised(weight: torch.Tensor) -> None:
    raise AssertionError("perform_initialization=False: megatron never calls init_method")


def _marked_split(layer: nn.Module, partition_dim: int) -> nn.Module:
    """`layer` with its weight marked split along `partition_dim`, as megatron-core 0.16's
    `_initialize_affine_weight_cpu` marks the weights it initialises (biases it always marks;
    0.19 marks uninitialised weights too)."""
    if layer.weight is not None and not hasattr(layer.weight, "tensor_model_parallel"):
        megatron_tp.set_tensor_model_parallel_attributes(layer.weight, True, partition_dim, 1)
    return layer


# megatron's linears return (output, bias) and write an `_extra_state` entry (None, for
# Transformer Engine checkpoints) into state dicts; realrl's blocks call layers like `nn.Linear`
# and keep realrl-named state dicts. Restoring `nn.Module.get_extra_state` drops the entry;
# megatron's `set_extra_state` and load hook still accept state dicts with or without it.


class _ColumnParallelLinear(megatron_tp.ColumnParallelLinear):
    get_extra_state = nn.Module.get_extra_state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)[0]


class _RowParallelLinear(megatron_tp.RowParallelLinear):
    get_extra_state = nn.Module.get_extra_state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)[0]


class VocabParallelHead(megatron_tp.ColumnParallelLinear):
    """The LM head: megatron's column-parallel linear over the vocabulary, without its gather."""

    get_extra_state = nn.Module.get_extra_state

    def forward(
        self,
        hidden: torch.Tensor,
        tied_weight: torch.Tensor | None = None,
        gather_vocab: bool = False,
    ) -> torch.Tensor:
        """Logits [..., vocab / tp] of this rank's vocabulary slice, or with `gather_vocab` the
        full [..., vocab] (no gradient). `tied_weight`: the embedding's [vocab / tp, hidden]
        when the head owns none."""
        logits = super().forward(hidden, weight=tied_weight)[0]
        return gather_vocabulary(logits, self.tp_group) if gather_vocab else logits


def gather_vocabulary(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Full-vocabulary logits [..., vocab] from every rank's slice [..., vocab / tp] (ranks in
    vocabulary order). Not differentiable: for sampling only."""
    if logits.requires_grad:
        raise RuntimeError(
            "gathering vocab-parallel logits drops their gradient; train on the slices "
            "(Transformer.shifted_logprobs) or run the head under torch.no_grad()"
        )
    pieces = [torch.empty_like(logits) for _ in range(group.size())]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


class TensorParallelLayerFactory:
    """`LayerFactory` making megatron-core tensor-parallel layers on `process_group`, with
    weights of `dtype`."""

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ):
        self.process_group = process_group
        self.tp_size = process_group.size()
        # Off at tp size 1, as megatron turns it off there: nothing to split.
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.config = megatron_config(self.tp_size, dtype, self.sequence_parallel)
        # The LM head takes the gathered sequence and all-reduces its input's gradient, as
        # without sequence parallelism (see the module docstring).
        self.head_config = megatron_config(self.tp_size, dtype)
        if self.sequence_parallel:
            sequence_split.ensure_global_memory_buffer()

    def linear(
        self, in_features: int, out_features: int, bias: bool, kind: LinearKind
    ) -> nn.Module:
        common = dict(config=self.config, init_method=_not_initialised, bias=bias)
        if kind == "column":
            column = _ColumnParallelLinear(
                in_features,
                out_features,
                **common,
                gather_output=False,
                tp_group=self.process_group,
            )
            return _marked_split(column, partition_dim=0)
        if kind == "row":
            row = _RowParallelLinear(
                in_features,
                out_features,
                **common,
                input_is_parallel=True,
                skip_bias_add=False,
                tp_group=self.process_group,
            )
            return _marked_split(row, partition_dim=1)
        return nn.Linear(in_features, out_features, bias=bias, dtype=self.config.params_dtype)

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        embedding = megatron_tp.VocabParallelEmbedding(
            num_embeddings,
            embedding_dim,
            init_method=_not_initialised,
            config=self.config,
            tp_group=self.process_group,
        )
        return _marked_split(embedding, partition_dim=0)

    def lm_head(self, in_features: int, vocab_size: int, tied: bool) -> nn.Module:
        head = VocabParallelHead(
            in_features,
            vocab_size,
            config=self.head_config,
            init_method=_not_initialised,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=tied,
            tp_group=self.process_group,
        )
        return _marked_split(head, partition_dim=0)

    def scatter_sequence(self, hidden, cos, sin, attend):
        """`realrl.models.sequence_parallel.scatter_sequence` on this layout's tp group."""
        return sequence_split.scatter_sequence(hidden, cos, sin, attend, self.process_group)

    def gather_sequence(self, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
        """`realrl.models.sequence_parallel.gather_sequence` on this layout's tp group."""
        return sequence_split.gather_sequence(hidden, tokens, self.process_group)

    def shifted_logprobs(self, logits, packed_input_ids, cu_seqlens, temperature):
        return vocab_parallel_shifted_logprobs(
            logits, packed_input_ids, cu_seqlens, self.process_group, temperature
        )

    def shifted_entropy(self, logits, cu_seqlens, temperature):
        return vocab_parallel_entropy(logits, cu_seqlens, self.process_group, temperature)


def vocab_parallel_shifted_logprobs(
    logits: torch.Tensor,  # [total_tokens, vocab / tp]: this rank's vocabulary slice
    packed_input_ids: torch.Tensor,  # [total_tokens]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1]
    group: dist.ProcessGroup,
    temperature: float = 1.0,
) -> torch.Tensor:
    """`realrl.algo.layout.packed_shifted_logprobs` of vocab-parallel logits: fp32
    [total_tokens - num_seqs], equal on every rank of `group`. Every rank must call it with
    the same tokens. Differentiable w.r.t. the slice; the backward needs no communication."""
    rows = prediction_rows(cu_seqlens)
    labels = packed_input_ids[rows + 1].long()
    return _VocabParallelShiftedLogprobs.apply(logits, rows, labels, float(temperature), group)


def vocab_parallel_entropy(
    logits: torch.Tensor,  # [total_tokens, vocab / tp]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1]
    group: dist.ProcessGroup,
    temperature: float = 1.0,
) -> torch.Tensor:
    """`realrl.algo.layout.packed_entropy` of vocab-parallel logits: fp32
    [total_tokens - num_seqs] (nats), equal on every rank of `group`."""
    return _VocabParallelEntropy.apply(
        logits, prediction_rows(cu_seqlens), float(temperature), group
    )


class _VocabParallelShiftedLogprobs(torch.autograd.Function):
    """log softmax(z)[label] with z = logits / T split over the vocabulary, chunk by chunk.

    Forward, per chunk, megatron's steps: the global max (all-reduce MAX), then the label's
    logit (found on one rank, zero on the others) and the sum of exp(z - max), summed over the
    group in one all-reduce. It keeps the per-row log-sum-exp; the backward recomputes this
    rank's softmax slice and megatron's gradient, softmax - onehot(label), without
    communication (the LM head's backward all-reduces the hidden states' gradient).
    """

    @staticmethod
    def forward(ctx, logits, rows, labels, temperature, group):  # type: ignore[override]
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.shape[-1], group.rank(), group.size()
        )
        logprobs = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        log_normalisers = torch.empty_like(logprobs)
        label_masks, local_labels = [], []
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            # index_select copies: megatron's steps work in place on their input.
            scaled = logits.index_select(0, chunk).float() / temperature  # [chunk, vocab / tp]
            scaled, row_max = VocabParallelCrossEntropy.calculate_logits_max(scaled)
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            not_here, local_label, label_logit, sum_exp, _ = (
                VocabParallelCrossEntropy.calculate_predicted_logits(
                    scaled, labels[start:end], row_max, vocab_start, vocab_end
                )
            )
            sums = torch.cat((label_logit, sum_exp))  # [2 * chunk]: one all-reduce
            dist.all_reduce(sums, group=group)
            label_logit, sum_exp = sums.split(chunk.numel())
            logprobs[start:end] = label_logit - sum_exp.log()  # both relative to the max
            log_normalisers[start:end] = row_max + sum_exp.log()
            label_masks.append(not_here)
            local_labels.append(local_label)
            start = end
        ctx.save_for_backward(
            logits, rows, log_normalisers, torch.cat(label_masks), torch.cat(local_labels)
        )
        ctx.temperature = temperature
        return logprobs

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, rows, log_normalisers, not_here, local_labels = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            scaled = logits.index_select(0, chunk).float() / ctx.temperature
            softmax = torch.exp(scaled - log_normalisers[start:end, None])  # [chunk, vocab / tp]
            grad_2d, arange_1d, label_here, grad_input = (
                VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
                    softmax, not_here[start:end]
                )
            )
            # megatron differentiates -log p: the negated incoming gradient gives d log p.
            grad_chunk = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d,
                arange_1d,
                local_labels[start:end],
                label_here,
                grad_input,
                -grad_out[start:end],
            )
            grad_logits[chunk] = (grad_chunk / ctx.temperature).to(logits.dtype)
            start = end
        return grad_logits, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(z), z = logits / T split over the vocabulary (megatron has none).

    H = lse(z) - sum_k p_k z_k; per chunk the max is all-reduced, then sum_k exp(z_k - max) and
    sum_k exp(z_k - max) z_k in one all-reduce. dH/dz_k = -p_k (z_k - E_p[z]) with
    E_p[z] = lse - H needs only this rank's slice.
    """

    @staticmethod
    def forward(ctx, logits, rows, temperature, group):  # type: ignore[override]
        entropy = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        log_normalisers = torch.empty_like(entropy)
        start = 0
        for chunk in logit_row_chunks(rows, logits.shape[-1]):
            end = start + chunk.numel()
            scaled = logits.index_select(0, chunk).float() / temperature  # [chunk, vocab / tp]
            row_max = scaled.max(dim=-1).values
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            exp = torch.exp(scaled - row_max[:, None])
            sums = torch.cat((exp.sum(-1), (exp * scaled).sum(-1)))  # [2 * chunk]
            dist.all_reduce(sums, group=group)
            sum_exp, sum_exp_logit = sums.split(chunk.numel())
            log_normalisers[start:end] = row_max + sum_exp.log()
            entropy[start:end] = log_normalisers[start:end] - sum_exp_logit / sum_exp
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
            scaled = logits.index_select(0, chunk).float() / ctx.temperature
            probs = torch.exp(scaled - log_normalisers[start:end, None])
            expected = (log_normalisers[start:end] - entropy[start:end])[:, None]
            grad_chunk = -grad_out[start:end, None] * probs * (scaled - expected)
            grad_logits[chunk] = (grad_chunk / ctx.temperature).to(logits.dtype)
            start = end
        return grad_logits, None, None, None
