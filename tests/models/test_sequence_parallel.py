"""Sequence parallelism (Korthikanti et al. 2022) on megatron-core's layers, on 2 CPU ranks.

realrl runs it on CUDA workers only: megatron-core's sequence-parallel mappings and linears
allocate their buffers on `torch.cuda.current_device()`. The spawned ranks here run it under
the test-only shim (`megatron_cpu_shim.cuda_to_cpu`). gloo (torch 2.13) has
`all_gather_into_tensor` and `reduce_scatter_tensor`, so no collective is emulated. One GPU
cannot test it: it needs tp >= 2, and NCCL refuses two ranks on one device.

Each model (tied Llama, untied Qwen2 with QKV bias, critic) is built as a worker builds it
(`shard_module`), t1, t2 without and t2 with sequence parallelism, and compared in fp32 within
`TOLERANCE` = 1e-5 (float reordering of the tp sums is ~1e-7 here):

- a forward and backward on packed batches of 15 tokens (not a multiple of tp: one padding
  row; with and without activation checkpointing) and of 16 tokens with a shared prefix:
  logits (gathered), log-probs and entropies, or values; and every gradient once the norms'
  partial gradients are summed over tp (`sum_sequence_parallel_gradients`). Before that sum
  each rank's norm gradient must differ from t1's: a model whose norms saw every token would
  not be sequence parallel, and a backend that skipped the sum would train wrongly;
- three optimizer steps through `TorchEngine` with the torch backend and with the megatron
  backend (DDP + distributed optimizer, clipping active): every weight within 1e-5 of t1's;
- generation (prefill and decode, greedy): the same tokens and log-probs as t2 without;
- the activations a training forward saves for its backward, per rank (printed with -s).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from rank_processes import start_ranks
from test_tensor_parallel import CONFIGS

from realrl.api.experiment import LRScheduler, OptimizerBackendName, OptimizerConfig
from realrl.backends.optimizer_backend import sum_sequence_parallel_gradients
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.generation import generate
from realrl.models.sampling import GenerationConfig
from realrl.models.tensor_parallel import unshard_state_dicts
from realrl.models.transformer import Transformer
from realrl.workers.model_loading import shard_module

TOLERANCE = 1e-5
STEPS = 3
LAYOUTS = ("t2", "t2_sp")


def full_model(config: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.2 * torch.randn_like(parameter))
    return model


def build(config: ModelConfig, layout: str, group) -> Transformer:
    if layout == "t1":
        return full_model(config)
    parallel = ParallelContext(tp_rank=group.rank(), tp_size=2, tp_group=group)
    return shard_module(full_model(config), parallel, sequence_parallel=layout == "t2_sp")


def batches(vocab_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    odd = torch.randint(0, vocab_size, (15,), generator=generator)
    shared = torch.randint(0, vocab_size, (16,), generator=generator)
    shared[5:9] = shared[:4]  # the second sequence begins like the first
    return {
        "15_tokens": (odd, torch.tensor([0, 6, 15], dtype=torch.int32)),
        "shared_prefix": (shared, torch.tensor([0, 5, 14, 16], dtype=torch.int32)),
    }


def loss_and_outputs(model: Transformer, packed, cu_seqlens):
    """A loss through what the interfaces read: log-probs and entropies, or values."""
    if model.config.is_critic:
        output = model(packed, cu_seqlens)
        weights = torch.linspace(-1.0, 1.0, output.numel())
        return (output * weights).sum(), {"values": output.detach()}
    hidden = model(packed, cu_seqlens, apply_lm_head=False)  # the fused head reads these
    logprobs, entropy = model.shifted_logprobs_and_entropy(hidden, packed, cu_seqlens)
    loss = -(logprobs * torch.linspace(0.5, 1.5, logprobs.numel())).sum() - 0.3 * entropy.sum()
    return loss, {"logprobs": logprobs.detach(), "entropy": entropy.detach()}


def full_gradients(model: Transformer, group) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if model.tp_size == 1:
        return grads
    shards = [None, None]
    dist.all_gather_object(shards, grads, group=group)
    return unshard_state_dicts(shards, model.config)


def forward_backward(config: ModelConfig, layout: str, group, packed, cu_seqlens,
                     checkpointing: bool) -> dict:
    model = build(config, layout, group)
    model.gradient_checkpointing = checkpointing
    loss, outputs = loss_and_outputs(model, packed, cu_seqlens)
    loss.backward()
    norms = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("norm.weight")}
    parallel = ParallelContext(tp_rank=group.rank(), tp_size=model.tp_size, tp_group=group)
    sum_sequence_parallel_gradients([(p, p.grad) for p in model.parameters()], parallel)
    return {"outputs": outputs, "grads": full_gradients(model, group), "norm_grads": norms,
            "marked": sorted(n for n, p in model.named_parameters()
                             if getattr(p, "sequence_parallel", False))}


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item()


def compare_forward_backward(config: ModelConfig, group) -> dict:
    """Errors of t2 and t2_sp against t1 per batch and checkpointing."""
    errors, partial_norms, marked = {}, {}, {}
    for batch_name, (packed, cu_seqlens) in batches(config.vocab_size).items():
        for checkpointing in (False, True) if batch_name == "15_tokens" else (False,):
            runs = {layout: forward_backward(config, layout, group, packed, cu_seqlens,
                                             checkpointing) for layout in ("t1", *LAYOUTS)}
            reference = runs["t1"]
            for layout in LAYOUTS:
                run = runs[layout]
                key = f"{layout}/{batch_name}/checkpointing={checkpointing}"
                errors[key] = {name: max_error(value, reference["outputs"][name])
                               for name, value in run["outputs"].items()}
                errors[key]["grads"] = max(max_error(run["grads"][n], g)
                                           for n, g in reference["grads"].items())
                partial_norms[key] = min(max_error(run["norm_grads"][n], g)
                                         for n, g in reference["norm_grads"].items())
                marked[key] = run["marked"]
    return {"errors": errors, "partial_norms": partial_norms, "marked": marked}


def train_run(config: ModelConfig, layout: str, backend: OptimizerBackendName, group):
    """`STEPS` clipped AdamW steps on the two batches as two micro-batches; full weights."""
    model = build(config, layout, group)
    tp_size = model.tp_size
    parallel = ParallelContext(tp_rank=group.rank() if tp_size > 1 else 0, tp_size=tp_size,
                               tp_group=group if tp_size > 1 else None)
    optimizer = OptimizerConfig(lr=1e-3, eps=1e-4, gradient_clipping=0.5,
                                lr_scheduler=LRScheduler.constant, weight_decay=0.01)
    engine = TorchEngine(model, None, parallel, optimizer, 10, backend=backend)
    microbatches = list(batches(config.vocab_size).values())

    def loss_fn(forward, microbatch):
        packed, cu_seqlens = microbatch
        loss, _ = loss_and_outputs(model, packed, cu_seqlens)
        return loss * 0.01, {"loss": float(loss.detach())}

    norms = [engine.train_microbatches(microbatches, loss_fn)["grad_norm"] for _ in range(STEPS)]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    if tp_size > 1:
        shards = [None, None]
        dist.all_gather_object(shards, weights, group=group)
        weights = unshard_state_dicts(shards, config)
    return weights, norms


def compare_training(config: ModelConfig, group) -> dict:
    reference, reference_norms = train_run(config, "t1", OptimizerBackendName.torch, group)
    errors = {}
    for backend in (OptimizerBackendName.torch, OptimizerBackendName.megatron):
        for layout in LAYOUTS:
            weights, norms = train_run(config, layout, backend, group)
            errors[f"{layout}/{backend.value}"] = {
                "weights": max(max_error(weights[n], w) for n, w in reference.items()),
                "grad_norm": max(abs(a - b) / b for a, b in zip(norms, reference_norms)),
            }
    return errors


def compare_generation(group) -> dict:
    prompts = torch.tensor([5, 9, 14, 3, 22, 7, 30, 11, 4])
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    results = {}
    for layout in LAYOUTS:
        model = build(CONFIGS["qwen2_untied"], layout, group)
        with torch.no_grad():
            out = generate(model, prompts, cu_seqlens, GenerationConfig(max_new_tokens=6,
                           greedy=True), torch.Generator().manual_seed(0))
        results[layout] = (out.packed_input_ids, out.packed_logprobs)
    (ids, logprobs), (sp_ids, sp_logprobs) = results["t2"], results["t2_sp"]
    return {"same_tokens": torch.equal(ids, sp_ids), "logprob_error": max_error(sp_logprobs,
                                                                               logprobs)}


def saved_activation_bytes(config: ModelConfig, layout: str, group, tokens: int) -> int:
    """Bytes of the distinct non-parameter tensors a training forward saves for its
    backward, on this rank."""
    model = build(config, layout, group)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    generator = torch.Generator().manual_seed(3)
    packed = torch.randint(0, config.vocab_size, (tokens,), generator=generator)
    cu_seqlens = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = loss_and_outputs(model, packed, cu_seqlens)
    del loss
    return sum(storages.values())


def measure_activations(group) -> dict:
    """Saved bytes per rank of a wide, deep critic (no logits), at 1 and 3 layers."""
    results = {}
    for layers in (1, 3):
        config = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, is_critic=True)
        for layout in ("t1", *LAYOUTS):
            results[(layers, layout)] = saved_activation_bytes(config, layout, group, 512)
    return results


def worker(rank: int, rendezvous: str, output: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        from megatron_cpu_shim import cuda_to_cpu

        with cuda_to_cpu():
            group = dist.new_group([0, 1])
            results = {
                "forward_backward": {n: compare_forward_backward(c, group)
                                     for n, c in CONFIGS.items()},
                "training": {n: compare_training(c, group) for n, c in CONFIGS.items()
                             if n != "qwen2_untied"},
                "generation": compare_generation(group),
                "activations": measure_activations(group),
            }
        torch.save(results, f"{output}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("sequence_parallel")
    output = str(directory / "result")
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(worker, (str(directory / "rendezvous"), output), 2)
    return [torch.load(f"{output}.rank{rank}", weights_only=False) for rank in range(2)]


def test_sequence_parallel_forward_and_gradients_equal_t2_and_t1(ranks):
    for result in ranks:
        for name, per_model in result["forward_backward"].items():
            for key, errors in per_model["errors"].items():
                expected = {"values"} if name == "critic" else {"logprobs", "entropy"}
                assert set(errors) == expected | {"grads"}, (name, key)
                for what, error in errors.items():
                    assert error <= TOLERANCE, (name, key, what, error)


def test_sequence_parallel_norm_gradients_are_partial_until_summed_over_tp(ranks):
    for result in ranks:
        for name, per_model in result["forward_backward"].items():
            for key, error in per_model["partial_norms"].items():
                marked = per_model["marked"][key]
                # Qwen3's per-head query and key norms (2 layers x 2) are partial at any tp size
                per_head = [n for n in marked if n.endswith(("q_norm.weight", "k_norm.weight"))]
                assert len(per_head) == (4 if name == "qwen3" else 0), (name, marked)
                if key.startswith("t2_sp"):
                    # 2 layers x 2 norms + the final norm, nothing else
                    assert len(marked) - len(per_head) == 5, marked
                    assert all("norm" in n for n in marked), marked
                    assert error > 1e-3, (name, key, error)
                else:  # the norms over the hidden size see every token: their gradients full
                    assert marked == per_head and error <= TOLERANCE, (name, key, error)


def test_sequence_parallel_training_equals_t1_on_both_optimizer_backends(ranks):
    for result in ranks:
        for name, per_layout in result["training"].items():
            assert set(per_layout) == {"t2/torch", "t2_sp/torch", "t2/megatron",
                                       "t2_sp/megatron"}
            for layout, errors in per_layout.items():
                assert errors["weights"] <= TOLERANCE, (name, layout, errors)
                assert errors["grad_norm"] <= TOLERANCE, (name, layout, errors)


def test_sequence_parallel_generation_matches_t2(ranks):
    for result in ranks:
        assert result["generation"]["same_tokens"]
        assert result["generation"]["logprob_error"] <= TOLERANCE


def test_sequence_parallel_saves_fewer_activations_per_rank(ranks):
    activations = ranks[0]["activations"]
    per_layer = {layout: (activations[(3, layout)] - activations[(1, layout)]) / 2
                 for layout in ("t1", *LAYOUTS)}
    print("saved activation bytes per rank, 512 tokens, hidden 256, intermediate 512:",
          {f"{layers} layers {layout}": b for (layers, layout), b in activations.items()},
          "per layer:", per_layer)
    assert per_layer["t2_sp"] < per_layer["t2"] < per_layer["t1"]
    assert activations[(3, "t2_sp")] < activations[(3, "t2")]
