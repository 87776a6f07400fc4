"""Shared pieces of the RL-step benchmarks: the fixed model, prompts, reward, FLOPs and meters.

Every system under test (realrl through its CLI, the hand-written loop, TRL) reads the same
files written here, so they start from identical weights, prompts and tokenizer:

- `write_benchmark_model(dir, size)`: a Qwen2-architecture model built from a config with a
  fixed seed and realrl's character tokenizer (vocab 55). "small" has 3.95M parameters.
- `write_prompt_file(path)`: 3-digit additions such as `"876+141="` (8 tokens each), so every
  prompt has the same length and no system pads.
- `arithmetic_reward`: 1.0 when the decoded response (up to EOS) equals the answer.

FLOP accounting (Kaplan et al. 2020, eq. 2.1 / table 1): a forward pass costs about
`2 * N` FLOPs per token, where `N` counts the weights that take part in matrix multiplies
(all linear layers and the LM head; the embedding lookup is free), plus `4 * L * d * ctx` for
attention scores and values; a backward costs twice the forward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_SIZES = {
    # 3.95M parameters: the "4M-parameter Qwen2-architecture model".
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=5,
                  num_attention_heads=4, num_key_value_heads=2),
    # 15.8M parameters, 4x "small", for reallocation-vs-size measurements.
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=5,
                   num_attention_heads=8, num_key_value_heads=4),
    # Shaped like Qwen2.5-0.5B and -1.5B (their config.json: 0.49B and 1.54B parameters with the
    # 151,936-token vocabulary), random weights, realrl's character tokenizer.
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    # Shaped like Qwen3-0.6B and -1.7B (their config.json: 0.60B and 1.72B parameters with the
    # 151,936-token vocabulary; 16 query heads of 128 against a hidden size of 1024 / 2048).
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0),
}


def write_benchmark_model(directory: str | Path, size: str = "small", seed: int = 0) -> Path:
    """Write the benchmark model in Hugging Face format (idempotent for a given directory).

    `python benchmarks/bench_setup.py DIR --size qwen2.5-0.5b` does it from a shell."""
    from realrl.launcher.defaults import DEFAULT_ARCHITECTURE, fresh_default_model

    return fresh_default_model(directory, seed, {**DEFAULT_ARCHITECTURE, **MODEL_SIZES[size]})


def write_prompt_file(path: str | Path, num_prompts: int = 512, seed: int = 0) -> Path:
    """Fixed-length arithmetic prompts in realrl's prompt JSONL format."""
    from realrl.datasets.arithmetic import make_arithmetic_records, write_jsonl

    path = Path(path)
    records = make_arithmetic_records(num_prompts, seed, min_digits=3, max_digits=3, ops=("+",))
    write_jsonl(records, path)
    return path


def baseline_arguments(description: str, argv: list[str] | None = None,
                       gpu: bool = False) -> argparse.Namespace:
    """The command line that `bench_rl_step.py` gives every baseline script; with `gpu`, also
    `--device` and `--micro-batch` (the baselines that run on a GPU)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="HF checkpoint directory.")
    parser.add_argument("--prompts", required=True, help="Prompt JSONL (prompt, answer).")
    parser.add_argument("--output", required=True, help="Per-step timings, JSON lines.")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--fixed-length", action="store_true",
                        help="Every response max_new_tokens long (token parity).")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    if gpu:
        parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        parser.add_argument("--micro-batch", type=int, default=0,
                            help="Completions per forward/backward, the batch's gradients "
                                 "accumulated over them (one optimizer step per batch); 0: the "
                                 "whole batch.")
    return parser.parse_args(argv)


def read_prompts(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 for an exact answer (text before EOS, stripped), else 0.0."""
    return 1.0 if response.split("<eos>")[0].strip() == answer else 0.0


@dataclass
class ModelShape:
    matmul_params: int  # weights in linear layers and the LM head
    num_layers: int
    query_width: int  # heads x head_dim: what a token's attention scores and sums multiply

    @classmethod
    def from_config_dir(cls, directory: str | Path) -> ModelShape:
        config = json.loads((Path(directory) / "config.json").read_text())
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        # Qwen3 and others: head_dim apart from hidden / heads (Qwen3-0.6B: 16 x 128 vs 1024)
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        query_width = config["num_attention_heads"] * head_dim
        kv_width = config["num_key_value_heads"] * head_dim
        attention = hidden * query_width * 2 + hidden * kv_width * 2  # q, o, k, v
        mlp = 3 * hidden * config["intermediate_size"]
        lm_head = hidden * config["vocab_size"]
        return cls(layers * (attention + mlp) + lm_head, layers, query_width)

    def forward_flops(self, num_tokens: int, mean_context: float) -> float:
        return 2.0 * self.matmul_params * num_tokens + (
            4.0 * self.num_layers * self.query_width * mean_context * num_tokens)


def rl_step_flops(shape: ModelShape, num_seqs: int, prompt_len: int, response_len: float,
                  num_forward_passes: int, num_trained_models: int) -> float:
    """Model FLOPs of one RL step: generation + extra forward passes + forward/backward."""
    seq_len = prompt_len + response_len
    generation = shape.forward_flops(int(num_seqs * seq_len), seq_len / 2)
    forward = shape.forward_flops(int(num_seqs * seq_len), seq_len / 2)
    return generation + num_forward_passes * forward + num_trained_models * 3.0 * forward


def measure_matmul_gflops(dtype: torch.dtype, size: int = 1024, seconds: float = 1.0,
                          device: str = "cpu") -> float:
    """Best-of-repeats square matmul throughput: on CPU with the current torch thread count,
    on CUDA (`device="cuda"`, use `size=8192`) with torch's default matmul precision."""
    left = torch.randn(size, size, dtype=dtype, device=device)
    right = torch.randn(size, size, dtype=dtype, device=device)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    left @ right  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        synchronize()
        started = time.perf_counter()
        for _ in range(4):
            left @ right
        synchronize()
        elapsed = time.perf_counter() - started
        best = max(best, 4 * 2.0 * size**3 / elapsed / 1e9)
    return best


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def _peak_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class ProcessTreeMemory:
    """Peak resident memory summed over a process and all its descendants.

    A background thread reads every descendant's VmHWM (its own high-water mark) from /proc
    a few times a second; the result is the sum of the last values seen per process, so a
    process that grows after the last sample and then exits is under-counted by that growth.
    """

    def __init__(self, root_pid: int, interval_s: float = 0.2) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.peak_kib: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ProcessTreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            tree = _children_of()
            pending = [self.root_pid]
            while pending:
                pid = pending.pop()
                peak = _peak_rss_kib(pid)
                if peak is not None:
                    self.peak_kib[pid] = max(peak, self.peak_kib.get(pid, 0))
                pending.extend(tree.get(pid, []))
            self._stop.wait(self.interval_s)

    @property
    def total_mib(self) -> float:
        return sum(self.peak_kib.values()) / 1024


def median_and_spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def load_average() -> float:
    return os.getloadavg()[0]


def _cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat's ``cpu`` line (Linux;
    the fields user nice system idle iowait irq softirq steal)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[7], sum(fields)


class StealMeter:
    """The fraction of the CPUs' time the hypervisor gave to other guests (steal time) while
    the block ran: on a shared virtual machine the same run takes longer the more is stolen
    (on this 2-core machine 3-25% within a minute), which a load average does not show.
    ``fraction`` is None where /proc/stat is not readable."""

    fraction: float | None = None

    def __enter__(self) -> StealMeter:
        self._start = _cpu_ticks() if Path("/proc/stat").is_file() else None
        return self

    def __exit__(self, *exc_info) -> None:
        if self._start is not None:
            steal, total = _cpu_ticks()
            elapsed = total - self._start[1]
            self.fraction = (steal - self._start[0]) / elapsed if elapsed > 0 else 0.0


REPO_ROOT = Path(__file__).resolve().parent.parent


def run_quickstart(experiment: str, overrides: list[str], run_dir: Path, log_file: Path,
                   timeout_s: float) -> list[dict]:
    """Run `python -m realrl.apps.quickstart <experiment> <overrides>` from the repository
    root, its output in `log_file`; the metrics.jsonl records of `run_dir` (the run directory
    the overrides name). A failed run raises, naming its log."""
    command = [sys.executable, "-m", "realrl.apps.quickstart", experiment, *overrides]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        completed = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   timeout=timeout_s)
    if completed.returncode != 0:
        raise RuntimeError(f"{run_dir.name} exited with {completed.returncode}; see {log_file}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a benchmark model (random weights).")
    parser.add_argument("directory")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    print(write_benchmark_model(arguments.directory, arguments.size, arguments.seed))
