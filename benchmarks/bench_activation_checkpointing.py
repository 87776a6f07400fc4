"""Activation memory with and without `<role>.gradient_checkpointing` (issue 22), on CPU.

Each mode runs in a fresh process (so that one mode's freed memory does not hide the other's
need): the `bench_setup.py` model (default "small", fp32) in a `TorchEngine` with the torch
optimizer backend, two optimizer steps of one micro-batch of `--num-seqs` x `--seq-len` tokens
(a next-token loss through the log-probs), the second measured by the model worker's own meter
(`realrl.workers.memory_watch.PeakMemory`: the resident-set peak of the call). Reported: the
call's peak less what was live at its start (weights, optimizer state, gradients), per token,
and the train step's time. Modes alternate over `--repeats`.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_activation_checkpointing.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = {"stored": [], "checkpointed": ["--checkpointing"],
         "compiled": ["--compile"], "compiled+checkpointed": ["--compile", "--checkpointing"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench")
    parser.add_argument("--size", default="small", help="bench_setup.MODEL_SIZES key")
    parser.add_argument("--layers", type=int, default=None, help="Override the size's layers.")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    """One mode, in this process: the measured step's memory and time."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_setup import MODEL_SIZES

    from realrl.api.experiment import OptimizerConfig
    from realrl.backends.torch_engine import ParallelContext, TorchEngine
    from realrl.launcher.defaults import DEFAULT_ARCHITECTURE, fresh_default_model
    from realrl.models.checkpoint import load_pretrained
    from realrl.models.compiled import enable_compiled_blocks
    from realrl.workers.memory_watch import PeakMemory

    torch.set_num_threads(1)
    shape = dict(MODEL_SIZES[args.size])
    shape["num_hidden_layers"] = args.layers or shape["num_hidden_layers"]
    directory = Path(args.work_dir) / f"model-{args.size}-{shape['num_hidden_layers']}-layers"
    module = load_pretrained(fresh_default_model(directory, 0, {**DEFAULT_ARCHITECTURE, **shape}))
    module.gradient_checkpointing = args.checkpointing
    if args.compile:
        enable_compiled_blocks(module, "actor.compile")
    engine = TorchEngine(module, None, ParallelContext(), OptimizerConfig(lr=1e-4), 10)
    generator = torch.Generator().manual_seed(0)
    tokens = args.num_seqs * args.seq_len
    packed = torch.randint(0, module.config.vocab_size, (tokens,), generator=generator)
    cu_seqlens = torch.arange(0, tokens + 1, args.seq_len, dtype=torch.int32)

    def loss_fn(forward, _):
        logprobs = module.shifted_logprobs(forward(packed, cu_seqlens), packed, cu_seqlens)
        return -logprobs.mean(), {}

    engine.train_microbatches([None], loss_fn)  # warm-up: gradients, optimizer state, compile
    meter = PeakMemory(torch.device("cpu"))
    meter.start()
    started = time.perf_counter()
    engine.train_microbatches([None], loss_fn)
    seconds = time.perf_counter() - started
    memory = meter.stop()
    activations = memory.peak_bytes - memory.live_at_start_bytes
    return {"activation_mb": activations / 2**20, "kb_per_token": activations / tokens / 1024,
            "live_at_start_mb": memory.live_at_start_bytes / 2**20, "step_s": seconds,
            "tokens": tokens, "layers": module.config.num_hidden_layers,
            "hidden": module.config.hidden_size}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    shared = ["--work-dir", args.work_dir, "--size", args.size, "--num-seqs",
              str(args.num_seqs), "--seq-len", str(args.seq_len)]
    if args.layers:
        shared += ["--layers", str(args.layers)]
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            command = [sys.executable, __file__, "--measure", *shared, *MODES[mode]]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[mode].append(json.loads(output.strip().splitlines()[-1]))
    first = next(iter(results.values()))[0]
    print(f"model {args.size}: {first['layers']} layers, hidden {first['hidden']}; "
          f"{first['tokens']} tokens per micro-batch; medians of {args.repeats}")
    print("| mode | activation memory (MB) | KB per token | train step (s) |")
    print("| --- | --- | --- | --- |")
    for mode, runs in results.items():
        memory = statistics.median(r["activation_mb"] for r in runs)
        per_token = statistics.median(r["kb_per_token"] for r in runs)
        seconds = statistics.median(r["step_s"] for r in runs)
        print(f"| {mode} | {memory:.1f} | {per_token:.1f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
