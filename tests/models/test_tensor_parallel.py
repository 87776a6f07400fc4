"""Tensor parallelism over 2 gloo processes: forward and gradients equal a single device."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from realrl.models.config import ModelConfig
from realrl.models.tensor_parallel import (
    TensorParallelLayerFactory,
    shard_state_dict,
    unshard_state_dicts,
)
from realrl.models.transformer import Transformer

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
    "critic": ModelConfig(**SHAPE, is_critic=True),
}


def full_model(config: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.2 * torch.randn_like(parameter))
    return model


def forward_backward(model: Transformer):
    lengths = [5, 9, 2]
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=generator)
    packed[5:9] = packed[:4]  # the second sequence begins like the first: a shared prefix
    cu_seqlens = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    output = model(packed, cu_seqlens)
    weights = torch.randn(output.shape, generator=generator)
    (output * weights).sum().backward()
    return output.detach()


def _compare_with_single_device(rank: int, config: ModelConfig, group) -> tuple[float, float, bool]:
    reference = full_model(config)
    reference.share_prefixes = False  # the shards run the shared tokens once; the reference not
    reference_output = forward_backward(reference)
    model = Transformer(config, TensorParallelLayerFactory(group))
    model.load_state_dict(shard_state_dict(reference.state_dict(), rank, 2, config))
    output = forward_backward(model)
    gathered = [None, None]
    dist.all_gather_object(
        gathered, {name: p.grad for name, p in model.named_parameters()}, group=group
    )
    full_grads = unshard_state_dicts(gathered, config)
    output_error = (output - reference_output).abs().max().item()
    grad_error = max(
        (full_grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters()
    )
    return (
        output_error,
        grad_error,
        sorted(full_grads) == sorted(dict(reference.named_parameters())),
    )


def _worker(rank: int, init_file: str, result_queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        results = {
            name: _compare_with_single_device(rank, config, group)
            for name, config in CONFIGS.items()
        }
        result_queue.put((rank, results))
    except Exception as error:  # report instead of leaving the parent waiting
        result_queue.put((rank, repr(error)))
        raise
    finally:
        dist.destroy_process_group()


def test_two_rank_tensor_parallel_forward_and_gradients_equal_one_rank(tmp_path):
    """Untied Qwen2 (QKV bias), tied Llama and a critic, in one pair of processes."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    processes = [
        context.Process(target=_worker, args=(rank, str(tmp_path / "init"), queue))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    for rank, per_config in results:
        assert isinstance(per_config, dict), f"rank {rank} failed: {per_config}"
        assert set(per_config) == set(CONFIGS)
        for name, (output_error, grad_error, same_names) in per_config.items():
            assert same_names, name
            assert output_error <= 1e-5, name
            assert grad_error <= 1e-5, name
    assert all(process.exitcode == 0 for process in processes)


def test_shard_then_unshard_is_the_identity():
    config = CONFIGS["qwen2_untied"]
    full = full_model(config).state_dict()
    shards = [shard_state_dict(full, rank, 2, config) for rank in range(2)]
    assert shards[0]["layers.0.attention.qkv.weight"].shape == (32, 32)  # (4+2+2)*8 / 2 rows
    restored = unshard_state_dicts(shards, config)
    assert all(torch.equal(restored[name], full[name]) for name in full)
