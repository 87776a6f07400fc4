"""Packed causal attention on CPU: which kernel is fastest for which batch shape.

Compares realrl's `padded`, `bucketed`, `per_sequence` and `block_diagonal` kernels (and what `auto`
picks) on forward and forward+backward, for a few packed batches shaped like RL training
batches. Medians over repeats, in milliseconds.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_attention.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from realrl.models.attention import PackedLayout, choose_kernel, varlen_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
BATCHES = {
    "64 x 32-64 tokens": lambda g: torch.randint(32, 65, (64,), generator=g),
    "16 x 64-256 tokens": lambda g: torch.randint(64, 257, (16,), generator=g),
    "uneven: 1 x 1024 + 31 x 16": lambda g: torch.tensor([1024] + [16] * 31),
    "outlier: 127 x 9-16 + 1 x 40": lambda g: torch.cat(
        [torch.randint(9, 17, (127,), generator=g), torch.tensor([40])]),
    "4 x 512 tokens": lambda g: torch.full((4,), 512),
}
KERNELS = ("padded", "bucketed", "per_sequence", "block_diagonal")


def time_kernel(kernel: str, lengths: torch.Tensor, backward: bool, repeats: int) -> float:
    total = int(lengths.sum())
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    query = torch.randn(total, HEADS, HEAD_DIM, requires_grad=backward)
    key = torch.randn(total, KV_HEADS, HEAD_DIM, requires_grad=backward)
    value = torch.randn(total, KV_HEADS, HEAD_DIM, requires_grad=backward)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        layout = PackedLayout.from_cu_seqlens(cu_seqlens)  # built per forward in the model too
        with torch.set_grad_enabled(backward):
            out = varlen_attention(query, key, value, layout, kernel=kernel)
            if backward:
                out.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(
        f"heads {HEADS}, kv heads {KV_HEADS}, head dim {HEAD_DIM}, fp32, "
        f"torch threads {torch.get_num_threads()}, median ms of {args.repeats}"
    )
    header = "".join(f"{k:>16}" for k in KERNELS)
    print(f"{'batch':<30}{'pass':<10}{header}{'auto picks':>16}")
    for name, make_lengths in BATCHES.items():
        lengths = make_lengths(generator)
        layout = PackedLayout.from_cu_seqlens(
            torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        )
        picked = choose_kernel("auto", torch.empty(int(lengths.sum()), HEADS, HEAD_DIM), layout)
        for backward in (False, True):
            row = "".join(
                f"{time_kernel(k, lengths, backward, args.repeats):>16.1f}" for k in KERNELS
            )
            print(f"{name:<30}{'fwd+bwd' if backward else 'fwd':<10}{row}{picked:>16}")


if __name__ == "__main__":
    main()
