"""The batch statistics of PPO over an NCCL group, on one CUDA GPU (skipped without one).

A PPO batch's advantages, whitening, group moments and logged means are computed from CPU
tensors (`prepare_ppo_batch` moves the rollout to the host); NCCL has no CPU transport, so each
reduction goes through the group's device (`realrl.backends.worker_device.group_device`). On
a one-rank NCCL group every reduction is the identity, so each result must equal the
unreduced one, on the device it started on. Before `all_reduce_sum` moved its tensor, every
data-parallel PPO run on GPUs (`ppo.adv_norm`, the default) raised "No backend type
associated with device type cpu" here.
"""

from __future__ import annotations

import pytest
import torch
from nccl_group import one_rank_nccl_group

from realrl.algo.distributed_stats import all_reduce_sum, masked_moments
from realrl.algo.group_stats import whiten
from realrl.algo.value_norm import ValueNormalizer
from realrl.backends.worker_device import group_device
from realrl.interfaces.common import DistributedMeans

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    with one_rank_nccl_group(tmp_path_factory.mktemp("nccl")) as group:
        yield group


def test_cpu_statistics_reduce_over_nccl_and_stay_on_the_cpu(nccl_group):
    assert group_device(nccl_group) == torch.device("cuda", 0)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 9, generator=generator)
    mask = torch.rand(4, 9, generator=generator) > 0.3

    for reduced, alone in zip(masked_moments(values, mask, nccl_group),
                              masked_moments(values, mask, None)):
        assert reduced.device.type == "cpu" and torch.equal(reduced, alone)
    assert torch.equal(whiten(values, mask, nccl_group), whiten(values, mask, None))

    on_gpu = all_reduce_sum(values.cuda(), nccl_group)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), values)


def test_value_norm_and_logged_means_reduce_over_nccl(nccl_group):
    values = torch.tensor([1.0, 2.0, 4.0])
    grouped, alone = ValueNormalizer(process_group=nccl_group), ValueNormalizer()
    grouped.update(values)
    alone.update(values)
    assert torch.equal(grouped.running_mean, alone.running_mean)

    means = DistributedMeans()
    means.add("reward", torch.tensor(3.0, device="cuda"), 2.0)  # a train stat, on the GPU
    means.add("length", torch.tensor(10.0), 4.0)  # a rollout stat, on the CPU
    assert means.reduce(nccl_group) == {"length": 2.5, "reward": 1.5}
