"""The built-in default model, produced by realrl itself (nothing is downloaded).

`fresh_default_model(dir)` writes a randomly initialised tiny Qwen2-architecture model with the
character tokenizer of the built-in arithmetic task, in Hugging Face format. The `sft`
experiment starts from it when `model.path` is empty; ppo-math's default actor is the result of
that SFT warm start (see `realrl.launcher.warm_start`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from realrl.models.tokenizer import build_char_tokenizer

DEFAULT_ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def fresh_default_model(directory: str | Path, seed: int = 1,
                        architecture: dict | None = None) -> Path:
    """Write the tiny default model (random weights from `seed`) and its tokenizer;
    `architecture` replaces `DEFAULT_ARCHITECTURE` (benchmarks use larger sizes; its
    `model_type`, default qwen2, picks the transformers family, e.g. qwen3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(directory)
    # An `architecture` may set a larger vocab_size than the tokenizer's (a real model's LM
    # head at benchmark size); the extra ids decode to nothing.
    shape = dict(architecture or DEFAULT_ARCHITECTURE)
    config = AutoConfig.for_model(shape.pop("model_type", "qwen2"), **{
        "vocab_size": len(tokenizer), "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        **shape,
    })
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    torch.random.set_rng_state(generator_state)
    model.save_pretrained(directory)
    (directory / "realrl_default.json").write_text(json.dumps({"seed": seed}))
    return directory
