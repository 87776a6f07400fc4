"""Loss aggregation: the denominator is global, so micro-batches and dp ranks add up exactly."""

import os

import pytest
import torch
import torch.distributed as dist
from rank_processes import start_ranks

from realrl.algo.advantages import AdvantageInputs, AdvantageSettings, compute_advantages
from realrl.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_normaliser
from realrl.algo.group_stats import whiten
from realrl.algo.kl import kl_estimate
from realrl.algo.layout import packed_shifted_logprobs, response_mask
from realrl.algo.losses import ppo_policy_loss
from realrl.algo.value_norm import ValueNormalizer


def test_each_mode_by_hand():
    # seq A: prompt 1 + response 3 -> entries [1, 2, 3] all valid (T=3)
    # seq B: prompt 2 + response 1 -> entries [masked 9, 4]       (T=1)
    # seq C: prompt 2, no response  -> entry [masked 9]            (T=0, not counted)
    per_token = torch.tensor([1.0, 2.0, 3.0, 9.0, 4.0, 9.0])
    mask = response_mask(torch.tensor([1, 2, 2]), torch.tensor([4, 3, 2]))
    cu_seqlens = torch.tensor([0, 4, 7, 9])
    expected = {
        "token-mean": (1 + 2 + 3 + 4) / 4,  # 2.5
        "seq-mean-token-sum": (6 + 4) / 2,  # 5.0
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,  # 3.0
        "seq-mean-token-sum-norm": (6 / 8 + 4 / 8) / 2,  # 0.625 with norm_length 8
    }
    for mode, value in expected.items():
        normaliser = loss_normaliser(mode, mask, cu_seqlens, norm_length=8)
        assert aggregate_loss(per_token, mask, cu_seqlens, mode, normaliser).item() == value


def test_unknown_mode_and_missing_norm_length_are_reported():
    mask, cu_seqlens = torch.ones(2, dtype=torch.bool), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="valid: token-mean"):
        loss_normaliser("token-sum", mask, cu_seqlens)
    with pytest.raises(ValueError, match="loss_agg_norm_length"):
        loss_normaliser("seq-mean-token-sum-norm", mask, cu_seqlens)


def _random_batch(seed, num_seqs=8, vocab=13):
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, 5, (num_seqs,), generator=generator)
    response_lens = torch.randint(0, 8, (num_seqs,), generator=generator)
    seq_lens = prompt_lens + response_lens
    total = int(seq_lens.sum())
    shifted_total = total - num_seqs
    return {
        "seq_lens": seq_lens,
        "input_ids": torch.randint(0, vocab, (total,), generator=generator),
        "loss_mask": response_mask(prompt_lens, seq_lens),
        "old_logprobs": -torch.rand(shifted_total, generator=generator, dtype=torch.float64),
        "ref_logprobs": -torch.rand(shifted_total, generator=generator, dtype=torch.float64),
        "advantages": torch.randn(shifted_total, generator=generator, dtype=torch.float64),
    }


def _slice(batch, first, last):
    """Sequences first..last-1 of a batch, as their own packed batch."""
    cu = torch.nn.functional.pad(batch["seq_lens"].cumsum(0), (1, 0))
    shifted = cu - torch.arange(cu.numel())
    tokens, entries = slice(cu[first], cu[last]), slice(shifted[first], shifted[last])
    out = {"seq_lens": batch["seq_lens"][first:last], "input_ids": batch["input_ids"][tokens]}
    for key in ("loss_mask", "old_logprobs", "ref_logprobs", "advantages"):
        out[key] = batch[key][entries]
    return out


def _micro_batch_loss(model, batch, mode, normaliser):
    """A tiny real model (embedding -> linear head), the actor's per-token loss, aggregated."""
    cu_seqlens = torch.nn.functional.pad(batch["seq_lens"].cumsum(0), (1, 0))
    logits = model(batch["input_ids"])  # [total_tokens, vocab]
    logprobs = packed_shifted_logprobs(logits, batch["input_ids"], cu_seqlens).double()
    policy = ppo_policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], dual_clip=3.0
    )
    per_token = policy.per_token_loss + 0.1 * kl_estimate(logprobs, batch["ref_logprobs"], "k3")
    return aggregate_loss(per_token.double(), batch["loss_mask"], cu_seqlens, mode, normaliser)


def _model(vocab=13):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 6), torch.nn.Linear(6, vocab)).double()


def _normaliser(batch, mode, process_group=None):
    cu_seqlens = torch.nn.functional.pad(batch["seq_lens"].cumsum(0), (1, 0))
    return loss_normaliser(mode, batch["loss_mask"], cu_seqlens, process_group, norm_length=10)


def _loss_and_grads(model, batches, mode, normaliser):
    model.zero_grad()
    total = sum(_micro_batch_loss(model, batch, mode, normaliser) for batch in batches)
    total.backward()
    return total.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_one_and_four_micro_batches_give_the_same_loss_and_gradients(mode):
    batch, model = _random_batch(seed=5), _model()
    normaliser = _normaliser(batch, mode)  # computed once, before the micro-batch loop
    full_loss, full_grads = _loss_and_grads(model, [batch], mode, normaliser)
    micro_batches = [_slice(batch, i, i + 2) for i in range(0, 8, 2)]
    split_loss, split_grads = _loss_and_grads(model, micro_batches, mode, normaliser)
    torch.testing.assert_close(split_loss, full_loss, rtol=1e-12, atol=1e-12)
    for split, full in zip(split_grads, full_grads):
        torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-12)


def _data_parallel_worker(rank, world_size, init_file, result_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    group = dist.group.WORLD
    batch = _random_batch(seed=5)
    # uneven split: rank 0 holds 3 sequences, rank 1 holds 5
    local = _slice(batch, 0, 3) if rank == 0 else _slice(batch, 3, 8)
    results = {}
    for mode in LOSS_AGG_MODES:
        model = _model()
        normaliser = _normaliser(local, mode, group)
        loss, grads = _loss_and_grads(model, [local], mode, normaliser)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)
        for grad in grads:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        results[mode] = (normaliser, loss, grads)
    local_cu = torch.nn.functional.pad(local["seq_lens"].cumsum(0), (1, 0))
    results["whitened"] = whiten(local["advantages"], local["loss_mask"], group)
    inputs = AdvantageInputs(local["advantages"] * local["loss_mask"], local["loss_mask"], local_cu)
    results["reinforce_pp"] = compute_advantages(
        "reinforce_plus_plus", inputs, AdvantageSettings(gamma=0.9), group
    ).advantages
    normaliser = ValueNormalizer("moving_average", process_group=group)
    normaliser.update(local["advantages"], local["loss_mask"])
    results["value_norm"] = normaliser.mean_std()
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_gloo_ranks_match_the_single_process_full_batch(tmp_path):
    start_ranks(_data_parallel_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    batch = _random_batch(seed=5)
    for mode in LOSS_AGG_MODES:
        normaliser = _normaliser(batch, mode)
        full_loss, full_grads = _loss_and_grads(_model(), [batch], mode, normaliser)
        for rank in ranks:
            rank_normaliser, rank_loss, rank_grads = rank[mode]
            assert rank_normaliser.item() == normaliser.item(), mode
            torch.testing.assert_close(rank_loss, full_loss, rtol=1e-12, atol=1e-12)
            for rank_grad, full_grad in zip(rank_grads, full_grads):
                torch.testing.assert_close(rank_grad, full_grad, rtol=1e-10, atol=1e-12)
    # global whitening / REINFORCE++ / value-norm statistics equal the full-batch ones
    cu = torch.nn.functional.pad(batch["seq_lens"].cumsum(0), (1, 0))
    full_white = whiten(batch["advantages"], batch["loss_mask"])
    torch.testing.assert_close(torch.cat([r["whitened"] for r in ranks]), full_white)
    inputs = AdvantageInputs(batch["advantages"] * batch["loss_mask"], batch["loss_mask"], cu)
    full_rpp = compute_advantages("reinforce_plus_plus", inputs, AdvantageSettings(gamma=0.9))
    torch.testing.assert_close(torch.cat([r["reinforce_pp"] for r in ranks]), full_rpp.advantages)
    single = ValueNormalizer("moving_average")
    single.update(batch["advantages"], batch["loss_mask"])
    for rank in ranks:
        torch.testing.assert_close(rank["value_norm"], single.mean_std())
