"""Fixtures of the end-to-end tests, which drive the real CLI in a subprocess like a user.

Every run uses a tiny random model built once per session (`fresh_default_model`), so no test
triggers the SFT warm start of the built-in default actor, and a private `REALRL_CACHE`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from realrl.launcher.defaults import fresh_default_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Qwen2-style model with the arithmetic tokenizer."""
    return fresh_default_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def tiny_qwen3_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model`'s shape and tokenizer as a Qwen3 model (per-head query/key norms, no qkv
    bias), random weights."""
    import json
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "tie_word_embeddings", "eos_token_id", "pad_token_id")
    source = json.loads((tiny_model / "config.json").read_text())
    directory = tmp_path_factory.mktemp("tiny_qwen3_model") / "model"
    torch.manual_seed(3)
    Qwen3ForCausalLM(Qwen3Config(bos_token_id=None, **{key: source[key] for key in keys
                                                        if key in source})
                     ).save_pretrained(directory)
    for tokenizer_file in tiny_model.glob("tokenizer*"):
        shutil.copy(tokenizer_file, directory)
    return directory


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every CLI subprocess: one thread each, a private cache."""
    return {
        **os.environ,
        "REALRL_CACHE": str(tmp_path_factory.mktemp("realrl_cache")),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
