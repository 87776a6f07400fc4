"""Peak memory of each MFC call on a model worker, and a hint when it nears the limit.

What is measured: on CUDA, the most bytes torch's allocator held during the call
(`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`); on CPU, the process's
peak resident set during the call (`VmHWM` in /proc/self/status, reset at the call's start by
writing 5 to /proc/self/clear_refs; where that is refused, the peak since the process
started). The worker reports it as `<mfc>/peak_memory_gb` (the master keeps the largest over
the call's ranks).

The limit a worker compares with: `worker_memory_gb` if set; else on CUDA what the GPU has for
this process, read again at the end of every call (its free memory plus what this process's
allocator has reserved: memory other processes hold, such as a colocated vLLM engine's share,
`gen.vllm_gpu_memory_utilization`, or another worker's, is not this worker's); on CPU its share
of the machine, read once (the smaller of MemTotal and the cgroup's memory limit, divided by
the workers on the node).

The hint: when a call's peak passes `NEAR_LIMIT` of the limit, the worker logs once per MFC a
`<mfc>.max_tokens_per_microbatch` that would bring it to about `TARGET` of the limit, from
the bytes per token the call measured: (peak - live memory at the call's start) / the most
tokens one forward of the call ran. Live memory at the start is CUDA's allocated bytes, and
on CPU the resident set less the free memory glibc's malloc keeps for reuse
(`realrl.workers.malloc`; `mallinfo2`), since the call allocates from that first; a call that
fit in what the process held says nothing about its need and gets no hint. Measured in
`tests/workers/test_memory_watch.py`: the suggested budget took a call from 95% of its limit
to 71%. Where what was live before the call is itself past `TARGET` (weights, optimizer
state, several models on one worker), no budget helps, and the worker says so once.
Generation calls decode without the token budget and get a hint about batch size and
response length.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GIB = 2**30
NEAR_LIMIT = 0.85  # a peak above this fraction of the limit gets a hint
TARGET = 0.7  # the suggested token budget aims at this fraction of the limit
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


class _MallocInfo(ctypes.Structure):
    """glibc's `struct mallinfo2` (all arenas summed)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]


@functools.cache
def _mallinfo2():
    """glibc's `mallinfo2`, or None (another C library, or glibc < 2.33)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    function = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if function is not None:
        function.restype = _MallocInfo
    return function


def _malloc_free_bytes() -> int:
    """Bytes glibc's malloc holds free for reuse (0 where it cannot say)."""
    mallinfo2 = _mallinfo2()
    return 0 if mallinfo2 is None else int(mallinfo2().fordblks)


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status in bytes (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_resident_peak() -> bool:
    """Make VmHWM the current resident set (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_limit_bytes(device: torch.device, workers_per_node: int) -> int:
    """What one worker may use now: its GPU's free memory plus what it holds there, or its
    share of the machine's memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # the whole device's, every process counted
        return free + torch.cuda.memory_reserved(device)
    limits = [_mem_total_bytes()]
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limit for limit in limits if limit > 0) // max(1, workers_per_node)


def _mem_total_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class CallMemory:
    """One call's memory in bytes: the peak, what was live when it started, and what the
    process held then (CPU: live plus malloc's free memory; CUDA: live)."""

    peak_bytes: int
    live_at_start_bytes: int
    held_at_start_bytes: int

    @property
    def grew(self) -> bool:
        """Whether the call needed more than the process held: only then does its peak say
        how much memory it needs (a smaller call fits in memory freed by earlier ones)."""
        return self.peak_bytes > self.held_at_start_bytes


class PeakMemory:
    """Measures the peak memory of one call at a time on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._live_at_start = self._held_at_start = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._live_at_start = self._held_at_start = torch.cuda.memory_allocated(self.device)
        else:
            _reset_resident_peak()
            self._held_at_start = _status_bytes("VmRSS")
            self._live_at_start = max(0, self._held_at_start - _malloc_free_bytes())

    def stop(self) -> CallMemory:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_bytes("VmHWM")
        return CallMemory(peak, min(self._live_at_start, peak), self._held_at_start)


def suggested_token_budget(memory: CallMemory, largest_forward_tokens: int,
                           limit_bytes: int) -> int | None:
    """A token budget per micro-batch that brings the call's peak to about `TARGET` of the
    limit, in multiples of 64 tokens; None where no budget can (what was live before the call
    already exceeds that, or the call ran no forward)."""
    per_token = (memory.peak_bytes - memory.live_at_start_bytes) / max(largest_forward_tokens, 1)
    room = TARGET * limit_bytes - memory.live_at_start_bytes
    if largest_forward_tokens == 0 or per_token <= 0 or room < 64 * per_token:
        return None
    return int(room / per_token) // 64 * 64


def holds_too_much(memory: CallMemory, limit_bytes: int) -> bool:
    """What was live before the call is past the budget's target: a worker-wide problem."""
    return memory.live_at_start_bytes >= TARGET * limit_bytes


def near_limit_hint(mfc_name: str, is_generate: bool, memory: CallMemory,
                    largest_forward_tokens: int, limit_bytes: int) -> str | None:
    """The hint to log for a call whose peak passed `NEAR_LIMIT` of the limit; None below it,
    or when the call fit in memory the process held already (its need is then unknown)."""
    if memory.peak_bytes < NEAR_LIMIT * limit_bytes:
        return None
    used = (f"{mfc_name} peaked at {memory.peak_bytes / GIB:.2f} GB of this worker's "
            f"{limit_bytes / GIB:.2f} GB")
    if holds_too_much(memory, limit_bytes):
        return (f"{used}, {memory.live_at_start_bytes / GIB:.2f} GB of it held before the "
                "call (the process, its models' weights and optimizer state): no token "
                "budget helps; fewer models on this worker (allocation_mode), bfloat16 "
                "(`dtype=bfloat16`) or more workers do")
    if not memory.grew:
        return None
    if is_generate:
        return (f"{used}: generation holds a KV cache per sequence; fewer prompts per step "
                "(dataset.batch_size) or shorter responses lower it")
    budget = suggested_token_budget(memory, largest_forward_tokens, limit_bytes)
    if budget is None:
        return None
    per_token = (memory.peak_bytes - memory.live_at_start_bytes) / largest_forward_tokens
    return (f"{used} with micro-batches of up to {largest_forward_tokens} tokens "
            f"(~{per_token / 2**20:.2f} MB per token); set "
            f"`{mfc_name}.max_tokens_per_microbatch={budget}` to bring it to about "
            f"{TARGET:.0%} (the same update, in more micro-batches)")


class MemoryWatch:
    """Per worker: measures each call and logs `near_limit_hint` once per MFC (once per
    worker when what it held before the call is the problem)."""

    def __init__(self, device: torch.device, workers_per_node: int,
                 limit_bytes: int | None = None) -> None:
        self.peak = PeakMemory(device)
        self.device, self.workers_per_node = device, workers_per_node
        # What other processes hold on a GPU changes during the run; a machine's memory does not.
        if limit_bytes is None and device.type != "cuda":
            limit_bytes = memory_limit_bytes(device, workers_per_node)
        self.fixed_limit = limit_bytes
        self.hinted: set[str] = set()

    @property
    def limit_bytes(self) -> int:
        return self.fixed_limit or memory_limit_bytes(self.device, self.workers_per_node)

    def start(self, engine) -> None:
        if engine is not None:
            engine.largest_forward_tokens = 0
        self.peak.start()

    def stop(self, mfc_name: str, is_generate: bool, engine) -> float:
        """The call's peak in GB; logs the hint the first time this MFC nears the limit."""
        memory = self.peak.stop()
        tokens = getattr(engine, "largest_forward_tokens", 0)
        limit = self.limit_bytes
        key = "held" if holds_too_much(memory, limit) else mfc_name
        if key not in self.hinted:
            hint = near_limit_hint(mfc_name, is_generate, memory, tokens, limit)
            if hint is not None:
                self.hinted.add(key)
                logger.warning(hint)
        return memory.peak_bytes / GIB
