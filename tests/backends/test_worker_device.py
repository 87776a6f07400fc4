"""A model worker's CUDA-only world decisions (`realrl.backends.worker_device`) on a CPU
machine: the CPU choices here, the CUDA ones with torch.cuda's answers replaced. The CUDA paths
themselves run in the gpu-marked tests (tests/algo/test_nccl_statistics.py, one NCCL rank)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from realrl.backends.worker_device import (
    DeviceError,
    bind_device,
    group_device,
    worker_device,
    world_backend,
)


def test_without_a_gpu_the_world_is_gloo_on_the_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert world_backend() == "gloo" and worker_device() == torch.device("cpu")
    bind_device(3)  # nothing to bind
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        assert group_device(dist.group.WORLD) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_a_worker_refuses_a_gpu_its_machine_does_not_have(monkeypatch):
    """Two workers on one GPU would both use it and fail at the first NCCL collective; the
    second worker stops at once, with the key to change."""
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert world_backend() == "nccl"
    bind_device(0)
    with pytest.raises(DeviceError, match=r"GPU 1 .* sees 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=3\)"
                                          r": set n_devices_per_node=1"):
        bind_device(1)
    assert bound == [0]
