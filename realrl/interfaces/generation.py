"""Offline sampling (the ``gen`` experiment's ``genDefault``): completions for the master.

``generate`` returns, per prompt, its ``n_samples`` completions as a rollout (the keys
``actor_gen`` writes: ``packed_input_ids`` prompt + completion tokens ``[total_tokens]``,
``prompt_mask`` ``[total_tokens]`` True on prompt tokens, ``seq_no_eos_mask`` ``[num_seqs]``
True where a completion hit ``max_new_tokens`` without EOS). The master, which knows the order of
the prompts in the dataset, writes every completion of every rank into one file,
``<run_dir>/<output_file>`` (``realrl.workers.samples_log.GeneratedFile``).
"""

from __future__ import annotations

import time

import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import (
    generate_with_backend,
    require_engine,
    sampling_config,
    unsupported_call,
)
from realrl.interfaces.configs import GenerationConfig


class GenerationInterface:
    def __init__(self, config: GenerationConfig) -> None:
        if config.n_samples < 1:
            raise ValueError(f"generation n_samples={config.n_samples} must be >= 1")
        self.config = config

    def optimizer_steps_per_call(self) -> int:
        return 0

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """Sample ``n_samples`` completions per prompt; one sample per prompt holds them all."""
        engine = require_engine(engine, "generation", "generate")
        n = self.config.n_samples
        started = time.perf_counter()
        output = generate_with_backend(
            engine,
            self.config.generation,
            data.data["packed_prompts"],
            data.cu_seqlens("packed_prompts"),
            sampling_config(self.config.generation, n, engine),
        )
        elapsed_s = time.perf_counter() - started
        seq_lens = (output.cu_seqlens[1:] - output.cu_seqlens[:-1]).long().cpu()  # [num_seqs]
        prompt_lens = output.prompt_lens.long().cpu()  # [num_seqs]
        seq_of_token = torch.repeat_interleave(torch.arange(seq_lens.numel()), seq_lens)
        position = torch.arange(seq_of_token.numel()) - (seq_lens.cumsum(0) - seq_lens)[seq_of_token]
        seqlens = [seq_lens[i * n : (i + 1) * n].tolist() for i in range(data.bs)]
        rollout = SequenceSample.from_tensors(
            ids=data.ids,
            seqlens={"packed_input_ids": seqlens, "prompt_mask": seqlens,
                     "seq_no_eos_mask": [[1] * n for _ in range(data.bs)]},
            data={"packed_input_ids": output.packed_input_ids.cpu().long(),
                  "prompt_mask": position < prompt_lens[seq_of_token],
                  "seq_no_eos_mask": output.no_eos.cpu().bool()},
            metadata=data.metadata,
        )
        response_lens = output.response_lens.float()
        stats = {
            "response_length": float(response_lens.mean()),
            "no_eos_fraction": float(output.no_eos.float().mean()),
            "generated_tokens_per_s": float(response_lens.sum()) / max(elapsed_s, 1e-9),
        }
        return MFCResult(data=rollout, stats=stats)

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("generation", "inference", "generate")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("generation", "train_step", "generate")
