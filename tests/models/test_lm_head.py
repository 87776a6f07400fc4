"""The fused LM head + log-softmax (`realrl.models.lm_head`) against the unchunked computation.

Reference: the model's whole [tokens, vocab] logits, log-softmax in float64. Tolerance: the fused
path computes in fp32 (matmul and softmax), so values and gradients agree within 1e-5 absolute
and relative (measured: ~1e-6) on these tiny random models. The chunk budget is shrunk so that
every case runs several chunks.
"""

from __future__ import annotations

import pytest
import torch
from tiny_hf_models import random_packed_batch, save_hf

from realrl.algo import layout
from realrl.api.data import SequenceSample
from realrl.api.experiment import OptimizerConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.checkpoint import load_pretrained
from realrl.models.config import ModelConfig
from realrl.models.lm_head import lm_head_logprobs
from realrl.models.transformer import Transformer

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
LENGTHS = [7, 1, 19, 12, 3]


def chunk_rows(monkeypatch, rows: int, vocab_size: int = 96) -> None:
    """Chunks of `rows` rows (the default rule would take these tiny batches in one chunk)."""
    monkeypatch.setattr(layout, "_LOGIT_CHUNK_ELEMENTS", rows * vocab_size)
    monkeypatch.setattr(layout, "_MIN_CHUNK_ROWS", 1)


def tiny_model(tied: bool, vocab_size: int = 96) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.3 * torch.randn_like(parameter))
    return model


def reference_logprobs_and_entropy(logits, packed_input_ids, cu_seqlens, temperature):
    """Unchunked float64 log-softmax of the whole logits [total_tokens, vocab]."""
    rows = layout.prediction_rows(cu_seqlens)
    log_probs = (logits[rows].double() / temperature).log_softmax(-1)
    picked = log_probs.gather(-1, packed_input_ids[rows + 1, None].long()).squeeze(-1)
    return picked, -(log_probs.exp() * log_probs).sum(-1)


def loss_and_gradients(model, logprobs, entropy, entropy_weight):
    """A loss weighting every token differently, and the gradient of every parameter."""
    weights = torch.linspace(0.5, 1.5, logprobs.numel(), dtype=logprobs.dtype)
    loss = -(logprobs * weights).sum() - entropy_weight * (entropy * weights.flip(0)).sum()
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_fused_head_matches_unchunked_logits_in_values_and_every_gradient(
    monkeypatch, tied, temperature, entropy_weight
):
    chunk_rows(monkeypatch, 5)  # 8 chunks of the 37 rows
    model = tiny_model(tied)
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96, seed=3)

    logits = model(packed, cu_seqlens)
    expected = reference_logprobs_and_entropy(logits, packed, cu_seqlens, temperature)
    expected_grads = loss_and_gradients(model, *expected, entropy_weight)

    hidden = model(packed, cu_seqlens, apply_lm_head=False)
    got = model.shifted_logprobs_and_entropy(hidden, packed, cu_seqlens, temperature)
    if entropy_weight == 0.0:
        got = got[0], got[1].detach()
    grads = loss_and_gradients(model, *got, entropy_weight)

    for value, reference in zip(got, expected):
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), reference.detach(), **TOLERANCE)
    assert sorted(grads) == sorted(expected_grads)
    assert ("lm_head.weight" in grads) != tied  # a tied head's gradient goes to the embedding
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name].float(), **TOLERANCE, msg=name)


def test_log_probs_alone_equal_those_read_with_the_entropy(monkeypatch):
    chunk_rows(monkeypatch, 4)
    model = tiny_model(tied=False)
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96, seed=4)
    with torch.no_grad():
        hidden = model(packed, cu_seqlens, apply_lm_head=False)
        alone = model.shifted_logprobs(hidden, packed, cu_seqlens)
        with_entropy, _ = model.shifted_logprobs_and_entropy(hidden, packed, cu_seqlens)
    assert torch.equal(alone, with_entropy)


def test_fused_head_rejects_logits_in_place_of_hidden_states():
    model = tiny_model(tied=True)
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96, seed=5)
    with torch.no_grad(), pytest.raises(ValueError, match="apply_lm_head=False"):
        model.shifted_logprobs(model(packed, cu_seqlens), packed, cu_seqlens)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_packed_log_probs_equal_a_right_padded_transformers_batch(tmp_path, tied):
    """HF parity and packed vs padded at once: the fused log-probs of a packed batch equal
    transformers' log-softmax of a right-padded batch at the next tokens."""
    hf_model = save_hf(tmp_path, "qwen2", tie_word_embeddings=tied)
    model = load_pretrained(tmp_path)
    sequences, packed, cu_seqlens = random_packed_batch(LENGTHS, model.config.vocab_size, seed=2)
    padded = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    attention_mask = torch.zeros_like(padded)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = sequence
        attention_mask[row, : len(sequence)] = 1
    with torch.no_grad():
        hidden = model(packed, cu_seqlens, apply_lm_head=False)
        logprobs = model.shifted_logprobs(hidden, packed, cu_seqlens)
        padded_logprobs = hf_model(padded, attention_mask=attention_mask).logits.log_softmax(-1)
    expected = torch.cat([
        padded_logprobs[row, : len(s) - 1].gather(-1, s[1:, None]).squeeze(-1)
        for row, s in enumerate(sequences)
    ])
    assert logprobs.shape == (sum(LENGTHS) - len(LENGTHS),)
    assert (logprobs - expected).abs().max() <= 1e-5


def largest_saved_activation(vocab_size: int) -> int:
    """The most elements of any tensor a training step's autograd graph saves for its backward,
    parameters aside: one train call through the engine, as an interface's loss runs it."""
    model = tiny_model(tied=False, vocab_size=vocab_size)
    engine = TorchEngine(model, None, ParallelContext(), OptimizerConfig(lr=1e-3))
    _, packed, cu_seqlens = random_packed_batch([40, 24], vocab_size, seed=6)
    sample = SequenceSample.from_tensors(
        ids=["a", "b"], seqlens={"packed_input_ids": [[40], [24]]},
        data={"packed_input_ids": packed},
    )
    parameters = {p.data_ptr() for p in model.parameters()}
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in parameters:
            saved.append(tensor.numel())
        return tensor

    def loss_fn(forward, part):
        ids, part_cu_seqlens = part.data["packed_input_ids"], part.cu_seqlens("packed_input_ids")
        output = forward(ids, part_cu_seqlens)
        return -engine.module.shifted_logprobs(output, ids, part_cu_seqlens).sum(), {}

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine.train_microbatches([sample], loss_fn)
    return max(saved)


def test_training_saves_no_activation_that_grows_with_the_vocabulary():
    """64 tokens: [tokens, vocab] logits would be the largest saved tensor (2^16 elements at a
    1024-token vocabulary, 2^18 at 4096). The fused head saves hidden states and per-token
    numbers only, so the largest saved activation is the same at both vocabulary sizes."""
    small, large = largest_saved_activation(1024), largest_saved_activation(4096)
    assert small == large
    assert large < 64 * 1024


def test_bf16_weights_give_fp32_log_probs_within_bf16_logit_rounding(monkeypatch):
    """A bf16 head computes bf16 logits (as `F.linear` does) and upcasts each chunk: the result
    equals the unfused layout functions on the whole bf16 logits to fp32 rounding."""
    chunk_rows(monkeypatch, 6)
    model = tiny_model(tied=False).to(torch.bfloat16)
    _, packed, cu_seqlens = random_packed_batch(LENGTHS, 96, seed=7)
    hidden = model(packed, cu_seqlens, apply_lm_head=False).detach().requires_grad_()
    weight = model.lm_head_weight().detach().requires_grad_()
    logprobs, _ = lm_head_logprobs(hidden, weight, packed, cu_seqlens)
    logprobs.sum().backward()
    reference_hidden = hidden.detach().requires_grad_()
    reference_weight = weight.detach().requires_grad_()
    logits = reference_hidden @ reference_weight.T  # [total_tokens, vocab] bf16
    expected = layout.packed_shifted_logprobs(logits, packed, cu_seqlens)
    expected.sum().backward()
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, rtol=0, atol=2**-8)
    torch.testing.assert_close(weight.grad, reference_weight.grad, rtol=2**-7, atol=2**-8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_fused_head_in_512_row_chunks_matches_whole_logits():
    """On CUDA a chunk holds at least 512 rows (`realrl.algo.layout`); 1200 rows of a 96-token
    vocabulary take 3 chunks. bf16 weights: the same bf16 logits as `F.linear`, fp32 softmax."""
    model = tiny_model(tied=True).to("cuda", torch.bfloat16)
    packed = torch.randint(0, 96, (1204,), generator=torch.Generator().manual_seed(8)).cuda()
    cu_seqlens = torch.tensor([0, 301, 602, 903, 1204], dtype=torch.int32, device="cuda")
    assert len(layout.logit_row_chunks(layout.prediction_rows(cu_seqlens), 96)) == 3
    with torch.no_grad():
        hidden = model(packed, cu_seqlens, apply_lm_head=False)
        logprobs, entropy = model.shifted_logprobs_and_entropy(hidden, packed, cu_seqlens)
        logits = model(packed, cu_seqlens)  # [tokens, vocab] bf16
    # cuBLAS may round a bf16 logit differently for another number of rows: one bf16 spacing
    # (2^-6 below 4) per logit moves a log-prob or an entropy by at most two.
    tolerance = dict(rtol=0, atol=2**-5)
    expected = layout.packed_shifted_logprobs(logits, packed, cu_seqlens)
    torch.testing.assert_close(logprobs, expected, **tolerance)
    torch.testing.assert_close(entropy, layout.packed_entropy(logits, cu_seqlens), **tolerance)
