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
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every CLI subprocess: one thread each, a private cache."""
    return {
        **os.environ,
        "REALRL_CACHE": str(tmp_path_factory.mktemp("realrl_cache")),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
