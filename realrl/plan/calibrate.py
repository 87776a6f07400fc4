"""Measure this machine's CPU for the plan search's cost model (run in its own process).

    python -m realrl.plan.calibrate --threads 1     # prints one JSON line

The launcher never imports torch, so `realrl.plan.devices.cpu_profile` runs this module as a
subprocess and caches its line per machine and thread count (~10 s in all). What it
measures, the first three the fastest of a few repeats after a warm-up (the fastest, because
other processes on a shared machine only ever slow a repeat down):

- ``matmul_<dtype>_flops_per_s``: a [512, 1024] x [1024, 1024] matmul (the size of a small
  model's packed-token projections);
- ``copy_bytes_per_s``: a 64 MB tensor copy (read + write counted), the decode loop's bound;
- ``layer_overhead_s``: one transformer layer's worth of small ops (~16 kernels on [4, 64]
  rows), the fixed cost that dominates decoding tiny models on a CPU;
- ``gloo_latency_s`` and ``gloo_bandwidth_bytes_per_s``: a two-process gloo all-reduce over
  loopback, as tensor- and data-parallel ranks of one machine run it: the median of small
  (8 KB) all-reduces, which take two ring steps of latency each, and of 8 MB ones for the
  bandwidth. A median, not the fastest: every exchange waits until both processes are
  scheduled, and that wait is part of what a run pays.

The runtime's own costs per call (requests, packing, the decode loop's Python) are not
measured here: `python -m realrl.apps.profile_plan` measures them in short real runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from realrl.api.ports import free_port


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


SMALL_ALL_REDUCE_VALUES = 2048  # 8 KB of fp32: a decode step's [rows, h] activations
LARGE_ALL_REDUCE_VALUES = 2 * 1024 * 1024  # 8 MB: a small model's gradients


def _gloo_rank(rank: int, port: int, threads: int, results) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        timings = {}
        for name, values, repeats in (("small", SMALL_ALL_REDUCE_VALUES, 200),
                                      ("large", LARGE_ALL_REDUCE_VALUES, 10)):
            tensor = torch.ones(values)
            for _ in range(3):
                dist.all_reduce(tensor)
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                samples.append(time.perf_counter() - start)
            timings[name] = statistics.median(samples)
        if rank == 0:
            results.put(timings)
    finally:
        dist.destroy_process_group()


def gloo_all_reduce(threads: int) -> dict:
    """Latency and bandwidth of a two-process gloo ring on this machine (see the docstring)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_gloo_rank, args=(rank, port, threads, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        timings = results.get(timeout=120)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return gloo_link(timings["small"], timings["large"])


def gloo_link(small_s: float, large_s: float) -> dict:
    """The profile's gloo keys from the median small (8 KB) and large (8 MB) all-reduce."""
    # A ring all-reduce of n = 2 ranks: 2 steps, each moving half the bytes (costs.py).
    latency = small_s / 2
    # On a loaded machine the two medians can come from different moments; the bytes never
    # take less than half the large all-reduce's time (a 2-step ring of 8 MB is no latency).
    transfer = max(large_s - 2 * latency, large_s / 2)
    return {"gloo_latency_s": latency,
            "gloo_bandwidth_bytes_per_s": LARGE_ALL_REDUCE_VALUES * 4 / transfer}


def measure(threads: int) -> dict:
    torch.set_num_threads(threads)
    return {
        "threads": threads,
        "matmul_float32_flops_per_s": _matmul_flops(torch.float32),
        "matmul_bfloat16_flops_per_s": _matmul_flops(torch.bfloat16),
        "copy_bytes_per_s": _copy_bytes_per_s(),
        "layer_overhead_s": _layer_overhead_s(),
        **gloo_all_reduce(threads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.threads)))


if __name__ == "__main__":
    main()
