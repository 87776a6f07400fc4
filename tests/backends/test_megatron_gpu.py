"""The megatron-core path on one CUDA GPU (skipped without one): what CPU ranks cannot run.

On one GPU and a one-rank NCCL group: bf16 training with megatron-core's DDP and
DistributedOptimizer (d1) against the torch backend, megatron-core's tensor-parallel layers at
t1 against the plain layers, and activation checkpointing; each prints the peak memory it
measured (`torch.cuda.max_memory_allocated`) and the bytes per parameter that training state
holds. `bash benchmarks/run_gpu_tests.sh` runs these (and the other gpu-marked tests) on a
CUDA host from the source tree and keeps the output under benchmarks/results/.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bf16_tolerance import assert_within_a_bf16_spacing
from nccl_group import one_rank_nccl_group

from realrl.api.experiment import OptimizerBackendName, OptimizerConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# ~29M parameters: large enough for the memory numbers to be about weights and activations.
CONFIG = ModelConfig(
    vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, qkv_bias=True, model_type="qwen2",
    eos_token_id=1,
)
STEPS = 3
MIB = 2**20


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    with one_rank_nccl_group(tmp_path_factory.mktemp("nccl")):
        # cuBLAS allocates its workspaces (one per thread: the backward runs on autograd's
        # own) on the first matmuls; made here, they stay out of the first test's bytes per
        # parameter.
        warm = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        (warm @ warm).float().sum().backward()
        torch.cuda.synchronize()
        yield


def build_model(seed: int = 0, config: ModelConfig = CONFIG) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return Transformer(config).to(torch.bfloat16)


def batch(num_seqs: int = 8, seq_len: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = num_seqs * seq_len
    packed = torch.randint(2, CONFIG.vocab_size, (tokens,), device="cuda", generator=generator)
    cu_seqlens = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda")
    return packed, cu_seqlens


def next_token_loss(module: Transformer, packed, cu_seqlens):
    def loss_fn(forward, _):
        logprobs = module.shifted_logprobs(forward(packed, cu_seqlens), packed, cu_seqlens)
        loss = -logprobs.mean()
        return loss, {"loss": float(loss.detach())}

    return loss_fn


def make_engine(module: Transformer, backend: OptimizerBackendName) -> TorchEngine:
    optimizer = OptimizerConfig(lr=1e-4, eps=1e-6, gradient_clipping=1.0, weight_decay=0.01)
    return TorchEngine(module, None, ParallelContext(), optimizer, 100, backend=backend)


def train(engine: TorchEngine, packed, cu_seqlens, steps: int = STEPS) -> list[dict]:
    loss_fn = next_token_loss(engine.module, packed, cu_seqlens)
    return [engine.train_microbatches([None, None], loss_fn) for _ in range(steps)]


def measured_training(module: Transformer, backend: OptimizerBackendName, packed, cu_seqlens):
    """Stats, peak memory and bytes per parameter of the state training leaves behind."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() - sum(p.numel() * 2 for p in module.parameters())
    torch.cuda.reset_peak_memory_stats()
    engine = make_engine(module, backend)
    stats = train(engine, packed, cu_seqlens)
    torch.cuda.synchronize()
    parameters = sum(p.numel() for p in module.parameters())
    held = (torch.cuda.memory_allocated() - before) / parameters
    peak_mib = torch.cuda.max_memory_allocated() / MIB
    print(f"\n[gpu] backend={backend.value} d1 bf16: {parameters / 1e6:.1f}M parameters, "
          f"{held:.2f} bytes/parameter held after training (weights, gradients, optimizer "
          f"state), peak {peak_mib:.0f} MiB over {STEPS} steps of {packed.numel()} tokens x 2 "
          f"micro-batches, losses {[round(s['loss'], 4) for s in stats]}")
    return engine, stats, held


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def test_bf16_distributed_optimizer_d1_trains_like_the_torch_backend():
    packed, cu_seqlens = batch()
    torch_engine, torch_stats, torch_bytes = measured_training(
        build_model(), OptimizerBackendName.torch, packed, cu_seqlens)
    expected = flat(torch_engine.module.parameters())
    del torch_engine
    torch.cuda.empty_cache()
    engine, stats, megatron_bytes = measured_training(
        build_model(), OptimizerBackendName.megatron, packed, cu_seqlens)
    got = flat(engine.module.parameters())
    assert type(engine.backend).__name__ == "MegatronOptimizerBackend"
    assert all(m.dtype == torch.float32 for m in engine.backend.master_shards())
    assert_within_a_bf16_spacing(got, expected, 0.99)
    for mine, reference in zip(stats, torch_stats, strict=True):
        assert abs(mine["loss"] - reference["loss"]) < 1e-3
        assert abs(mine["grad_norm"] - reference["grad_norm"]) < 1e-3 * reference["grad_norm"]
    # d1: bf16 weights 2 + fp32 gradient buffer 4 + fp32 masters 4 + moments 8 = 18, like the
    # torch backend (the distributed optimizer saves (4 + 8)(1 - 1/d) with d > 1).
    assert 17 < megatron_bytes < 20 and 17 < torch_bytes < 20


def test_megatron_tensor_parallel_layers_at_t1_match_the_plain_layers():
    from realrl.backends.megatron_optimizer import own_rank_group
    from realrl.models.megatron_layers import TensorParallelLayerFactory

    config = dataclasses.replace(CONFIG, tie_word_embeddings=False)
    plain = build_model(config=config)
    factory = TensorParallelLayerFactory(own_rank_group(), torch.bfloat16)
    with torch.device("cuda"):
        layered = Transformer(config, factory).to(torch.bfloat16)
    layered.load_state_dict(plain.state_dict())
    packed, cu_seqlens = batch(num_seqs=4)
    with torch.no_grad():
        plain_hidden = plain(packed, cu_seqlens, apply_lm_head=False)
        layered_hidden = layered(packed, cu_seqlens, apply_lm_head=False)
        expected = plain.shifted_logprobs(plain_hidden, packed, cu_seqlens)
        got = layered.shifted_logprobs(layered_hidden, packed, cu_seqlens)
    error = (got - expected).abs().max().item()
    print(f"\n[gpu] megatron tp layers t1 vs plain, bf16: max |log-prob difference| {error:.2e}")
    assert error < 0.05
    layered.gradient_checkpointing = True
    engine = make_engine(layered, OptimizerBackendName.megatron)
    stats = train(engine, packed, cu_seqlens)
    assert stats[-1]["loss"] < stats[0]["loss"]


def peak_train_step_mib(checkpointing: bool, packed, cu_seqlens) -> tuple[float, float]:
    module = build_model()
    module.gradient_checkpointing = checkpointing
    engine = make_engine(module, OptimizerBackendName.megatron)
    loss_fn = next_token_loss(module, packed, cu_seqlens)
    engine.train_microbatches([None], loss_fn)  # gradients and optimizer state exist from here
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    stats = engine.train_microbatches([None], loss_fn)
    torch.cuda.synchronize()
    activations = (torch.cuda.max_memory_allocated() - held) / MIB
    del engine, module
    torch.cuda.empty_cache()
    return activations, stats["loss"]


def test_activation_checkpointing_lowers_the_peak_of_a_train_step():
    packed, cu_seqlens = batch(num_seqs=16, seq_len=512)
    stored, stored_loss = peak_train_step_mib(False, packed, cu_seqlens)
    recomputed, recomputed_loss = peak_train_step_mib(True, packed, cu_seqlens)
    print(f"\n[gpu] activation checkpointing, bf16, {packed.numel()} tokens, "
          f"{CONFIG.num_hidden_layers} layers, hidden {CONFIG.hidden_size}: train step peak "
          f"above held memory {stored:.0f} MiB stored -> {recomputed:.0f} MiB recomputed")
    assert abs(stored_loss - recomputed_loss) < 1e-3
    assert recomputed < 0.7 * stored
