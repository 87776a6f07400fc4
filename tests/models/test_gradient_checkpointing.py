"""Activation checkpointing (`<role>.gradient_checkpointing`, `Transformer.gradient_checkpointing`).

The blocks recomputed in the backward give the same loss and gradients as the stored ones,
eager and compiled; the backward then holds only each block's input instead of its
activations; inference forwards are unaffected. (Under tensor parallelism:
`tests/backends/test_megatron_backend.py`, t2 with checkpointing against t1.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_hf_models import TINY

from realrl.models.compiled import enable_compiled_blocks
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer

LENGTHS = [7, 19, 12, 3]


def build_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, "num_hidden_layers": 3}))


def packed_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(0, vocab_size, (sum(LENGTHS),), generator=generator)
    cu_seqlens = torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return packed, cu_seqlens


def loss_and_gradients(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    packed, cu_seqlens = packed_batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    hidden = model(packed, cu_seqlens, apply_lm_head=False)
    logprobs = model.shifted_logprobs(hidden, packed, cu_seqlens)
    loss = -logprobs.mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def checkpointed(model: Transformer) -> Transformer:
    copied = copy.deepcopy(model)
    copied.gradient_checkpointing = True
    return copied


def assert_same(got, expected) -> None:
    loss, grads = got
    expected_loss, expected_grads = expected
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_recomputed_blocks_give_the_same_loss_and_gradients():
    model = build_model()
    assert_same(loss_and_gradients(checkpointed(model)), loss_and_gradients(model))


def test_recomputed_compiled_blocks_give_the_same_loss_and_gradients():
    torch._dynamo.reset()
    model = build_model()
    enable_compiled_blocks(model, "actor.compile")
    try:
        assert_same(loss_and_gradients(checkpointed(model)), loss_and_gradients(model))
    finally:
        torch._dynamo.reset()


def saved_bytes(model: Transformer) -> int:
    """Bytes the training forward hands autograd to keep for the backward, outside the
    recomputed blocks (whose saved tensors the checkpoint drops), plus what checkpointing
    keeps instead: each block's input."""
    packed, cu_seqlens = packed_batch(model.config.vocab_size)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(packed, cu_seqlens)
    activations = sum(size for pointer, size in storages.items() if pointer not in parameters)
    block_inputs = len(model.layers) * sum(LENGTHS) * model.config.hidden_size * 4
    return activations + (block_inputs if model.gradient_checkpointing else 0)


def test_checkpointing_keeps_block_inputs_instead_of_block_activations():
    model = build_model()
    stored, recomputed = saved_bytes(model), saved_bytes(checkpointed(model))
    # The blocks' activations are ~(16 x hidden + 4 x intermediate) values per token per layer
    # against 1 x hidden kept; embedding and head keep the same in both.
    assert recomputed < 0.3 * stored


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_inference_forward_is_unchanged(grad):
    model = build_model()
    packed, cu_seqlens = packed_batch(model.config.vocab_size)
    with torch.set_grad_enabled(grad):
        expected = model(packed, cu_seqlens)
        got = checkpointed(model)(packed, cu_seqlens)
    assert torch.equal(got, expected)
