"""Test-only: run megatron-core's DDP and distributed optimizer on CPU ranks (gloo).

megatron-core's `DistributedDataParallel` and optimizers assume CUDA: they allocate with
`device=torch.cuda.current_device()` or `device='cuda'` literals, and the optimizers check
`tensor.type() == 'torch.cuda.FloatTensor'`. Their multi-rank logic (bucketing, reduce-scatter,
sharded fp32 masters, clipping over shards, the parameter all-gather) does not depend on the
device, so tests exercise it on CPU under `cuda_to_cpu()`, which, while active, makes

- `torch.cuda.current_device()` return "cpu", `synchronize` a no-op and `current_stream()` a
  stream whose waits do nothing (level 1 of `../shared/research/megatron-core-on-cpu.md`);
- every torch call with `device='cuda'` (or a device index) allocate on the CPU instead
  (level 2, a `TorchFunctionMode`);
- `Tensor.type()` name CPU tensors as their CUDA type, as the optimizers expect.

megatron-core's sequence-parallel mappings and linears (`<role>.sequence_parallel`) allocate
their gather and reduce-scatter outputs with `device=torch.cuda.current_device()` too; with
the first patch they run on CPU ranks. Their collectives need no stand-in: gloo has
`all_gather_into_tensor` and `reduce_scatter_tensor` (torch 2.13;
`tests/models/test_sequence_parallel.py`).

realrl itself never imports this module: on CPU it trains with the torch backend
(`realrl.backends.torch_optimizer`), the megatron backend and sequence parallelism need CUDA
workers.
Everything is restored on exit; the patches are process-wide while active, so use it around
the megatron calls of one test process only (spawned ranks), never in the pytest process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _NoStream:
    """What megatron-core >= 0.17 gets from `torch.cuda.current_stream()` on CPU."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device='cuda'` / `device=<index>` keyword arguments to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if isinstance(device, int) or str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _cuda_type_names(original):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """megatron-core's CUDA-only DDP, optimizer and clipping code runs on CPU tensors."""
    saved = {
        name: getattr(torch.cuda, name)
        for name in ("current_device", "synchronize", "current_stream")
    }
    tensor_type = torch.Tensor.type
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.Tensor.type = _cuda_type_names(tensor_type)
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        torch.Tensor.type = tensor_type
