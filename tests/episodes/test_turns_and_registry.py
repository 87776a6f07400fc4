"""Tool turns through a chat template, the raw tool turn, and episodes registered by users."""

from __future__ import annotations

from pathlib import Path

import pytest
from episode_helpers import prompt_batch, rollout

from realrl.api.episode_config import EpisodeConfig
from realrl.episodes.api import get_episode
from realrl.episodes.rollout import EpisodeRollout
from realrl.episodes.turns import TurnFormat
from realrl.models.tokenizer import load_tokenizer


@pytest.fixture
def chat_tokenizer(chat_model):
    """The Qwen-style tokenizer and chat template of tests/conftest.py's `chat_model`."""
    return load_tokenizer(chat_model)


def test_a_chat_tool_turn_is_what_the_template_writes_between_two_assistant_turns(chat_tokenizer):
    turns = TurnFormat(chat_tokenizer, chat_template=True)
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert turns.stop_token_id == im_end  # a model turn ends at the template's end of turn
    question = [{"role": "user", "content": "What is 12*34?"}]
    prompt = chat_tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    model_turn = chat_tokenizer.encode("calc(12*34)", add_special_tokens=False) + [im_end]
    episode_ids = list(prompt) + model_turn + turns.tool_turn_ids("408")
    conversation = question + [{"role": "assistant", "content": "calc(12*34)"},
                               {"role": "tool", "content": "408"}]
    expected = chat_tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert episode_ids == list(expected)
    assert chat_tokenizer.decode(turns.tool_turn_ids("408")) == (
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_a_tool_role_gets_the_output_as_a_user_turn(chat_tokenizer):
    tokenizer = chat_tokenizer
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- if message['role'] == 'tool' %}"
        "{{ raise_exception('no tool role') }}{%- endif %}")
    turns = TurnFormat(tokenizer, chat_template=True)
    assert tokenizer.decode(turns.tool_turn_ids("408")).startswith("\n<|im_start|>user\n408")


def test_a_raw_tool_turn_is_out_of_the_output(tokenizer):
    turns = TurnFormat(tokenizer, chat_template=False)
    assert turns.stop_token_id == tokenizer.eos_token_id
    assert tokenizer.decode(turns.tool_turn_ids("408")) == "out(408)"


def test_an_episode_of_ones_own_is_registered_from_episode_module(tokenizer, tmp_path):
    module = tmp_path / "my_episodes.py"
    module.write_text(
        "from realrl.episodes import Transcript, register_episode\n\n"
        "@register_episode('one_turn_for_test')\n"
        "async def one_turn(env):\n"
        "    transcript = Transcript(env.prompt_ids)\n"
        "    transcript.add_model(await env.generate(transcript.ids))\n"
        "    return transcript.result()\n")
    with pytest.raises(ValueError, match="not a registered episode.*tool_arithmetic"):
        get_episode("one_turn_for_test")
    config = EpisodeConfig(name="one_turn_for_test", module=str(module))
    rollout = EpisodeRollout(config, apply_chat_template=None, tokenizer=tokenizer)
    assert rollout.episode is get_episode("one_turn_for_test")


def test_the_documented_example_episode_runs_and_its_feedback_is_not_the_models(tokenizer):
    example = Path(__file__).resolve().parents[2] / "examples" / "retry_episode.py"
    data = prompt_batch(tokenizer, ["12*34=", "5*6="], ["", ""])
    sample = rollout(tokenizer, data, group_size=4, episode="retry_once",
                     module=str(example)).data
    lengths = sample.seqlens_of("packed_input_ids")
    not_model_texts = [
        tokenizer.decode(ids[not_model]) for ids, not_model in
        zip(sample.data["packed_input_ids"].split(lengths), sample.data["prompt_mask"].split(lengths))
    ]
    prompts = ["12*34="] * 4 + ["5*6="] * 4
    assert all(text in (prompt, prompt + "wrong:") for text, prompt in zip(not_model_texts, prompts))
    assert any(text.endswith("wrong:") for text in not_model_texts)  # a random model errs
