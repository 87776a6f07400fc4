"""Tokenizer helpers: load any local HF tokenizer, format text with or without its chat
template, build a char tokenizer.

`TextFormat` is how every dataset turns prompts and completions into ids (the
`dataset.apply_chat_template` key picks raw or chat). As a chat, a prompt is one user turn
plus the assistant header, exactly the ids of `tokenizer.apply_chat_template(...,
add_generation_prompt=True)`: the template writes its own BOS and control tokens
(`<|im_start|>`), so nothing is added again. A completion is the answer followed by the token
the template ends an assistant turn with (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3),
found by rendering a conversation once.

The character tokenizer serves the built-in arithmetic task: one token per character, ids
0 `<pad>`, 1 `<eos>`, 2 `<unk>`, then the charset in order. It has no BOS token (prompts start
directly with their first character), no chat template, and adds no special tokens when
encoding; the generation engine appends nothing either, so a response ends with the `<eos>`
it sampled.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from realrl.api.config import ConfigError

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


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_chat_template(setting: bool | None, tokenizer, source: str) -> bool:
    """`dataset.apply_chat_template`: null applies the template when `tokenizer` (loaded from
    `source`) has one; true without one is a `ConfigError` naming the key and the fix."""
    if setting is None:
        return has_chat_template(tokenizer)
    if setting and not has_chat_template(tokenizer):
        raise ConfigError(
            [
                f"`dataset.apply_chat_template=true`, but the tokenizer in {source} has no chat "
                "template: set dataset.apply_chat_template=false (or null) to use the prompts as "
                "they are, or use a tokenizer whose tokenizer_config.json has a chat_template."
            ]
        )
    return bool(setting)


class TextFormat:
    """Prompt and completion ids, raw or through the chat template (see the module docstring).

    Raw: a prompt is encoded with the tokenizer's special tokens (a BOS where it uses one); a
    completion without them, then the tokenizer's EOS. `end_token_id` is the id every
    completion ends with (None when the tokenizer has no EOS and no template names one).
    """

    def __init__(self, tokenizer, chat_template: bool) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        turn_end = chat_turn_end_id(tokenizer) if chat_template else None
        self.end_token_id: int | None = turn_end if turn_end is not None else tokenizer.eos_token_id

    def prompt_ids(self, prompt: str) -> list[int]:
        if not self.chat_template:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return self.conversation_ids([{"role": "user", "content": prompt}])

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        """A conversation (``[{"role", "content"}, ...]``, ending with a user turn) plus the
        assistant header, through the chat template. Without a template only a single user
        turn has a form: its content as a raw prompt."""
        if not self.chat_template:
            if len(messages) != 1 or messages[0]["role"] != "user":
                raise ValueError(
                    f"a conversation of {len(messages)} turn(s) needs a chat template to become "
                    "a prompt, and this run formats prompts without one"
                )
            return self.prompt_ids(messages[0]["content"])
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def completion_ids(self, text: str) -> list[int]:
        """`text` then `end_token_id` (the caller checks that there is one)."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.end_token_id]


_ANSWER_MARKER = "realrl-answer-marker"


def chat_turn_end_id(tokenizer) -> int | None:
    """The token the chat template writes right after an assistant message's content, if it is
    a special token (`<|im_end|>`, `<|eot_id|>`, `</s>`); None if the template writes none."""
    messages = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": _ANSWER_MARKER},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as error:  # a template may raise anything (jinja2 errors, its own checks)
        logger.warning(
            "the chat template cannot render an assistant turn (%s): completions end with the "
            "tokenizer's EOS",
            error,
        )
        return None
    if _ANSWER_MARKER not in text:
        return None
    after = tokenizer.encode(text.split(_ANSWER_MARKER, 1)[1], add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return after[0] if after and after[0] in special else None


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
