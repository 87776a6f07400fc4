"""Eager vs compiled blocks (`actor.compile=true`) for the packed training/inference forward.

Loads the `bench_setup.py` "small" model twice, compiles the blocks of one copy
(`realrl.models.compiled`), and times a packed forward + backward (`module(ids, cu_seqlens)`,
`.log_softmax(-1).mean().backward()`) and a no-grad forward of both copies, alternating
within each repeat so that background load affects them alike. The first compiled calls
(forward + backward, then inference) are timed on their own: that is the one-off compile.
`--fresh-cache` points inductor at an empty cache directory, so the compile is a cold one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train_compile.py --threads 1
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import write_benchmark_model  # noqa: E402

from realrl.models.checkpoint import load_pretrained  # noqa: E402
from realrl.models.compiled import enable_compiled_blocks  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9, help="Measured repeats (after warm-up).")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--fresh-cache", action="store_true", help="Empty inductor cache.")
    return parser.parse_args(argv)


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    torch.set_num_threads(args.threads)
    model_dir = write_benchmark_model(Path(args.work_dir) / "model-small", "small")
    dtype = getattr(torch, args.dtype)
    eager, compiled = (load_pretrained(model_dir, dtype=dtype) for _ in range(2))
    enable_compiled_blocks(compiled, "actor.compile")
    total = args.num_seqs * args.seq_len
    packed_input_ids = torch.randint(0, compiled.config.vocab_size, (total,))  # [total_tokens]
    cu_seqlens = torch.arange(0, total + 1, args.seq_len, dtype=torch.int32)

    def train(model):
        model.zero_grad(set_to_none=True)
        model(packed_input_ids, cu_seqlens).float().log_softmax(-1).mean().backward()

    def infer(model):
        with torch.no_grad():
            model(packed_input_ids, cu_seqlens)

    print(f"{args.threads} thread(s), {args.dtype}, {args.num_seqs} x {args.seq_len} tokens")
    print(f"first compiled forward + backward (compiles): {timed(lambda: train(compiled)):.1f} s")
    print(f"first compiled no-grad forward (compiles):    {timed(lambda: infer(compiled)):.1f} s")
    for _ in range(2):  # warm-up
        for model in (eager, compiled):
            train(model)
            infer(model)
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, model in (("eager", eager), ("compiled", compiled)):
            times.setdefault(f"{name} train", []).append(timed(functools.partial(train, model)))
            times.setdefault(f"{name} infer", []).append(timed(functools.partial(infer, model)))
    for kind in ("train", "infer"):
        medians = [statistics.median(times[f"{name} {kind}"]) for name in ("eager", "compiled")]
        spread = ", ".join(
            f"{name} {min(times[f'{name} {kind}']):.3f}-{max(times[f'{name} {kind}']):.3f}"
            for name in ("eager", "compiled")
        )
        print(
            f"{'forward + backward' if kind == 'train' else 'no-grad forward':<18} median "
            f"eager {medians[0]:.3f} s, compiled {medians[1]:.3f} s "
            f"({medians[0] / medians[1]:.2f}x; range {spread})"
        )


if __name__ == "__main__":
    main()
