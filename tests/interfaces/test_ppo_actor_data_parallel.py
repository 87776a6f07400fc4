"""Two gloo processes training the PPO actor on halves of a batch match one process on all of it.

This checks the global-denominator rule end to end: whitening statistics, loss normalisers
and gradient sums span the data-parallel group, so the split must not change the update. The
gradient sum goes through shared memory (the default for CPU ranks on one machine) or through
gloo's all-reduce (`REALRL_SHARED_MEMORY=0`); both must give the same update.
"""

import os

import pytest
import torch
import torch.distributed as dist
from interface_helpers import EOS_ID, build_model, make_engine, rollout_batch
from rank_processes import start_ranks

from realrl.api import environment
from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters
from realrl.backends import torch_optimizer
from realrl.backends.torch_engine import ParallelContext
from realrl.interfaces.configs import PPOActorConfig
from realrl.interfaces.ppo_actor import PPOActorInterface
from realrl.interfaces.reference import ReferenceInterface

VOCAB_SIZE = 52
MODES = ("token-mean", "seq-mean-token-mean")
# Below the gradients' norm (asserted), so that clipping scales them on every step.
MAX_GRAD_NORM = 0.05


def _config(mode: str) -> PPOActorConfig:
    ppo = PPOHyperparameters(
        adv_estimator="grpo",
        kl_ctl=0.05,
        adv_norm=True,
        num_minibatches=2,
        loss_agg_mode=mode,
        entropy_coef=0.01,
    )
    return PPOActorConfig(
        ppo=ppo,
        generation=GenerationHyperparameters(max_new_tokens=6),
        group_size=2,
        generation_size=2,
    )


def _rollout(engine, reference_engine):
    """Four prompts with two responses each; rewards differ within and between groups."""
    groups, rewards = [], []
    for index in range(4):
        prompt = [4 + index, 13, 5 + index, 17]
        groups.append([(prompt, [20 + index, 9, EOS_ID]), (prompt, [30, 31 + index, 32, 33])])
        rewards += [float(index % 2), 0.25 * index]
    data = rollout_batch(engine, groups, rewards)
    data.update_(ReferenceInterface().inference(reference_engine, data, MicroBatchSpec()).data)
    return data


def _train(parallel: ParallelContext, sample_indices: list[int]) -> dict[str, tuple]:
    """Per mode: (parameters after two train steps, stats of the last step, whether the
    gradients were summed in shared memory)."""
    results = {}
    for mode in MODES:
        reference_engine = make_engine(build_model(VOCAB_SIZE, seed=1), None, lr=None)
        engine = make_engine(
            build_model(VOCAB_SIZE),
            None,
            lr=1e-3,
            parallel=parallel,
            adam_eps=1e-4,
            gradient_clipping=MAX_GRAD_NORM,
        )
        data = _rollout(engine, reference_engine).reorder(sample_indices)
        actor = PPOActorInterface(_config(mode))
        for _ in range(2):
            stats = actor.train_step(
                engine, data, MicroBatchSpec(max_tokens_per_microbatch=12)
            ).stats
        flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        buckets = engine.backend.gradient_buckets
        results[mode] = (flat, stats, buckets is not None and buckets.shared is not None)
    return results


def _worker(rank: int, rendezvous: str, output: str, shared_memory: bool) -> None:
    torch.set_num_threads(1)
    os.environ[environment.SHARED_MEMORY] = "1" if shared_memory else "0"
    # A bucket per few parameters of this tiny model (the default size would make one), so that
    # all-reduces start during each backward, in order.
    torch_optimizer.GRADIENT_BUCKET_BYTES = 2048
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        parallel = ParallelContext(dp_rank=rank, dp_size=2, dp_group=group)
        results = _train(parallel, [0, 1] if rank == 0 else [2, 3])
        torch.save(results, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "gloo"])
def test_two_data_parallel_ranks_train_the_actor_exactly_like_one(tmp_path, shared_memory):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    output = str(tmp_path / "result")
    start_ranks(_worker, (str(tmp_path / "rendezvous"), output, shared_memory), 2)
    single = _train(ParallelContext(), [0, 1, 2, 3])
    ranks = [torch.load(f"{output}.rank{rank}", weights_only=False) for rank in range(2)]
    for mode in MODES:
        parameters, stats, _ = single[mode]
        for rank_results in ranks:
            rank_parameters, rank_stats, summed_in_shared_memory = rank_results[mode]
            assert summed_in_shared_memory == shared_memory
            torch.testing.assert_close(rank_parameters, parameters, atol=1e-6, rtol=0)
            for name in (
                "loss",
                "policy_loss",
                "entropy",
                "kl_to_ref",
                "clip_fraction",
                "advantage",
                "task_reward",
                "num_sequences",
                "grad_norm",
            ):
                assert abs(rank_stats[name] - stats[name]) < 1e-5, (mode, name)
        assert stats["num_sequences"] == 8
        assert stats["grad_norm"] > MAX_GRAD_NORM


def _overlap_worker(rank: int, rendezvous: str, output: str) -> None:
    torch.set_num_threads(1)
    # The overlap is gloo's (or NCCL's) all-reduce; a shared-memory sum runs after the backward.
    os.environ[environment.SHARED_MEMORY] = "0"
    torch_optimizer.GRADIENT_BUCKET_BYTES = 2048
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        parallel = ParallelContext(dp_rank=rank, dp_size=2, dp_group=dist.new_group([0, 1]))
        engine = make_engine(build_model(VOCAB_SIZE), None, lr=1e-3, parallel=parallel)
        embedding = engine.module.embedding.weight
        launched_before_last = []
        # Registered before the engine's own hooks, so it runs first: how many buckets had
        # started when the backward finished its last gradient (the embedding's)?
        embedding.register_post_accumulate_grad_hook(
            lambda _: launched_before_last.append(engine.backend.gradient_buckets.launched)
        )
        ids = torch.arange(12) % VOCAB_SIZE + rank
        cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)

        def loss_fn(forward, _):
            logits = engine.module.head(forward(ids, cu_seqlens))  # every weight takes part
            return logits.float().square().mean(), {}

        engine.train_microbatches([None, None], loss_fn)
        buckets = engine.backend.gradient_buckets
        result = {
            "launched_before_last": list(launched_before_last),
            "num_buckets": len(buckets.buckets),
            "grads": torch.cat([p.grad.reshape(-1) for p in engine.module.parameters()]),
        }
        # A gradient replaced behind the engine's back would miss its bucket's sum: refused.
        norm = engine.module.final_norm.weight
        norm.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", p.grad.clone()))
        try:
            engine.train_microbatches([None], loss_fn)
        except RuntimeError as error:
            result["replaced_grad_error"] = str(error)
        torch.save(result, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_gradient_all_reduces_start_during_the_backward(tmp_path):
    output = str(tmp_path / "result")
    start_ranks(_overlap_worker, (str(tmp_path / "rendezvous"), output), 2)
    ranks = [torch.load(f"{output}.rank{rank}") for rank in range(2)]
    for result in ranks:
        assert result["num_buckets"] > 3
        # Only the last microbatch's backward sends: once, with all but the last buckets out.
        assert len(result["launched_before_last"]) == 2
        assert 0 < result["launched_before_last"][1] < result["num_buckets"]
    assert torch.equal(ranks[0]["grads"], ranks[1]["grads"])  # both hold the sum
    for result in ranks:
        assert "replaced during the step" in result["replaced_grad_error"]
        assert "only TorchEngine may set gradients" in result["replaced_grad_error"]
