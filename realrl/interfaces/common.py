"""Helpers shared by the interfaces: micro-batched forwards, masks, mini-batches, statistics.

Notation follows `realrl.api.data` and `realrl.algo.layout`: ``packed_input_ids
[total_tokens]``, ``cu_seqlens [num_seqs + 1]``, *shifted* tensors ``[total_tokens - num_seqs]``
(entry ``j`` of a sequence predicts token ``j + 1``).

Training statistics follow one rule: a loss function returns *sums* (and the counts they are
sums over); `DistributedMeans` all-reduces every sum and count in one call at the end of the
step, so every data-parallel rank reports the same global means without a sync per
micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from realrl.algo.distributed_stats import all_reduce_sum
from realrl.algo.layout import prediction_rows
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import GenerationBackend, GenerationHyperparameters
from realrl.models.generation import generate
from realrl.models.sampling import GenerationConfig as SamplingConfig
from realrl.models.sampling import GenerationOutput

logger = logging.getLogger(__name__)


def unsupported_call(interface_name: str, method: str, supported: str) -> NotImplementedError:
    """The error an interface raises for an MFC kind it does not implement."""
    return NotImplementedError(
        f"interface {interface_name!r} has no {method}(); it supports {supported}. Check the MFC "
        f"that names interface={interface_name!r} in the experiment graph: its kind must be one "
        "of those."
    )


def require_engine(engine, interface_name: str, method: str):
    """Fail with a readable message when a model-backed MFC is handed no model."""
    if engine is None or getattr(engine, "module", None) is None:
        raise ValueError(
            f"interface {interface_name!r}.{method}() needs a model engine but got none; the MFC "
            "must run on a model role with weights (not a rule-based role)"
        )
    return engine


def require_keys(data: SequenceSample, keys: tuple[str, ...], where: str) -> None:
    missing = [key for key in keys if key not in data.keys]
    if missing:
        raise KeyError(
            f"{where}: input lacks key(s) {missing}; it has {sorted(data.keys)}. Add them to the "
            "MFC's input_keys (or remap the producing MFC's output keys)"
        )


def shifted_seqlens(seqlens: list[list[int]]) -> list[list[int]]:
    """Per-sample lengths of shifted quantities: each sequence of length L owns L - 1 entries."""
    return [[max(length - 1, 0) for length in sample] for sample in seqlens]


def one_per_sequence(seqlens: list[list[int]]) -> list[list[int]]:
    """Per-sample lengths of a key holding one scalar per sequence."""
    return [[1] * len(sample) for sample in seqlens]


def loss_mask_from_prompt_mask(prompt_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Shifted loss mask ``[total_tokens - num_seqs]``: True where token ``j + 1`` is a response
    token, from the per-token ``prompt_mask [total_tokens]`` (True on prompt tokens)."""
    return ~prompt_mask.bool()[prediction_rows(cu_seqlens) + 1]


def sampling_config(hyperparameters: GenerationHyperparameters, n: int, engine) -> SamplingConfig:
    """The generation engine's settings for ``n`` samples per prompt.

    EOS comes from the model config; a model config without one falls back to the
    tokenizer's EOS, so a response can always end.
    """
    eos_token_id = None
    if not engine.module.config.eos_token_ids and engine.tokenizer is not None:
        eos_token_id = engine.tokenizer.eos_token_id
    return SamplingConfig(
        n=n,
        max_new_tokens=hyperparameters.max_new_tokens,
        min_new_tokens=hyperparameters.min_new_tokens,
        greedy=hyperparameters.greedy,
        temperature=hyperparameters.temperature,
        top_k=hyperparameters.top_k,
        top_p=hyperparameters.top_p,
        stop_token_ids=list(hyperparameters.stop_token_ids),
        eos_token_id=eos_token_id,
        compile=hyperparameters.compile,
        cuda_graphs=hyperparameters.cuda_graphs,
    )


def generate_with_backend(engine, hyperparameters: GenerationHyperparameters,
                          packed_prompts: torch.Tensor, prompt_cu_seqlens: torch.Tensor,
                          config: SamplingConfig) -> GenerationOutput:
    """`realrl.models.generation.generate` on the engine's module, or with `gen.backend=vllm`
    the vLLM engine colocated with it (`realrl.models.vllm_generation`: built on the first
    call, one per model shard, kept on the engine), which returns the same output."""
    if hyperparameters.backend != GenerationBackend.vllm:
        return generate(engine.module, packed_prompts, prompt_cu_seqlens, config,
                        engine.generator)
    from realrl.models.vllm_generation import VLLMGenerator

    if engine.vllm_generator is None:
        # A trained model's weights change before every call: its engine drops them asleep.
        sleep_level = 2 if engine.optimizer is not None else 1
        engine.vllm_generator = VLLMGenerator(hyperparameters.vllm_gpu_memory_utilization,
                                              sleep_level)
    return engine.vllm_generator.generate(engine.module, engine.weight_writes,
                                          packed_prompts, prompt_cu_seqlens, config,
                                          engine.generator)


def optimizer_step_stats(step_stats: list[dict]) -> dict[str, float]:
    """A train call's `grad_norm` and `forward_reused` averaged over its optimizer steps (the
    stats of each `TorchEngine.train_microbatches`), and the `lr` of the last one. Every rank
    has the same `grad_norm` and `lr`; `forward_reused` is this rank's."""
    num_steps = len(step_stats)
    return {
        "grad_norm": sum(s["grad_norm"] for s in step_stats) / num_steps,
        "forward_reused": sum(s["forward_reused"] for s in step_stats) / num_steps,
        "lr": step_stats[-1]["lr"],
    }


def keeps_forward(engine, ppo, data: SequenceSample, microbatch: MicroBatchSpec) -> bool:
    """Whether a forward over `data` on `engine` is also the next train call's forward: a
    trainable engine (the train call's own), one optimizer step per train call
    (`PPOHyperparameters.reuses_forward`), and `data` in one micro-batch, so that the kept
    graph holds no more activations than that train call would."""
    microbatches, _, _ = data.split_microbatches(
        microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
    )
    return engine.optimizer is not None and ppo.reuses_forward() and len(microbatches) == 1


def map_microbatches(
    data: SequenceSample,
    microbatch: MicroBatchSpec,
    compute: Callable[[SequenceSample], SequenceSample],
) -> SequenceSample:
    """Run ``compute`` on each micro-batch (token budget from ``microbatch``) and put the
    results back in the order of ``data``. ``compute`` returns the new keys for exactly the
    samples it was given, same ids, same order."""
    microbatches, _, backward_indices = data.split_microbatches(
        microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
    )
    outputs = [compute(part) for part in microbatches]
    return SequenceSample.gather(outputs).reorder(backward_indices)


def shifted_logprobs(
    engine, data: SequenceSample, microbatch: MicroBatchSpec, output_key: str
) -> SequenceSample:
    """Log-probability (temperature 1) of every next token of ``packed_input_ids`` under the
    engine's model, as ``output_key`` float32 shifted; micro-batched, no gradient.

    Temperature 1 matches the generation engine's ``packed_logprobs``, which are taken from
    the unmodified distribution, so a PPO ratio against them starts at exactly 1.
    """
    require_keys(data, ("packed_input_ids",), output_key)

    def compute(part: SequenceSample) -> SequenceSample:
        packed_input_ids = part.data["packed_input_ids"].to(engine.device)  # [total_tokens]
        cu_seqlens = part.cu_seqlens("packed_input_ids").to(engine.device)  # [num_seqs + 1]
        hidden = engine.forward(packed_input_ids, cu_seqlens)  # [total_tokens, hidden]
        with torch.no_grad():
            logprobs = engine.module.shifted_logprobs(hidden, packed_input_ids, cu_seqlens)
        return SequenceSample.from_tensors(
            ids=part.ids,
            seqlens={output_key: shifted_seqlens(part.seqlens["packed_input_ids"])},
            data={output_key: logprobs.float().cpu()},  # [total_tokens - num_seqs]
        )

    return map_microbatches(data, microbatch, compute)


def strided_minibatches(data: SequenceSample, num_minibatches: int) -> list[SequenceSample]:
    """Split this rank's samples into ``num_minibatches`` mini-batches, sample ``i`` going to
    mini-batch ``i % num_minibatches``.

    Striding (rather than contiguous chunks) makes the union over data-parallel ranks of
    mini-batch ``k`` equal to mini-batch ``k`` of a single process when the batch was cut into
    contiguous rank shares, and keeps every mini-batch's sample count within one of the others.
    """
    if data.bs < num_minibatches:
        raise ValueError(
            f"this data-parallel rank holds {data.bs} samples but ppo.num_minibatches="
            f"{num_minibatches}; every mini-batch needs a sample on every rank. Lower "
            "ppo.num_minibatches or raise the batch size"
        )
    return [
        data.reorder(list(range(start, data.bs, num_minibatches)))
        for start in range(num_minibatches)
    ]


class DistributedMeans:
    """Sums and counts of statistics, reduced over a process group in one all-reduce.

    ``add("entropy", sum_of_entropies, num_tokens)`` accumulates; `reduce` returns
    ``{"entropy": global_sum / global_count}``. Values may be floats or 0-dim tensors.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.counts: dict[str, torch.Tensor | float] = {}
        self.fixed_divisors: dict[str, float] = {}

    def add(self, name: str, total, count=1.0) -> None:
        """Accumulate ``total`` over ``count`` items; both are summed over ranks."""
        self.sums[name] = self.sums.get(name, 0.0) + _as_float64(total)
        self.counts[name] = self.counts.get(name, 0.0) + _as_float64(count)

    def add_global_total(self, name: str, total, divisor: float = 1.0) -> None:
        """Accumulate ``total``, summed over ranks, then divided by ``divisor`` (not reduced):
        e.g. each rank's share of a loss whose shares add up to the global loss."""
        self.add(name, total, 0.0)
        self.fixed_divisors[name] = float(divisor)

    def reduce(self, process_group: dist.ProcessGroup | None) -> dict[str, float]:
        names = sorted(self.sums)
        if not names:
            return {}
        values = [_as_float64(self.sums[n]) for n in names] + [
            _as_float64(self.counts[n]) for n in names
        ]
        vector = torch.stack([v.cpu() for v in values])  # [2 * num_stats] float64
        sums, counts = all_reduce_sum(vector, process_group).split(len(names))
        result = {}
        for name, total, count in zip(names, sums.tolist(), counts.tolist()):
            if name in self.fixed_divisors:
                result[name] = total / self.fixed_divisors[name]
            else:
                result[name] = total / count if count > 0 else 0.0
        return result


def _as_float64(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64)
