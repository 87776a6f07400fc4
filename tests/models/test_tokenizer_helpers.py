"""Tokenizer helpers: the character tokenizer, loading local tokenizers, chat templates."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from realrl.models.tokenizer import TextFormat, build_char_tokenizer, load_tokenizer


def test_char_tokenizer_round_trips_arithmetic_text(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path)
    text = "12 + 345 = 357\nwhat is 7*8? 56."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, no BOS added
    assert tokenizer.decode(ids) == text


def test_char_tokenizer_special_tokens_have_fixed_ids(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path, charset="0123456789+=")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.bos_token_id is None
    assert len(tokenizer) == 3 + 12
    assert tokenizer.decode(tokenizer.encode("1+1=2<eos>"), skip_special_tokens=True) == "1+1=2"
    assert tokenizer.encode("x", add_special_tokens=False) == [tokenizer.unk_token_id]


def test_char_tokenizer_loads_with_auto_tokenizer_and_load_tokenizer(tmp_path):
    built = build_char_tokenizer(tmp_path)
    for tokenizer in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)):
        assert tokenizer.encode("9-4=5", add_special_tokens=False) == built.encode(
            "9-4=5", add_special_tokens=False
        )
        assert tokenizer.eos_token == "<eos>"


def test_char_tokenizer_rejects_multi_character_charset_entries(tmp_path):
    with pytest.raises(ValueError, match="single characters.*<eos>"):
        build_char_tokenizer(tmp_path, charset=["1", "<eos>"])


def test_text_format_without_a_template_encodes_text_as_it_is(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path)
    text_format = TextFormat(tokenizer, chat_template=False)
    assert text_format.prompt_ids("1+2=") == tokenizer.encode("1+2=")
    assert text_format.completion_ids("3") == tokenizer.encode("3") + [tokenizer.eos_token_id]


def test_text_format_wraps_the_prompt_as_a_user_turn(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path, charset="0123456789+=<>\naeinrstu")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    text_format = TextFormat(reloaded, chat_template=True)
    assert reloaded.decode(text_format.prompt_ids("1+2=")) == "<user>1+2=<eos>\n<assistant>"
    # The template closes a turn with <eos>, a special token: answers end with it.
    assert text_format.end_token_id == reloaded.eos_token_id


def test_load_tokenizer_reports_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(tmp_path / "does-not-exist")
