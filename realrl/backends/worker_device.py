"""What a model worker's distributed world does differently on CUDA: the one place it is decided.

Everything else (parameter reallocation, gradient sums, statistics, checkpoints) is the same
code on gloo and on NCCL, and is tested on CPU ranks. What differs, per torch.distributed's
documented semantics:

- **The backend** (`world_backend`): NCCL when the worker has a GPU, else gloo. Subgroups
  (`dist.new_group`) inherit it, and the collective timeout (`collective_timeout`) is passed to
  both; NCCL's is enforced by torch's watchdog, which tears the process down
  when a collective passes it (`TORCH_NCCL_ASYNC_ERROR_HANDLING`'s default), so a stalled peer
  ends in a dead worker that the supervisor names, not a hang.
- **The device of each rank** (`bind_device`): NCCL requires one GPU per rank, selected with
  `torch.cuda.set_device` before the process group is created, so that the communicator and
  every `torch.cuda.current_device()` allocation are that GPU's. Worker r uses GPU r of its
  machine (local launches) or its SLURM local task id; a GPU the process cannot see is refused.
- **Where collective tensors live** (`group_device`): NCCL reduces only CUDA tensors, so the
  CPU statistics of a batch go through the current GPU (`realrl.algo.distributed_stats`);
  gloo takes CPU tensors.
- **Where a worker computes** (`worker_device`): the bound GPU, else the CPU.

No CUDA streams or pinned host buffers are used on these paths: collectives run on NCCL's
internal stream, ordered against the current stream by torch, and a tensor is only read after
its collective's `wait()` (the asynchronous broadcasts of `realrl.workers.realloc` post only on
CPU ranks).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from realrl.api.errors import UserFacingError


class DeviceError(UserFacingError):
    """A worker is placed on a GPU it cannot use."""


def world_backend() -> str:
    """torch.distributed's backend for the model workers' world: NCCL with a GPU, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def bind_device(device: int) -> None:
    """Make GPU `device` of this machine the process's current CUDA device, before it joins the
    world (a no-op without GPUs). A device the process cannot see is refused: two workers on
    one GPU would fail at their first NCCL collective ("Duplicate GPU detected"), far from the
    cause."""
    if not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    if device >= visible:
        raise DeviceError(
            f"this worker is to use GPU {device} of its machine, but it sees {visible} "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
            f"set n_devices_per_node={visible} (or 0: every GPU), or make more GPUs visible"
        )
    torch.cuda.set_device(device)


def worker_device() -> torch.device:
    """Where this worker computes: its bound GPU (`bind_device`), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_device(process_group: dist.ProcessGroup) -> torch.device:
    """Where `process_group`'s collectives take their tensors: the current GPU for NCCL, which
    has no CPU transport (torch.distributed raises "No backend type associated with device type
    cpu"), else the CPU (gloo)."""
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
