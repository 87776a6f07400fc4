"""Checkpoint pieces: resuming a weights-only checkpoint's LR schedule, the EOS ids a model
trained on answers is saved with, and the `checkpoint.*` keys."""

from __future__ import annotations

import copy

import pytest
import torch

from realrl.api.config import ConfigError, resolve_config
from realrl.api.experiment import DatasetKind, LRScheduler, OptimizerConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.models.checkpoint import load_pretrained
from realrl.models.config import ModelConfig
from realrl.models.tokenizer import load_tokenizer
from realrl.models.transformer import Transformer
from realrl.workers.checkpointing import _resume_schedule_only, config_to_save

TINY = dict(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _engine() -> TorchEngine:
    torch.manual_seed(0)
    optimizer = OptimizerConfig(
        lr=1e-3, lr_scheduler=LRScheduler.linear, warmup_steps_proportion=0.5
    )
    return TorchEngine(
        Transformer(ModelConfig(**TINY)),
        None,
        ParallelContext(),
        optimizer,
        total_optimizer_steps=10,
    )


def _step(engine: TorchEngine) -> None:
    for parameter in engine.module.parameters():
        parameter.grad = torch.ones_like(parameter)
    engine.optimizer.step()
    engine.lr_scheduler.step()


def test_weights_only_resume_goes_on_with_the_lr_schedule_and_fresh_moments():
    """Without the schedule a resumed run would warm up from lr 0 again; with it, the resumed
    engine's learning rate is the interrupted one's at every following step."""
    interrupted, resumed = _engine(), _engine()
    for _ in range(4):
        _step(interrupted)
    _resume_schedule_only(resumed, interrupted.lr_scheduler.state_dict())
    assert resumed.optimizer.state == {}  # AdamW's moments start from zero
    for _ in range(3):
        assert (
            resumed.optimizer.param_groups[0]["lr"] == interrupted.optimizer.param_groups[0]["lr"]
        )
        _step(interrupted)
        _step(resumed)
    assert resumed.lr_scheduler.last_epoch == interrupted.lr_scheduler.last_epoch == 7


def test_a_model_trained_on_chat_answers_is_saved_with_their_end_token_as_eos(chat_model, tmp_path):
    """A base model's config and tokenizer name <|endoftext|> as EOS while its chat template
    closes a turn with <|im_end|>: after SFT on templated answers generation must stop at
    <|im_end|>, so the saved generation_config.json lists it too."""
    tokenizer = copy.deepcopy(load_tokenizer(chat_model))
    tokenizer.eos_token = "<|endoftext|>"
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = load_pretrained(chat_model).config
    base = ModelConfig(**{**vars(config), "eos_token_id": end_of_text, "generation_config": None})

    saved = config_to_save(base, tokenizer, DatasetKind.sft, None)
    assert saved.eos_token_ids == [end_of_text, im_end]
    assert saved.eos_token_id == end_of_text  # config.json keeps its own
    raw = config_to_save(base, tokenizer, DatasetKind.sft, False)  # raw answers end with EOS
    assert raw.eos_token_ids == [end_of_text]
    assert config_to_save(base, tokenizer, DatasetKind.prompt, None) is base
    critic = ModelConfig(**{**vars(base), "is_critic": True})
    assert config_to_save(critic, tokenizer, DatasetKind.paired, None) is critic


def test_checkpoint_keys_resolve_and_a_negative_keep_last_is_reported():
    config = resolve_config(
        PPOMathConfig, ["checkpoint.weights_only=true", "checkpoint.keep_last=null"]
    )
    assert config.checkpoint.weights_only and config.checkpoint.keep_last is None
    with pytest.raises(ConfigError, match=r"`checkpoint.keep_last=-1` must be >= 1, or 0/null"):
        resolve_config(PPOMathConfig, ["checkpoint.keep_last=-1"])
