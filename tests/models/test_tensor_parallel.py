"""Tensor parallelism on megatron-core's layers over 2 gloo processes equals a single device.

Per model (untied Qwen2 with QKV bias, tied Llama, critic), built by `shard_module` as a model
worker builds it: the logits (gathered), the log-probs and entropies the fused LM head reads
off the hidden states and each rank's vocabulary slice (`realrl.models.lm_head`, in several
chunks), every gradient (the head's weight, tied or not, included), and the log-probs after one
AdamW step all equal the single-device model's within 1e-5. Also checked: the parameters megatron marks as split are exactly those the state-dict
sharding splits, nothing touches megatron's `parallel_state` globals, and an initialised global
tp layout (of another size) does not change the results (megatron-core 0.16.1's
`vocab_parallel_cross_entropy` would reduce over it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_processes import environment_for_ranks, rank_context, run_rank

from realrl.algo import layout
from realrl.algo.layout import packed_entropy, packed_shifted_logprobs
from realrl.backends.optimizer_backend import sum_sequence_parallel_gradients
from realrl.backends.torch_engine import ParallelContext, sharded_parameter_ids
from realrl.models.config import ModelConfig
from realrl.models.tensor_parallel import shard_state_dict, unshard_state_dicts
from realrl.models.transformer import Transformer
from realrl.workers.model_loading import shard_module

# Shapes every tensor-parallel size here divides (heads, kv heads, vocab, intermediate).
SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CONFIGS = {
    "qwen2_untied": ModelConfig(**SHAPE, qkv_bias=True, model_type="qwen2"),
    "llama_tied": ModelConfig(**SHAPE, tie_word_embeddings=True),
    # per-head norms: replicated, each rank's gradient a partial sum over its heads
    "qwen3": ModelConfig(**SHAPE, qk_norm=True, head_dim=16, model_type="qwen3"),
    "critic": ModelConfig(**SHAPE, is_critic=True),
}
TOLERANCE = 1e-5


def full_model(config: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.2 * torch.randn_like(parameter))
    return model


def packed_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(0, vocab_size, (16,), generator=generator)
    packed[5:9] = packed[:4]  # the second sequence begins like the first: a shared prefix
    return packed, torch.tensor([0, 5, 14, 16], dtype=torch.int32)


def training_loss(model: Transformer, output: torch.Tensor, packed, cu_seqlens):
    """A loss through every output the interfaces read: log-probs and entropies (LM), or a
    weighted sum of the values (critic)."""
    if model.config.is_critic:
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(2))
        return (output * weights).sum(), {}
    logprobs, entropy = model.shifted_logprobs_and_entropy(output, packed, cu_seqlens)
    loss = -(logprobs * torch.linspace(0.5, 1.5, logprobs.numel())).sum() - 0.3 * entropy.sum()
    return loss, {"logprobs": logprobs.detach(), "entropy": entropy.detach()}


def gathered(output: torch.Tensor, group) -> torch.Tensor:
    pieces = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, output.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def train_once(model: Transformer, parallel: ParallelContext | None = None):
    """Outputs, gradients and the log-probs after one AdamW step on the fixed batch; a shard's
    partial gradients summed over `parallel`'s tp group as the optimizer backends do."""
    packed, cu_seqlens = packed_batch(model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    output = model(packed, cu_seqlens, apply_lm_head=False)  # hidden states, or values
    loss, read_off = training_loss(model, output, packed, cu_seqlens)
    loss.backward()
    if parallel is not None:
        sum_sequence_parallel_gradients([(p, p.grad) for p in model.parameters()], parallel)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(packed, cu_seqlens)  # this rank's vocabulary slice, or values
    optimizer.step()
    with torch.no_grad():
        after = model(packed, cu_seqlens, apply_lm_head=False)
        if not model.config.is_critic:
            after = model.shifted_logprobs(after, packed, cu_seqlens)
    return logits, read_off, grads, after


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item()


def compare_with_single_device(rank: int, config: ModelConfig, group) -> dict:
    reference = full_model(config)
    reference.share_prefixes = False  # the shards run the shared tokens once; the reference not
    parallel = ParallelContext(tp_rank=rank, tp_size=2, tp_group=group)
    shard = shard_module(full_model(config), parallel)
    full = reference.state_dict()
    split_names = {n for n, p in shard.named_parameters() if p.shape != full[n].shape}
    marked_names = {n for n, p in shard.named_parameters() if id(p) in sharded_parameter_ids(shard)}
    ref_output, ref_read_off, ref_grads, ref_after = train_once(reference)
    output, read_off, grads, after = train_once(shard, parallel)
    if not config.is_critic:
        output = gathered(output, group)
    gathered_grads = [None, None]
    dist.all_gather_object(gathered_grads, grads, group=group)
    full_grads = unshard_state_dicts(gathered_grads, config)
    errors = {
        "output": max_error(output, ref_output),
        "grad": max(max_error(full_grads[n], ref_grads[n]) for n in ref_grads),
        "after_step": max_error(after, ref_after),
    }
    for key in read_off:
        errors[key] = max_error(read_off[key], ref_read_off[key])
    return {
        "errors": errors,
        "same_names": sorted(full_grads) == sorted(ref_grads),
        "marks_match_sharding": split_names == marked_names and len(split_names) > 0,
    }


def global_layout_does_not_matter(rank: int, group) -> float:
    """With megatron's global tp layout set to size 1, vocab-parallel log-probs still reduce
    over `group`: their error against the single-device log-probs."""
    from megatron.core import parallel_state

    config = CONFIGS["llama_tied"]
    reference = full_model(config)
    shard = shard_module(
        full_model(config), ParallelContext(tp_rank=rank, tp_size=2, tp_group=group)
    )
    packed, cu_seqlens = packed_batch(config.vocab_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        with torch.no_grad():
            hidden = shard(packed, cu_seqlens, apply_lm_head=False)
            logprobs = shard.shifted_logprobs(hidden, packed, cu_seqlens)
            expected = packed_shifted_logprobs(reference(packed, cu_seqlens), packed, cu_seqlens)
    finally:
        parallel_state.destroy_model_parallel()
    return max_error(logprobs, expected)


def _worker(rank: int, init_file: str, result_queue) -> None:
    torch.set_num_threads(1)
    # 3 rows of a 32-wide vocabulary slice per chunk: the 13 rows take 5 rounds of all-reduces.
    layout._LOGIT_CHUNK_ELEMENTS, layout._MIN_CHUNK_ROWS = 3 * SHAPE["vocab_size"] // 2, 1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from megatron.core import parallel_state

        group = dist.new_group([0, 1])
        results = {
            name: compare_with_single_device(rank, config, group)
            for name, config in CONFIGS.items()
        }
        results["globals_untouched"] = not parallel_state.model_parallel_is_initialized()
        results["global_layout_error"] = global_layout_does_not_matter(rank, group)
        result_queue.put((rank, results))
    except Exception as error:  # report instead of leaving the parent waiting
        result_queue.put((rank, repr(error)))
        raise
    finally:
        dist.destroy_process_group()


def test_two_rank_megatron_layers_match_one_rank_in_logits_logprobs_gradients_and_a_step(tmp_path):
    """t2 on megatron-core's layers vs t1, in one pair of processes."""
    context = rank_context()
    queue = context.Queue()
    processes = [
        context.Process(target=run_rank, args=(rank, _worker, environment_for_ranks(),
                                               str(tmp_path / "init"), queue))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=180) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    for rank, per_config in results:
        assert isinstance(per_config, dict), f"rank {rank} failed: {per_config}"
        assert per_config.pop("globals_untouched"), "megatron's parallel_state was initialised"
        assert per_config.pop("global_layout_error") <= TOLERANCE
        assert set(per_config) == set(CONFIGS)
        for name, result in per_config.items():
            assert result["same_names"], name
            assert result["marks_match_sharding"], name
            expected_keys = {"output", "grad", "after_step"}
            if name != "critic":
                expected_keys |= {"logprobs", "entropy"}
            assert set(result["errors"]) == expected_keys, name
            for key, error in result["errors"].items():
                assert error <= TOLERANCE, (name, key, error)
    assert all(process.exitcode == 0 for process in processes)


def test_shard_then_unshard_is_the_identity():
    config = CONFIGS["qwen2_untied"]
    full = full_model(config).state_dict()
    shards = [shard_state_dict(full, rank, 2, config) for rank in range(2)]
    assert shards[0]["layers.0.attention.qkv.weight"].shape == (32, 32)  # (4+2+2)*8 / 2 rows
    restored = unshard_state_dicts(shards, config)
    assert all(torch.equal(restored[name], full[name]) for name in full)


def test_vocab_parallel_logits_refuse_a_gather_that_would_drop_their_gradient():
    from realrl.models.megatron_layers import gather_vocabulary

    logits = torch.zeros(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="drops their gradient"):
        gather_vocabulary(logits, group=None)


def test_single_device_fused_head_gives_the_algo_functions_of_the_logits():
    model = full_model(CONFIGS["qwen2_untied"])
    packed, cu_seqlens = packed_batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(packed, cu_seqlens)
        hidden = model(packed, cu_seqlens, apply_lm_head=False)
        logprobs, entropy = model.shifted_logprobs_and_entropy(hidden, packed, cu_seqlens)
    torch.testing.assert_close(
        logprobs, packed_shifted_logprobs(logits, packed, cu_seqlens), rtol=0, atol=TOLERANCE
    )
    torch.testing.assert_close(
        entropy, packed_entropy(logits, cu_seqlens), rtol=0, atol=TOLERANCE
    )
