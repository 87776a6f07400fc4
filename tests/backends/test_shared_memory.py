"""Gloo ranks on one machine sum tensors through shared memory; ranks that cannot, fall back."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from rank_processes import start_ranks

from realrl.backends.shared_memory import (
    FILE_PREFIX,
    SharedMemorySum,
    read_tensor_file,
    write_tensor_file,
)

# Sizes around the chunking: one not a multiple of the 64-element cut, one smaller than a cut
# (only rank 0 sums it), an empty one, and a bf16 one.
SPECS = [(1000, torch.float32), (5, torch.float32), (0, torch.float32), (777, torch.bfloat16)]


def _values(rank: int, round_: int) -> list[torch.Tensor]:
    """Integer-valued floats (their sums are exact in any order) that differ per rank/round."""
    generator = torch.Generator().manual_seed(100 * round_ + rank)
    return [
        torch.randint(-50, 50, (numel,), generator=generator).to(dtype) for numel, dtype in SPECS
    ]


def _sum_worker(rank: int, size: int, rendezvous: str, directory: str, output: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        shared = SharedMemorySum.connect(dist.group.WORLD, SPECS, Path(directory))
        assert shared is not None
        dist.barrier()  # every rank has returned from connect
        left_over = sorted(os.listdir(directory))
        result = {"left_over": left_over, "zeroed": [t.clone() for t in shared.tensors]}
        for round_ in range(2):
            for tensor, value in zip(shared.tensors, _values(rank, round_)):
                tensor.copy_(value)
            shared.all_reduce()
            result[f"round{round_}"] = [t.clone() for t in shared.tensors]
        # Random floats: every rank must end with the same bits.
        generator = torch.Generator().manual_seed(rank)
        for tensor in shared.tensors:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        shared.all_reduce()
        result["random"] = [t.clone() for t in shared.tensors]
        torch.save(result, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_three_ranks_sum_through_shared_memory_and_leave_no_files(tmp_path):
    size, directory = 3, tmp_path / "shm"
    directory.mkdir()
    output = str(tmp_path / "result")
    start_ranks(_sum_worker, (size, str(tmp_path / "rendezvous"), str(directory), output), size)
    ranks = [torch.load(f"{output}.rank{rank}") for rank in range(size)]
    for round_ in range(2):
        expected = [sum(parts) for parts in zip(*(_values(r, round_) for r in range(size)))]
        for result in ranks:
            for got, want, (numel, dtype) in zip(result[f"round{round_}"], expected, SPECS):
                assert got.dtype == dtype and got.shape == (numel,)
                assert torch.equal(got, want)
    for result in ranks:
        assert result["left_over"] == []  # unlinked once every rank had mapped them
        assert all(not t.any() for t in result["zeroed"])
        for got, first in zip(result["random"], ranks[0]["random"]):
            assert torch.equal(got, first)
    assert list(directory.iterdir()) == []


def _fallback_worker(rank: int, rendezvous: str, directories: list[str], output: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        shared = SharedMemorySum.connect(dist.group.WORLD, SPECS, Path(directories[rank]))
        torch.save({"shared": shared is not None}, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_that_cannot_open_each_others_memory_all_fall_back(tmp_path):
    # Like two containers with their own /dev/shm: each rank's files are invisible to the other.
    separate = [tmp_path / "a", tmp_path / "b"]
    # And a rank that cannot even create its file.
    missing = [tmp_path / "a", tmp_path / "does-not-exist"]
    for directory in separate:
        directory.mkdir()
    for case, directories in (("separate", separate), ("missing", missing)):
        output = str(tmp_path / case)
        rendezvous = str(tmp_path / f"rendezvous-{case}")
        start_ranks(_fallback_worker, (rendezvous, [str(d) for d in directories], output), 2)
        assert [torch.load(f"{output}.rank{r}")["shared"] for r in range(2)] == [False, False]
        for directory in separate:
            assert not [p for p in directory.iterdir() if p.name.startswith(FILE_PREFIX)]


def test_a_tensor_file_hands_tensors_to_a_process_outside_the_group(tmp_path):
    # What a push to vLLM's CPU worker does: one file, read back bit for bit in every dtype and
    # shape (views of a fused weight included), as copies that outlive the file.
    fused = torch.randn(6, 4)
    tensors = {"q": fused[:4], "k": fused[4:], "bias": torch.randn(3).bfloat16(),
               "index": torch.arange(5), "scalar": torch.tensor(2.5)}
    path, specs = write_tensor_file(tensors, directory=tmp_path)
    assert path.parent == tmp_path and path.name.startswith(FILE_PREFIX)
    assert [offset % 64 for *_, offset in specs] == [0] * len(tensors)
    read = read_tensor_file(path, specs)
    path.unlink()
    assert [name for name, _ in read] == list(tensors)
    for (name, got), want in zip(read, tensors.values()):
        assert got.dtype == want.dtype and torch.equal(got, want), name
