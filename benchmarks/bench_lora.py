"""LoRA (`actor.lora.rank`) against full fine-tuning: memory and train-step time, on CPU.

Each mode runs in a fresh process: the `bench_setup.py` model (default the Qwen2.5-0.5B shape,
random weights, `--layers` of its 24 layers) in a `TorchEngine` with the torch optimizer
backend, as a PPO actor and its reference are held: the trained actor plus, for full
fine-tuning, a frozen copy of the weights as the reference; with LoRA the reference is the
actor's base (`realrl.models.lora.base_view`), so it adds nothing. One micro-batch of
`--num-seqs` x `--seq-len` tokens, a next-token loss through the log-probs; one warm-up step,
then `--steps` measured ones. Reported, from the tensors themselves after the last step:
parameters held (actor + reference), gradients, optimizer state (AdamW's moments, and the
fp32 masters of a bf16 model), their sum; the call's resident-set peak growth (the model
worker's meter) and the median step time, wall-clock and the process's CPU time (one thread:
the CPU time is the step's own compute, whatever else the machine runs). `--full-size` adds the same tensor accounting for
the model with all of its layers, counted on the meta device (nothing allocated).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora.py --layers 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("full", "lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench")
    parser.add_argument("--size", default="qwen2.5-0.5b", help="bench_setup.MODEL_SIZES key")
    parser.add_argument("--layers", type=int, default=None, help="Override the size's layers.")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank).")
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--full-size", action="store_true",
                        help="Also count the tensors of the size's full layer count (meta).")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_accounting(module, engine, with_reference: bool) -> dict:
    """Bytes of what a trained actor and its reference hold, from the live tensors; with
    `with_reference` (full fine-tuning) the reference is a frozen copy of every weight."""
    import torch

    parameters = list(module.parameters())
    backend = engine.backend
    masters = backend.master_weights.masters if backend.master_weights is not None else []
    holders = masters or [p for p in parameters if p.requires_grad]
    state = [t for s in engine.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    weights = _bytes(parameters)
    accounting = {
        "parameters": sum(p.numel() for p in parameters),
        "trainable": sum(p.numel() for p in parameters if p.requires_grad),
        "weights_bytes": weights,
        "reference_bytes": weights if with_reference else 0,
        "gradient_bytes": _bytes(h.grad for h in holders if h.grad is not None),
        "optimizer_bytes": _bytes(state) + _bytes(masters),
    }
    accounting["total_bytes"] = sum(accounting[key] for key in (
        "weights_bytes", "reference_bytes", "gradient_bytes", "optimizer_bytes"))
    return accounting


def meta_accounting(shape: dict, vocab_size: int, dtype, rank: int) -> dict[str, dict]:
    """The same accounting for a model of `shape` on the meta device: what `measure` would
    report after a step (gradients and AdamW state exist for every trained tensor)."""
    import torch

    from realrl.api.lora import LoRAConfig
    from realrl.launcher.defaults import DEFAULT_ARCHITECTURE
    from realrl.models.config import ModelConfig
    from realrl.models.lora import add_adapters
    from realrl.models.transformer import Transformer

    full = {**DEFAULT_ARCHITECTURE, "vocab_size": vocab_size, **shape}
    config = ModelConfig(**{key: full[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads")}, tie_word_embeddings=True, qkv_bias=True,
        model_type="qwen2")
    results = {}
    for mode in MODES:
        with torch.device("meta"):
            module = Transformer(config).to(dtype)
            if mode == "lora":
                add_adapters(module, LoRAConfig(rank=rank), seed=0)
        size = dtype.itemsize
        trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
        weights = sum(p.numel() for p in module.parameters()) * size
        masters = trained * 4 if dtype != torch.float32 else 0
        results[mode] = {
            "parameters": sum(p.numel() for p in module.parameters()), "trainable": trained,
            "weights_bytes": weights, "reference_bytes": weights if mode == "full" else 0,
            "gradient_bytes": trained * 4, "optimizer_bytes": trained * 8 + masters,
        }
        results[mode]["total_bytes"] = sum(results[mode][key] for key in (
            "weights_bytes", "reference_bytes", "gradient_bytes", "optimizer_bytes"))
    return results


def measure(args: argparse.Namespace) -> dict:
    """One mode, in this process."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_setup import MODEL_SIZES

    from realrl.api.experiment import OptimizerConfig
    from realrl.api.lora import LoRAConfig
    from realrl.backends.torch_engine import ParallelContext, TorchEngine
    from realrl.launcher.defaults import DEFAULT_ARCHITECTURE, fresh_default_model
    from realrl.models.checkpoint import load_pretrained
    from realrl.models.lora import add_adapters
    from realrl.workers.memory_watch import PeakMemory

    torch.set_num_threads(1)
    shape = dict(MODEL_SIZES[args.size])
    shape["num_hidden_layers"] = args.layers or shape["num_hidden_layers"]
    directory = Path(args.work_dir) / f"model-{args.size}-{shape['num_hidden_layers']}-layers"
    dtype = getattr(torch, args.dtype)
    module = load_pretrained(fresh_default_model(directory, 0, {**DEFAULT_ARCHITECTURE, **shape}),
                             dtype=dtype)
    if args.mode == "lora":
        add_adapters(module, LoRAConfig(rank=args.rank), seed=0)
    engine = TorchEngine(module, None, ParallelContext(), OptimizerConfig(lr=1e-4), 10)
    generator = torch.Generator().manual_seed(0)
    tokens = args.num_seqs * args.seq_len
    packed = torch.randint(0, module.config.vocab_size, (tokens,), generator=generator)
    cu_seqlens = torch.arange(0, tokens + 1, args.seq_len, dtype=torch.int32)

    def loss_fn(forward, _):
        logprobs = module.shifted_logprobs(forward(packed, cu_seqlens), packed, cu_seqlens)
        return -logprobs.mean(), {}

    engine.train_microbatches([None], loss_fn)  # warm-up: gradients and optimizer state exist
    meter = PeakMemory(torch.device("cpu"))
    meter.start()
    seconds, cpu_seconds = [], []
    for _ in range(args.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        engine.train_microbatches([None], loss_fn)
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - cpu_started)
    memory = meter.stop()
    return {**tensor_accounting(module, engine, with_reference=args.mode == "full"),
            "step_s": statistics.median(seconds), "cpu_s": statistics.median(cpu_seconds),
            "tokens": tokens,
            "peak_growth_bytes": memory.peak_bytes - memory.live_at_start_bytes,
            "layers": module.config.num_hidden_layers, "vocab_size": module.config.vocab_size}


def _mb(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode:
        print(json.dumps(measure(args)))
        return
    shared = ["--work-dir", args.work_dir, "--size", args.size, "--dtype", args.dtype,
              "--rank", str(args.rank), "--num-seqs", str(args.num_seqs),
              "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    if args.layers:
        shared += ["--layers", str(args.layers)]
    results = {}
    for mode in args.modes:
        command = [sys.executable, __file__, "--mode", mode, *shared]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
    first = next(iter(results.values()))
    print(f"model {args.size}, {first['layers']} layers, {args.dtype}, LoRA rank {args.rank}; "
          f"{first['tokens']} tokens per step, median of {args.steps} steps")
    print("| mode | parameters (trainable) | weights + reference MB | gradients MB | "
          "optimizer MB | total MB | step's peak growth MB | step s (CPU s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        print(f"| {mode} | {r['parameters'] / 1e6:.1f}M ({r['trainable'] / 1e6:.2f}M) | "
              f"{_mb(r['weights_bytes'])} + {_mb(r['reference_bytes'])} | "
              f"{_mb(r['gradient_bytes'])} | {_mb(r['optimizer_bytes'])} | "
              f"{_mb(r['total_bytes'])} | {_mb(r['peak_growth_bytes'])} | {r['step_s']:.2f} ({r['cpu_s']:.2f}) |")
    if args.full_size:
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_setup import MODEL_SIZES

        counted = meta_accounting(MODEL_SIZES[args.size], first["vocab_size"],
                                  getattr(torch, args.dtype), args.rank)
        print(f"\nall {MODEL_SIZES[args.size]['num_hidden_layers']} layers, counted:")
        for mode, r in counted.items():
            print(f"| {mode} | {r['parameters'] / 1e6:.1f}M ({r['trainable'] / 1e6:.2f}M) | "
                  f"{_mb(r['weights_bytes'])} + {_mb(r['reference_bytes'])} | "
                  f"{_mb(r['gradient_bytes'])} | {_mb(r['optimizer_bytes'])} | "
                  f"{_mb(r['total_bytes'])} | | |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
