"""Tokenizer helpers: load any local HF tokenizer, apply chat templates, build a char tokenizer.

The character tokenizer serves the built-in arithmetic task: one token per character, ids
0 `<pad>`, 1 `<eos>`, 2 `<unk>`, then the charset in order. It has no BOS token (prompts start
directly with their first character) and adds no special tokens when encoding; the
generation engine appends nothing either, so a response ends with the `<eos>` it sampled.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
DEFAULT_CHARSET = "0123456789+-*/=()., \n?:abcdefghijklmnopqrstuvwxyz"


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Any tokenizer saved in HF format in a local directory; never downloads."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        # Packed batches never pad, but collators of other libraries expect a pad id.
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer in %s has no pad token; using its eos token", directory)
    return tokenizer


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The prompt as one user turn plus the assistant header, or unchanged without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_char_tokenizer(
    save_dir: str | os.PathLike, charset: str | list[str] = DEFAULT_CHARSET
) -> PreTrainedTokenizerBase:
    """Write a character-level tokenizer in HF format to `save_dir` and return it loaded."""
    characters = list(dict.fromkeys(charset))
    not_single = [c for c in characters if len(c) != 1]
    if not_single:
        raise ValueError(f"charset entries must be single characters, got {not_single}")
    specials = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN]
    vocab = {token: index for index, token in enumerate(specials + characters)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split every character (newlines included) into its own piece; decode by concatenating.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )
    tokenizer.save_pretrained(str(save_dir))
    return load_tokenizer(save_dir)
