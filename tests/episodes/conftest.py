"""The episode tests' character tokenizer (the built-in model's; helpers: `episode_helpers`)."""

import pytest

from realrl.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))
