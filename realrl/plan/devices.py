"""What one device can do, as the cost model (`realrl.plan.costs`) needs it.

Two sources:

- analytic, for hardware that is not present: datasheet peaks (dense matmul FLOP/s by
  precision, HBM bandwidth, NVLink within a node, InfiniBand between nodes) times an
  achievable fraction (``matmul_efficiency``, ``bandwidth_efficiency``);
- measured, for this machine's CPU workers: ``python -m realrl.plan.calibrate`` (a separate
  process: it imports torch, which the launcher must not) times a matmul, a memory copy and a
  small kernel on the thread count one worker gets, and the result is cached on disk per
  machine and thread count (`cpu_device`).

Units: FLOP/s, bytes, bytes/s, seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

from realrl.api import environment

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link: a transfer of ``b`` bytes takes ``latency_s + b / bandwidth``."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU worker's share of a machine) and its links."""

    name: str
    flops_per_s: dict[str, float]  # dtype ("float32", "bfloat16") -> achievable dense matmul
    memory_bytes: float  # usable per device
    memory_bandwidth_bytes_per_s: float  # achievable (weights and KV cache reads in decode)
    intra_node: Link  # between devices of one node (NVLink; gloo over shared memory on CPU)
    inter_node: Link  # between nodes (InfiniBand / Ethernet)
    host: Link  # between the master and one worker (requests and packed batches)
    kernel_overhead_s: float  # fixed cost of one transformer layer's pass (launches, Python)
    is_gpu: bool = True

    def flops(self, dtype: str) -> float:
        if dtype not in self.flops_per_s:
            raise KeyError(f"device {self.name!r} has no FLOP/s for dtype {dtype!r}; it has "
                           f"{', '.join(sorted(self.flops_per_s))}")
        return self.flops_per_s[dtype]


def _gpu(name: str, bf16_tflops: float, fp32_tflops: float, memory_gib: float, hbm_tb_s: float,
         nvlink_gb_s: float, network_gb_s: float) -> DeviceSpec:
    """A GPU from its datasheet: dense (not sparse) peaks; 55% of peak FLOP/s and 80% of peak
    bandwidth are achieved (large-matmul MFU reported by Megatron-LM; STREAM-like copies).
    NVLink: unidirectional per-GPU bandwidth; network: one NIC per GPU (GPUDirect RDMA)."""
    return DeviceSpec(
        name=name,
        flops_per_s={"bfloat16": 0.55 * bf16_tflops * 1e12,
                     "float16": 0.55 * bf16_tflops * 1e12,
                     "float32": 0.55 * fp32_tflops * 1e12},
        memory_bytes=memory_gib * GIB * 0.92,  # CUDA context, allocator fragmentation
        memory_bandwidth_bytes_per_s=0.8 * hbm_tb_s * 1e12,
        intra_node=Link(0.8 * nvlink_gb_s * 1e9, 5e-6),
        inter_node=Link(0.8 * network_gb_s * 1e9, 1.5e-5),
        host=Link(0.8 * network_gb_s * 1e9, 1e-4),  # ZeroMQ over TCP: latency dominates
        # Measured on one H100 (benchmarks/README.md, "On one GPU"): Qwen2.5-0.5B's decode
        # with CUDA graphs takes 2.7 ms a step for 24 layers, ~1.1e-4 s a layer above the
        # bytes it reads; launched without graphs, 14 ms (~6e-4 s a layer).
        kernel_overhead_s=1.1e-4,
    )


# Datasheet numbers (dense): H100 SXM5 989 TFLOP/s bf16, 67 fp32 (tf32 off), 3.35 TB/s HBM3,
# NVLink 4 450 GB/s per direction, ConnectX-7 400 Gb/s = 50 GB/s per GPU.
# A100 SXM4 80 GB: 312 bf16, 19.5 fp32, 2.04 TB/s, NVLink 3 300 GB/s, 200 Gb/s = 25 GB/s.
# H200: the H100's compute with 141 GB of 4.8 TB/s HBM3e.
ANALYTIC_DEVICES: dict[str, DeviceSpec] = {
    "h100": _gpu("h100", 989.0, 67.0, 80.0, 3.35, 450.0, 50.0),
    "h200": _gpu("h200", 989.0, 67.0, 141.0, 4.8, 450.0, 50.0),
    "a100": _gpu("a100", 312.0, 19.5, 80.0, 2.04, 300.0, 25.0),
}


def analytic_device(kind: str) -> DeviceSpec:
    if kind not in ANALYTIC_DEVICES:
        raise KeyError(f"unknown device kind {kind!r}; known: {', '.join(ANALYTIC_DEVICES)} "
                       "(or 'cpu', measured on this machine)")
    return ANALYTIC_DEVICES[kind]


def cpu_device_from_profile(profile: dict, memory_bytes: float) -> DeviceSpec:
    """A CPU worker from a calibration profile (`realrl.plan.calibrate.measure`'s keys).

    Links are gloo between processes of one machine, as the profile measured them (without
    those keys, DESIGN.md's figures: a 10 MB all-reduce between two processes ~10 ms), and
    ZeroMQ to the master (~0.5 ms a request)."""
    gloo = Link(profile.get("gloo_bandwidth_bytes_per_s", 5e8), profile.get("gloo_latency_s", 3e-4))
    return DeviceSpec(
        name=f"cpu ({profile['threads']} thread(s), measured)",
        flops_per_s={"float32": profile["matmul_float32_flops_per_s"],
                     "bfloat16": profile["matmul_bfloat16_flops_per_s"]},
        memory_bytes=memory_bytes,
        memory_bandwidth_bytes_per_s=profile["copy_bytes_per_s"],
        intra_node=gloo,
        inter_node=Link(gloo.bandwidth_bytes_per_s / 4, gloo.latency_s * 4),
        host=Link(1e9, 5e-4),
        kernel_overhead_s=profile["layer_overhead_s"],
        is_gpu=False,
    )


def machine_key(threads: int) -> str:
    """This machine's CPU model and the worker's thread count: what the profile depends on."""
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    digest = hashlib.sha256(f"{cpu_model}|{threads}".encode()).hexdigest()[:12]
    return f"cpu-{threads}t-{digest}"


# 2: the gloo all-reduce's latency and bandwidth are measured (before, assumed); a profile
# of an older version is measured again.
PROFILE_VERSION = 2


def profile_cache_path(threads: int) -> Path:
    return environment.cache_dir() / "plan" / f"{machine_key(threads)}-v{PROFILE_VERSION}.json"


def cpu_profile(threads: int, timeout_s: float = 120.0) -> dict:
    """This machine's CPU profile for a worker with `threads` threads: from the cache, or
    measured now by ``python -m realrl.plan.calibrate`` (~10 s) and cached."""
    path = profile_cache_path(threads)
    if path.is_file():
        return json.loads(path.read_text())
    logger.info("plan search: profiling this machine's CPU (%d thread(s)) once; cached in %s",
                threads, path)
    command = [sys.executable, "-m", "realrl.plan.calibrate", "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"CPU profiling failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    profile = json.loads(result.stdout.strip().splitlines()[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return profile


def cpu_device(threads: int, memory_bytes: float) -> DeviceSpec:
    return cpu_device_from_profile(cpu_profile(threads), memory_bytes)
