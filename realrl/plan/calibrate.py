"""Measure this machine's CPU for the plan search's cost model (run in its own process).

    python -m realrl.plan.calibrate --threads 1     # prints one JSON line

The launcher never imports torch, so `realrl.plan.devices.cpu_profile` runs this module as a
subprocess and caches its line per machine and thread count. What it measures, each the
fastest of a few repeats after a warm-up (~5 s in all; the fastest, because other processes
on a shared machine only ever slow a repeat down):

- ``matmul_<dtype>_flops_per_s``: a [512, 1024] x [1024, 1024] matmul (the size of a small
  model's packed-token projections);
- ``copy_bytes_per_s``: a 64 MB tensor copy (read + write counted), the decode loop's bound;
- ``layer_overhead_s``: one transformer layer's worth of small ops (~16 kernels on [4, 64]
  rows), the fixed cost that dominates decoding tiny models on a CPU.

Inter-process (gloo) bandwidth and latency are not measured here; `realrl.plan.devices` uses
the values measured for DESIGN.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _fastest_seconds(function, repeats: int = 5, inner: int = 1) -> float:
    function()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            function()
        samples.append((time.perf_counter() - start) / inner)
    return min(samples)


def _matmul_flops(dtype: torch.dtype) -> float:
    left = torch.randn(512, 1024, dtype=dtype)
    right = torch.randn(1024, 1024, dtype=dtype)
    seconds = _fastest_seconds(lambda: left @ right, repeats=5, inner=4)
    return 2 * 512 * 1024 * 1024 / seconds


def _copy_bytes_per_s() -> float:
    source = torch.randn(16 * 1024 * 1024)  # 64 MB
    target = torch.empty_like(source)
    seconds = _fastest_seconds(lambda: target.copy_(source), repeats=5, inner=2)
    return 2 * source.numel() * 4 / seconds


def _layer_overhead_s() -> float:
    hidden = torch.randn(4, 64)
    weight = torch.randn(64, 64)

    def layer() -> torch.Tensor:
        x = hidden
        for _ in range(4):  # attention projections, MLP: matmul + bias-free adds and norms
            y = x @ weight
            x = torch.nn.functional.silu(y) * y + x
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x

    with torch.no_grad():
        return _fastest_seconds(layer, repeats=7, inner=50)


def measure(threads: int) -> dict:
    torch.set_num_threads(threads)
    return {
        "threads": threads,
        "matmul_float32_flops_per_s": _matmul_flops(torch.float32),
        "matmul_bfloat16_flops_per_s": _matmul_flops(torch.bfloat16),
        "copy_bytes_per_s": _copy_bytes_per_s(),
        "layer_overhead_s": _layer_overhead_s(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.threads)))


if __name__ == "__main__":
    main()
