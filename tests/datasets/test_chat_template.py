"""Datasets through a chat template: prompt ids equal transformers' own, no second BOS, and SFT
and paired answers end with the template's end-of-turn token behind an exact prompt mask."""

from __future__ import annotations

import copy

import pytest

from realrl.api.config import ConfigError
from realrl.datasets.loader import (
    PairedDataset,
    PromptDataset,
    SFTDataset,
    make_paired_batch,
    make_sft_batch,
)
from realrl.models.tokenizer import (
    TextFormat,
    build_char_tokenizer,
    load_tokenizer,
    resolve_chat_template,
)

PROMPTS = [
    {"query_id": "a", "prompt": "What is 12+345?", "answer": "357"},
    {"query_id": "b", "prompt": "Compute 7-9.", "answer": "-2"},
]


def hf_generation_prompt_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.fixture(scope="module")
def chat_tokenizer(chat_model):
    return load_tokenizer(chat_model)


def test_chat_prompts_are_the_ids_of_transformers_apply_chat_template(chat_tokenizer):
    dataset = PromptDataset(PROMPTS, chat_tokenizer, chat_template=True)
    for record, ids in zip(PROMPTS, dataset.prompt_token_ids):
        assert ids == hf_generation_prompt_ids(chat_tokenizer, record["prompt"])
        assert chat_tokenizer.decode(ids) == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{record['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        )
    raw = PromptDataset(PROMPTS, chat_tokenizer, chat_template=False)
    assert raw.prompt_token_ids[0] == chat_tokenizer.encode(PROMPTS[0]["prompt"])


def test_a_template_that_writes_the_bos_gets_no_second_one(tokenizer):
    """Llama-style: the template starts with `{{ bos_token }}` and the tokenizer's
    post-processor prepends BOS too; the prompt must hold one BOS, as in transformers."""
    bos_tokenizer = copy.deepcopy(tokenizer)
    bos_tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    assert bos_tokenizer.encode("1+2=")[0] == bos_tokenizer.bos_token_id
    dataset = PromptDataset([{"prompt": "1+2=", "answer": "3"}], bos_tokenizer, chat_template=True)
    ids = dataset.prompt_token_ids[0]
    assert ids == hf_generation_prompt_ids(bos_tokenizer, "1+2=")
    assert ids[0] == bos_tokenizer.bos_token_id and ids.count(bos_tokenizer.bos_token_id) == 1


def test_sft_chat_answers_end_with_the_end_of_turn_token_behind_an_exact_prompt_mask(
    chat_tokenizer,
):
    records = [{"prompt": r["prompt"], "answer": r["answer"]} for r in PROMPTS]
    batch = make_sft_batch(SFTDataset(records, chat_tokenizer, chat_template=True), [0, 1])
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record, sample in zip(records, batch.unpack()):
        ids, mask = sample.data["packed_input_ids"].tolist(), sample.data["prompt_mask"].tolist()
        prompt = hf_generation_prompt_ids(chat_tokenizer, record["prompt"])
        answer = chat_tokenizer.encode(record["answer"], add_special_tokens=False)
        assert ids == prompt + answer + [im_end]
        assert mask == [True] * len(prompt) + [False] * (len(answer) + 1)
        # The whole sequence is the rendered conversation up to the end of the answer's turn.
        conversation = chat_tokenizer.apply_chat_template(
            [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["answer"]},
            ],
            tokenize=True,
            return_dict=False,
        )
        assert conversation[: len(ids)] == ids


def test_paired_chat_completions_share_the_templated_prompt(chat_tokenizer):
    records = [{"prompt": "What is 3*4?", "pos_answers": ["12"], "neg_answers": ["7"]}]
    batch = make_paired_batch(PairedDataset(records, chat_tokenizer, chat_template=True), [0])
    prompt = hf_generation_prompt_ids(chat_tokenizer, "What is 3*4?")
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = []
    for answer in ("12", "7"):
        expected += prompt + chat_tokenizer.encode(answer, add_special_tokens=False) + [im_end]
    assert batch.data["packed_input_ids"].tolist() == expected
    assert batch.data["prompt_lens"].tolist() == [len(prompt)]


def test_the_end_of_turn_token_is_the_templates_not_the_tokenizers_eos(chat_tokenizer):
    """A base model's tokenizer names <|endoftext|> as EOS while its chat template closes a
    turn with <|im_end|>: chat answers end with <|im_end|>, raw ones with the EOS."""
    base = copy.deepcopy(chat_tokenizer)
    base.eos_token = "<|endoftext|>"
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    assert TextFormat(base, chat_template=True).end_token_id == im_end
    assert TextFormat(base, chat_template=False).end_token_id == base.eos_token_id != im_end


def test_apply_chat_template_setting_resolves_against_the_tokenizer(chat_tokenizer, tmp_path):
    char_tokenizer = build_char_tokenizer(tmp_path)
    assert resolve_chat_template(None, chat_tokenizer, "chat") is True
    assert resolve_chat_template(None, char_tokenizer, "char") is False
    assert resolve_chat_template(False, chat_tokenizer, "chat") is False
    with pytest.raises(
        ConfigError, match=r"dataset.apply_chat_template=true.*in /ckpt has no chat template"
    ):
        resolve_chat_template(True, char_tokenizer, "/ckpt")
