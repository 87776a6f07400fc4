"""Fixtures shared by several test folders.

`chat_model` is a checkpoint shaped like Qwen2.5-Instruct, small enough for a CLI run on a CPU:
a tiny random Qwen2 built from a config, a byte-level BPE tokenizer trained in-process (about a
second) with Qwen's control tokens and a Qwen-style chat template, config.json naming one EOS
(`<|im_end|>`) and generation_config.json two (`<|im_end|>`, `<|endoftext|>`). Nothing is
downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's template without tool calls: a default system turn, then one turn per message.
QWEN_STYLE_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "system\nYou are a helpful assistant.\nuser\nassistant\n",
    "What is 12+345? The answer is 357.",
    "7-9=-2 and 3*4=12, so 12/4=3.",
    "Compute 1+1. 2",
] * 20


def build_chat_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with Qwen's control tokens and chat template, saved to
    `directory`: EOS `<|im_end|>`, pad `<|endoftext|>`, no BOS."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=CHAT_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = QWEN_STYLE_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2.5-Instruct-shaped tiny checkpoint directory (see the module docstring)."""
    directory = tmp_path_factory.mktemp("chat_model") / "model"
    tokenizer = build_chat_tokenizer(directory)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=end_of_text,
        eos_token_id=im_end,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    generation_config = {
        "bos_token_id": end_of_text,
        "eos_token_id": [im_end, end_of_text],
        "pad_token_id": end_of_text,
        "do_sample": True,
        "temperature": 0.7,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return directory
