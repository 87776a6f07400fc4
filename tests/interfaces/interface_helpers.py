"""Tiny models, engines and hand-built batches for the interface tests (nothing downloaded).

A module of its own, not conftest.py: `from conftest import ...` picks whichever conftest was
imported first when several test folders are collected together."""

from __future__ import annotations

import torch

from realrl.api.data import SequenceSample
from realrl.api.experiment import LRScheduler, OptimizerConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer

EOS_ID = 1  # the char tokenizer's <eos>


def tiny_config(vocab_size: int, family: str = "qwen2", critic: bool = False) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        qkv_bias=family == "qwen2",
        model_type=family,
        eos_token_id=EOS_ID,
        is_critic=critic,
    )


def build_model(vocab_size: int, seed: int = 0, family: str = "qwen2", critic: bool = False):
    torch.manual_seed(seed)
    model = Transformer(tiny_config(vocab_size, family, critic))
    if critic:  # a zero value head gives zero gradients to the body; start from random values
        torch.nn.init.normal_(model.value_head.weight, std=0.1)
    return model


def make_engine(
    model,
    tokenizer,
    lr: float | None = 1e-3,
    parallel=None,
    seed: int = 0,
    adam_eps: float = 1e-8,
    gradient_clipping: float = 0.0,
):
    """An engine over ``model``; ``lr=None`` freezes it. Parity tests pass a large ``adam_eps``:
    Adam's first steps are ``lr * g / (|g| + eps)``, which turns the rounding noise of a nearly
    zero gradient into an lr-sized step unless eps dominates such gradients."""
    optimizer = None
    if lr is not None:
        optimizer = OptimizerConfig(
            lr=lr,
            weight_decay=0.0,
            warmup_steps_proportion=0.0,
            lr_scheduler=LRScheduler.constant,
            gradient_clipping=gradient_clipping,
            eps=adam_eps,
        )
    engine = TorchEngine(model, tokenizer, parallel or ParallelContext(), optimizer, 100)
    engine.generator = torch.Generator().manual_seed(seed)
    return engine


def prompt_batch(tokenizer, prompts: list[str], metadata: dict | None = None) -> SequenceSample:
    encoded = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    return SequenceSample.from_default(
        ids=[f"q{i}" for i in range(len(prompts))],
        seqlens=[len(e) for e in encoded],
        data={"packed_prompts": torch.tensor([t for e in encoded for t in e], dtype=torch.int64)},
        metadata=metadata,
    )


def rollout_batch(
    engine,
    groups: list[list[tuple[list[int], list[int]]]],
    rewards: list[float],
    no_eos: list[bool] | None = None,
) -> SequenceSample:
    """A PPO rollout built by hand: ``groups[i]`` lists (prompt, response) token lists of sample
    i. ``packed_logprobs`` come from ``engine``'s model (so the PPO ratio starts at 1) and are 0
    at prompt positions, as the generation engine writes them."""
    from realrl.api.dfg import MicroBatchSpec
    from realrl.interfaces.common import loss_mask_from_prompt_mask
    from realrl.interfaces.reference import ReferenceInterface

    tokens, prompt_mask, seqlens = [], [], []
    for group in groups:
        lengths = []
        for prompt, response in group:
            tokens += prompt + response
            prompt_mask += [True] * len(prompt) + [False] * len(response)
            lengths.append(len(prompt) + len(response))
        seqlens.append(lengths)
    num_seqs = sum(len(g) for g in groups)
    ids = [f"s{i}" for i in range(len(groups))]
    sample = SequenceSample.from_tensors(
        ids=ids,
        seqlens={
            "packed_input_ids": seqlens,
            "prompt_mask": seqlens,
            "rewards": [[1] * len(g) for g in groups],
            "seq_no_eos_mask": [[1] * len(g) for g in groups],
        },
        data={
            "packed_input_ids": torch.tensor(tokens, dtype=torch.int64),
            "prompt_mask": torch.tensor(prompt_mask),
            "rewards": torch.tensor(rewards, dtype=torch.float32),
            "seq_no_eos_mask": torch.tensor(no_eos or [False] * num_seqs),
        },
    )
    logprobs = ReferenceInterface().inference(engine, sample, MicroBatchSpec()).data
    mask = loss_mask_from_prompt_mask(
        sample.data["prompt_mask"], sample.cu_seqlens("packed_input_ids")
    )
    logprobs.data["packed_ref_logprobs"] = logprobs.data["packed_ref_logprobs"] * mask
    sample.update_(logprobs.rename({"packed_ref_logprobs": "packed_logprobs"}))
    return sample
