"""Datasets through a chat template: prompt ids equal transformers' own, no second BOS, and SFT
and paired answers end with the template's end-of-turn token behind an exact prompt mask."""

from __future__ import annotations

import copy
import json
import re

import pytest

from realrl.api.config import ConfigError
from realrl.datasets.jsonl import DatasetError
from realrl.datasets.loader import (
    PairedDataset,
    PromptDataset,
    SFTDataset,
    make_paired_batch,
    make_sft_batch,
)
from realrl.datasets.records import load_chat_records
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


CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 1+1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2+2?"},
]


def test_chat_records_give_a_conversation_or_a_prompt_and_no_answer(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n"
                    + json.dumps({"prompt": "Say hi.", "query_id": 7}) + "\n")
    records = load_chat_records(path)
    assert [record["query_id"] for record in records] == ["chat-1", "7"]
    assert records[0]["messages"] == CONVERSATION and records[1]["prompt"] == "Say hi."


@pytest.mark.parametrize(("record", "problem"), [
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "exactly one of"),
    ({"answer": "2"}, "exactly one of"),
    ({"messages": CONVERSATION[:3]}, "'messages' must end with a user turn"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0] must be {'role': one of"),
    ({"messages": "hi"}, "key 'messages' must be list"),
    ({"prompt": "hi", "task": "poetry"}, "key 'task' must be one of"),
])
def test_a_malformed_chat_record_is_named_by_file_and_line(tmp_path, record, problem):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: ") + ".*" + re.escape(problem)):
        load_chat_records(path)


def test_a_conversation_goes_through_the_chat_template_whole(chat_tokenizer):
    dataset = PromptDataset([{"query_id": "c", "messages": CONVERSATION}], chat_tokenizer,
                            chat_template=True)
    expected = chat_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert dataset.prompt_token_ids[0] == list(expected)
    assert chat_tokenizer.decode(expected).endswith(
        "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_without_a_template_one_user_turn_is_a_raw_prompt_and_a_conversation_an_error(tokenizer):
    one_turn = [{"query_id": "u", "messages": [{"role": "user", "content": "1+2="}]}]
    dataset = PromptDataset(one_turn, tokenizer, chat_template=False)
    assert dataset.prompt_token_ids[0] == tokenizer.encode("1+2=")
    with pytest.raises(DatasetError, match="record 'c': a conversation of 4 turn"):
        PromptDataset([{"query_id": "c", "messages": CONVERSATION}], tokenizer, source="chat.jsonl")
