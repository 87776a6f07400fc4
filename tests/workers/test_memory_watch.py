"""Each MFC call's peak memory, and the token-budget hint when it nears the worker's limit."""

from __future__ import annotations

import logging
import re

import torch

from realrl.algo import layout
from realrl.algo.layout import packed_shifted_logprobs
from realrl.api.experiment import OptimizerConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer
from realrl.workers.memory_watch import (
    NEAR_LIMIT,
    TARGET,
    CallMemory,
    MemoryWatch,
    PeakMemory,
    memory_limit_bytes,
    near_limit_hint,
)

MB = 2**20
VOCAB_SIZE = 16384
SEQUENCE_TOKENS = 128
BATCH_TOKENS = 4096  # its fp32 logits: 256 MB, several times the process's own memory


def test_the_peak_of_one_call_is_measured_and_reset_for_the_next():
    peak = PeakMemory(torch.device("cpu"))
    peak.start()
    large = torch.ones(300 * MB // 4)  # 300 MB, touched
    del large
    first = peak.stop()
    assert first.peak_bytes - first.held_at_start_bytes > 280 * MB
    assert first.grew
    peak.start()
    small = torch.ones(10 * MB // 4)
    del small
    second = peak.stop()
    assert second.peak_bytes < first.peak_bytes - 200 * MB


def test_the_limit_is_the_gpu_or_a_share_of_the_machine(monkeypatch):
    whole = memory_limit_bytes(torch.device("cpu"), 1)
    assert whole > 0
    assert memory_limit_bytes(torch.device("cpu"), 4) == whole // 4
    # CUDA: the device's free memory plus this process's reservation, so that what another
    # process holds on the GPU (a colocated vLLM engine) is not counted as this worker's.
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * gib)
    assert memory_limit_bytes(torch.device("cuda", 0), 1) == 42 * gib
    assert MemoryWatch(torch.device("cuda", 0), 1).limit_bytes == 42 * gib
    assert MemoryWatch(torch.device("cuda", 0), 1, limit_bytes=gib).limit_bytes == gib


def _engine() -> TorchEngine:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, model_type="qwen2",
        eos_token_id=1,
    ))
    return TorchEngine(model, None, ParallelContext(), OptimizerConfig(lr=1e-4), 10)


def _microbatches(max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch (32 sequences of 128 tokens) in micro-batches of at most `max_tokens`."""
    input_ids = torch.randint(2, VOCAB_SIZE, (BATCH_TOKENS,), generator=torch.Generator())
    per_microbatch = max(1, max_tokens // SEQUENCE_TOKENS) * SEQUENCE_TOKENS
    pieces = torch.split(input_ids, per_microbatch)
    return [
        (piece, torch.arange(0, piece.numel() + 1, SEQUENCE_TOKENS, dtype=torch.int32))
        for piece in pieces
    ]


def _loss_through_whole_logits(module: Transformer):
    """A loss that materialises [tokens, vocab] logits on purpose (the unfused head, not what
    the interfaces run): memory that grows per token, as the watch's hint assumes."""

    def loss_fn(forward, microbatch):
        input_ids, cu_seqlens = microbatch
        logits = module.head(forward(input_ids, cu_seqlens))  # [tokens, vocab]
        logprobs = packed_shifted_logprobs(logits, input_ids, cu_seqlens)
        return -logprobs.sum() / BATCH_TOKENS, {}

    return loss_fn


def _train_call(watch: MemoryWatch, engine: TorchEngine, max_tokens: int) -> float:
    watch.start(engine)
    engine.train_microbatches(_microbatches(max_tokens), _loss_through_whole_logits(engine.module))
    return watch.stop("actor_train", False, engine)


def test_a_call_near_the_limit_logs_a_token_budget_that_fits(monkeypatch, caplog):
    """The [tokens, vocab] logits and their gradient dominate this call's memory (its loss
    materialises them on purpose): a budget from the measured bytes per token brings the peak
    under the limit. Log-probs are computed in chunks of 16 rows' logits, a small fixed part of
    a micro-batch's memory."""
    monkeypatch.setattr(layout, "_LOGIT_CHUNK_ELEMENTS", 16 * VOCAB_SIZE)
    monkeypatch.setattr(layout, "_MIN_CHUNK_ROWS", 1)
    engine = _engine()
    probe = MemoryWatch(torch.device("cpu"), 1, limit_bytes=2**50)
    _train_call(probe, engine, BATCH_TOKENS)  # warm-up: optimizer state, first-touch pages
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    engine.train_microbatches(_microbatches(BATCH_TOKENS), _loss_through_whole_logits(engine.module))
    measured = memory.stop()
    limit = int(measured.peak_bytes / 0.95)  # the one-micro-batch call peaks at 95% of it
    assert measured.live_at_start_bytes < 0.6 * limit, "the process holds too much for this test"
    watch = MemoryWatch(torch.device("cpu"), 1, limit_bytes=limit)
    with caplog.at_level(logging.WARNING, logger="realrl.workers.memory_watch"):
        first_gb = _train_call(watch, engine, BATCH_TOKENS)
        _train_call(watch, engine, BATCH_TOKENS)  # logged once per MFC
    hints = [r.getMessage() for r in caplog.records
             if "max_tokens_per_microbatch" in r.getMessage()]
    assert len(hints) == 1, caplog.text
    budget = int(re.search(r"`actor_train\.max_tokens_per_microbatch=(\d+)`", hints[0]).group(1))
    assert SEQUENCE_TOKENS <= budget < BATCH_TOKENS
    assert budget % 64 == 0
    within_budget_gb = _train_call(watch, engine, budget)
    assert within_budget_gb * 2**30 < NEAR_LIMIT * limit
    assert within_budget_gb < first_gb


def test_no_hint_below_the_limit_or_for_a_call_that_fit_in_held_memory():
    below = CallMemory(peak_bytes=50, live_at_start_bytes=10, held_at_start_bytes=10)
    assert near_limit_hint("actor_train", False, below, 100, limit_bytes=100) is None
    fit = CallMemory(peak_bytes=95, live_at_start_bytes=10, held_at_start_bytes=95)
    assert near_limit_hint("actor_train", False, fit, 100, limit_bytes=100) is None


def test_memory_held_before_the_call_gets_a_precision_hint_not_a_budget():
    held = CallMemory(peak_bytes=95, live_at_start_bytes=int(TARGET * 100) + 1,
                      held_at_start_bytes=80)
    hint = near_limit_hint("ref_inf", False, held, 100, limit_bytes=100)
    assert "no token budget helps" in hint and "dtype=bfloat16" in hint


def test_generation_near_the_limit_names_batch_size():
    memory = CallMemory(peak_bytes=95, live_at_start_bytes=10, held_at_start_bytes=20)
    hint = near_limit_hint("actor_gen", True, memory, 0, limit_bytes=100)
    assert "dataset.batch_size" in hint and "max_tokens_per_microbatch" not in hint
