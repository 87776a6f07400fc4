"""Peak memory of the LM head's log-probs, whole logits against the fused head (issue 23 item 3).

Both paths in one run, each measurement in a fresh process (one path's freed memory must not
hide the other's need). A random model shaped like the issue's case (default: 55M parameters,
a 32,000-token vocabulary, untied head, fp32) in a `TorchEngine`, and one micro-batch of
`--num-seqs` x `--seq-len` tokens (default 16 x 256). Two calls, each run once to warm up and
once measured:

- `train`: one actor train step (forward, a PPO-style loss of the log-probs, with the entropy
  logged, backward, AdamW step), as `realrl.interfaces.ppo_actor` runs it;
- `logprobs`: one no-grad forward and the log-probs, as `ref_inf` / `actor_inf` run it.

Paths: `whole_logits` applies the LM head to all tokens and reads the log-probs and entropy off
the [tokens, vocab] logits with `realrl.algo.layout` (what the interfaces did before); `fused`
is `Transformer.shifted_logprobs(_and_entropy)` on the hidden states (`realrl.models.lm_head`).
Memory is the model worker's own meter (`realrl.workers.memory_watch.PeakMemory`): on CPU the
resident-set peak of the call, on CUDA `torch.cuda.max_memory_allocated`; reported as the
call's peak and its growth over what was live at its start (weights, optimizer state).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lm_head_memory.py --device cpu
    .venv/bin/python benchmarks/bench_lm_head_memory.py --device cuda --dtype bfloat16
    .venv/bin/python benchmarks/bench_lm_head_memory.py --device cuda --dtype bfloat16 \
        --preset qwen2.5-0.5b --num-seqs 64 --seq-len 140
    # the default small model (vocab 55): step time before/after
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lm_head_memory.py --preset small
    # time and memory against the chunk size (logits per chunk; default `realrl.algo.layout`'s)
    .venv/bin/python benchmarks/bench_lm_head_memory.py --device cuda --chunk-elements 67108864
    # the head alone (forward + backward of log-probs and entropy) against the chunk size:
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lm_head_memory.py --chunk-sweep \
        --vocab-size 32000 --num-seqs 4 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PATHS = ("whole_logits", "fused")
CALLS = ("train", "logprobs")
PRESETS = {
    # The case: 55.2M parameters (untied 32k vocabulary: 32.8M of them in the head and
    # the embedding).
    "issue": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=4,
                  tie_word_embeddings=False),
    # bench_setup.py's "small" default model with realrl's character tokenizer (vocab 55).
    "small": dict(vocab_size=55, hidden_size=256, intermediate_size=768,
                  num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False),
    # Qwen2.5-0.5B's shape (bench_setup.py), tied 151,936-token vocabulary: for a GPU.
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, qkv_bias=True, model_type="qwen2"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--preset", default="issue", choices=sorted(PRESETS))
    parser.add_argument("--vocab-size", type=int, default=None, help="Override the preset's.")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="Fresh processes per measurement.")
    parser.add_argument("--chunk-elements", type=int, default=None,
                        help="Logits per chunk, in place of realrl.algo.layout's rule (both "
                        "paths; no minimum of rows).")
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    parser.add_argument("--chunk-sweep", action="store_true",
                        help="Time the head alone at logits per chunk 2^18..2^26 (hidden 256).")
    parser.add_argument("--measure", nargs=2, metavar=("PATH", "CALL"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_engine(args: argparse.Namespace):
    import torch

    from realrl.api.experiment import OptimizerConfig
    from realrl.backends.torch_engine import ParallelContext, TorchEngine
    from realrl.models.config import ModelConfig
    from realrl.models.transformer import Transformer

    shape = dict(PRESETS[args.preset])
    shape["vocab_size"] = args.vocab_size or shape["vocab_size"]
    torch.manual_seed(0)
    with torch.device(args.device):
        module = Transformer(ModelConfig(**shape))
    module = module.to(getattr(torch, args.dtype))
    optimizer = OptimizerConfig(lr=1e-5) if args.measure[1] == "train" else None
    return TorchEngine(module, None, ParallelContext(), optimizer, 10)


def read_off(module, path: str, hidden, packed, cu_seqlens):
    """Log-probs and the (logged, detached) entropy, [tokens - num_seqs] each, by `path`."""
    from realrl.algo.layout import packed_entropy, packed_shifted_logprobs

    if path == "fused":
        logprobs, entropy = module.shifted_logprobs_and_entropy(hidden, packed, cu_seqlens)
        return logprobs, entropy.detach()
    logits = module.head(hidden, gather_vocab=False)  # [tokens, vocab]
    return packed_shifted_logprobs(logits, packed, cu_seqlens), packed_entropy(
        logits.detach(), cu_seqlens
    )


def measure(args: argparse.Namespace) -> dict:
    """One (path, call) in this process: the measured call's memory and time."""
    import torch

    from realrl.workers.memory_watch import PeakMemory

    path, call = args.measure
    if args.chunk_elements:
        from realrl.algo import layout

        layout._LOGIT_CHUNK_ELEMENTS = args.chunk_elements
        layout._MIN_CHUNK_ROWS = layout._MIN_CHUNK_ROWS_CUDA = 1
    engine = build_engine(args)
    module, device = engine.module, torch.device(args.device)
    tokens = args.num_seqs * args.seq_len
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, module.config.vocab_size, (tokens,), generator=generator).to(device)
    cu_seqlens = torch.arange(0, tokens + 1, args.seq_len, dtype=torch.int32, device=device)
    advantages = torch.randn(tokens - args.num_seqs, generator=generator).to(device)

    def loss_fn(forward, _):
        logprobs, entropy = read_off(module, path, forward(packed, cu_seqlens), packed, cu_seqlens)
        return -(logprobs * advantages).mean(), {"entropy": entropy.mean()}

    def run() -> None:
        if call == "train":
            engine.train_microbatches([None], loss_fn)
        else:
            with torch.no_grad():
                read_off(module, path, engine.forward(packed, cu_seqlens), packed, cu_seqlens)

    run()  # warm-up: gradients, optimizer state, first-touch pages, kernels
    meter = PeakMemory(device)
    meter.start()
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    memory = meter.stop()
    return {"peak_mb": memory.peak_bytes / 2**20,
            "growth_mb": (memory.peak_bytes - memory.live_at_start_bytes) / 2**20,
            "seconds": seconds, "tokens": tokens, "vocab_size": module.config.vocab_size,
            "parameters": sum(p.numel() for p in module.parameters())}


def chunk_sweep(args: argparse.Namespace, passes: int = 5) -> dict:
    """Seconds (best of `passes` alternating passes) of one forward and backward of log-probs
    and entropy at each chunk size, fused and from whole logits."""
    import torch

    from realrl.algo import layout
    from realrl.models.lm_head import lm_head_logprobs

    vocab_size, tokens = args.vocab_size or 32000, args.num_seqs * args.seq_len
    torch.manual_seed(0)
    hidden = (0.5 * torch.randn(tokens, 256, device=args.device)).requires_grad_()
    weight = (0.05 * torch.randn(vocab_size, 256, device=args.device)).requires_grad_()
    packed = torch.randint(0, vocab_size, (tokens,), device=args.device)
    cu_seqlens = torch.arange(0, tokens + 1, args.seq_len, device=args.device)

    def fused() -> None:
        logprobs, entropy = lm_head_logprobs(hidden, weight, packed, cu_seqlens, with_entropy=True)
        (logprobs.sum() + 0.01 * entropy.sum()).backward()

    def whole_logits() -> None:
        logits = hidden @ weight.T
        logprobs = layout.packed_shifted_logprobs(logits, packed, cu_seqlens)
        (logprobs.sum() + 0.01 * layout.packed_entropy(logits, cu_seqlens).sum()).backward()

    layout._MIN_CHUNK_ROWS = layout._MIN_CHUNK_ROWS_CUDA = 1
    best: dict[str, float] = {}
    for _ in range(passes):
        for exponent in (18, 20, 22, 24, 26, "whole_logits"):
            layout._LOGIT_CHUNK_ELEMENTS = 2**24 if exponent == "whole_logits" else 2**exponent
            started = time.perf_counter()
            whole_logits() if exponent == "whole_logits" else fused()
            if args.device == "cuda":
                torch.cuda.synchronize()
            name = str(exponent) if exponent == "whole_logits" else f"2^{exponent}"
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
    rows = {f"2^{e}": min(tokens, max(1, 2**e // vocab_size)) for e in (18, 20, 22, 24, 26)}
    return {"vocab_size": vocab_size, "tokens": tokens, "hidden": 256, "best_seconds": best,
            "rows_per_chunk": rows}


def environment(device: str) -> dict:
    import platform

    import torch

    info = {"torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if args.chunk_sweep:
        print(json.dumps(chunk_sweep(args), indent=2))
        return
    shared = [a for a in (argv if argv is not None else sys.argv[1:])
              if a not in ("--output", args.output)]
    runs: dict[str, dict[str, list[dict]]] = {c: {p: [] for p in PATHS} for c in CALLS}
    for _ in range(args.repeats):
        for call in CALLS:
            for path in PATHS:
                command = [sys.executable, __file__, *shared, "--measure", path, call]
                output = subprocess.run(command, check=True, capture_output=True, text=True)
                runs[call][path].append(json.loads(output.stdout.strip().splitlines()[-1]))
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("measure", "output")},
              "environment": environment(args.device), "calls": {}}
    for call, by_path in runs.items():
        medians = {path: {key: statistics.median(r[key] for r in rs)
                          for key in ("peak_mb", "growth_mb", "seconds")}
                   for path, rs in by_path.items()}
        first = by_path["fused"][0]
        medians["fused_over_whole_logits"] = {
            key: medians["fused"][key] / max(medians["whole_logits"][key], 1e-9)
            for key in ("peak_mb", "growth_mb", "seconds")
        }
        result["calls"][call] = medians
        result["tokens"], result["vocab_size"] = first["tokens"], first["vocab_size"]
        result["parameters"] = first["parameters"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
