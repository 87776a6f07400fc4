"""A one-rank NCCL process group on GPU 0, for the gpu-marked tests of NCCL paths.

One rank is all a one-GPU host can run. On it every collective is the identity, so a test
checks that a path runs on NCCL at all (devices, backends, dtypes) and returns the unreduced
value; sums over several ranks are checked on gloo in the CPU tests that share the code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


@contextmanager
def one_rank_nccl_group(directory: Path) -> Iterator[dist.ProcessGroup]:
    """The NCCL world of one rank on GPU 0, rendezvous in `directory`, destroyed on exit."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{directory / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
