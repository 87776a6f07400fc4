"""Offline sampling (the ``gen`` experiment's ``genDefault``): completions to JSON lines.

Each data-parallel rank appends its own file, ``<run_dir>/<stem>.rank<dp_rank>.jsonl`` with
one line ``{"query_id", "prompt", "completion", "no_eos"}`` per completion, so ranks never
write to the same file. ``run_dir`` is the worker's ``REALRL_RUN_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from realrl.api import environment
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import require_engine, sampling_config, unsupported_call
from realrl.interfaces.configs import GenerationConfig
from realrl.models.generation import generate

logger = logging.getLogger(__name__)



def output_path(output_file: str, dp_rank: int) -> Path:
    """Where this rank writes: ``output_file`` relative to the run directory, rank-suffixed."""
    run_dir = os.environ.get(environment.RUN_DIR)
    if not run_dir:
        raise RuntimeError(
            f"generation: ${environment.RUN_DIR} is not set, so there is no run directory to write "
            f"{output_file!r} into; start the experiment through the launcher (or set it)"
        )
    relative = Path(output_file)
    stem = relative.name.removesuffix(".jsonl")
    return Path(run_dir) / relative.parent / f"{stem}.rank{dp_rank}.jsonl"


class GenerationInterface:
    def __init__(self, config: GenerationConfig) -> None:
        if config.n_samples < 1:
            raise ValueError(f"generation n_samples={config.n_samples} must be >= 1")
        self.config = config

    def optimizer_steps_per_call(self) -> int:
        return 0

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """Sample ``n_samples`` completions per prompt and append them to this rank's file."""
        engine = require_engine(engine, "generation", "generate")
        n = self.config.n_samples
        started = time.perf_counter()
        output = generate(
            engine.module,
            data.data["packed_prompts"],
            data.cu_seqlens("packed_prompts"),
            sampling_config(self.config.generation, n, engine),
            engine.generator,
        )
        elapsed_s = time.perf_counter() - started
        tokenizer = engine.tokenizer
        eos_ids = set(engine.module.config.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
        prompts = data.data["packed_prompts"].split(data.seqlens_of("packed_prompts"))
        sequences = output.packed_input_ids.cpu().split(
            (output.cu_seqlens[1:] - output.cu_seqlens[:-1]).tolist()
        )
        no_eos = output.no_eos.cpu().tolist()
        lines = []
        for index, tokens in enumerate(sequences):
            sample = index // n
            response = tokens[len(prompts[sample]) :].tolist()
            if not no_eos[index] and response and response[-1] in eos_ids:
                response = response[:-1]
            record = {
                "query_id": data.ids[sample],
                "prompt": tokenizer.decode(prompts[sample].tolist(), skip_special_tokens=True),
                "completion": tokenizer.decode(response, skip_special_tokens=True),
                "no_eos": bool(no_eos[index]),
            }
            lines.append(json.dumps(record) + "\n")
        path = output_path(self.config.output_file, engine.parallel.dp_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as file:
            file.writelines(lines)
        response_lens = output.response_lens.float()
        stats = {
            "response_length": float(response_lens.mean()),
            "no_eos_fraction": float(output.no_eos.float().mean()),
            "generated_tokens_per_s": float(response_lens.sum()) / max(elapsed_s, 1e-9),
            "completions_written": float(len(lines)),
        }
        return MFCResult(data=None, stats=stats)

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("generation", "inference", "generate")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("generation", "train_step", "generate")
