"""`nan_policy` in `TorchEngine.train_microbatches`: a NaN loss in one micro-batch (on one
data-parallel rank) stops naming the micro-batch, or skips the step on every rank alike.

The NaN is injected by the loss: the real cross-entropy of the chosen micro-batch times NaN,
so its gradients are NaN too, as a diverged model's would be.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from rank_processes import start_ranks
from test_mixed_precision import cross_entropy, flat, make_engine, microbatches, tiny_model

from realrl.api import environment
from realrl.api.config import NanPolicy
from realrl.backends.torch_engine import NonFiniteError, ParallelContext


def nan_in(module, poisoned: set[int]):
    """`cross_entropy(module)`, with micro-batches `poisoned` (0-based) giving a NaN loss."""
    calls = []
    loss_fn = cross_entropy(module)

    def poisoned_loss(forward, microbatch):
        loss, stats = loss_fn(forward, microbatch)
        calls.append(None)
        return (loss * float("nan") if len(calls) - 1 in poisoned else loss), stats

    return poisoned_loss


def test_stop_names_the_micro_batch_and_leaves_the_weights():
    engine = make_engine(tiny_model(), 1e-2)
    before = flat(engine.module.parameters())
    with pytest.raises(NonFiniteError, match=r"non-finite loss in micro-batch 2 of 2 .*stop"):
        engine.train_microbatches(microbatches([0, 1, 2, 3], 2), nan_in(engine.module, {1}))
    assert torch.equal(flat(engine.module.parameters()), before)


def test_skip_keeps_weights_moments_and_schedule_then_trains_on():
    engine = make_engine(tiny_model(), 1e-2)
    engine.nan_policy = NanPolicy.skip
    before = flat(engine.module.parameters())
    stats = engine.train_microbatches(microbatches([0, 1, 2, 3], 2), nan_in(engine.module, {0}))
    assert engine.skipped_steps == 1 and stats["grad_norm"] != stats["grad_norm"]  # NaN
    assert torch.equal(flat(engine.module.parameters()), before)
    assert engine.optimizer.state == {} and engine.lr_scheduler.last_epoch == 0
    stats = engine.train_microbatches(microbatches([0, 1, 2, 3], 2), cross_entropy(engine.module))
    assert engine.skipped_steps == 1 and stats["grad_norm"] > 0
    assert not torch.equal(flat(engine.module.parameters()), before)


def _rank(rank: int, rendezvous: str, output: str) -> None:
    torch.set_num_threads(1)
    os.environ[environment.SHARED_MEMORY] = "0"  # gradients summed through gloo
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        parallel = ParallelContext(dp_rank=rank, dp_size=2, dp_group=dist.new_group([0, 1]))
        engine = make_engine(tiny_model(), 1e-2, parallel)
        engine.nan_policy = NanPolicy.skip
        before = flat(engine.module.parameters())
        # Only rank 1 meets a NaN loss; rank 0's losses are finite.
        loss = nan_in(engine.module, {0}) if rank == 1 else cross_entropy(engine.module)
        engine.train_microbatches(microbatches([0, 1] if rank == 0 else [2, 3], 1), loss)
        unchanged = torch.equal(flat(engine.module.parameters()), before)
        torch.save({"skipped": engine.skipped_steps, "unchanged": unchanged}, f"{output}{rank}")
    finally:
        dist.destroy_process_group()


def test_one_ranks_nan_skips_the_step_on_every_data_parallel_rank(tmp_path):
    start_ranks(_rank, (str(tmp_path / "rendezvous"), str(tmp_path / "rank")), 2)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}") == {"skipped": 1, "unchanged": True}, rank
