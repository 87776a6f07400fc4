import json
import string

import pytest
import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.configs import RuleRewardConfig
from realrl.interfaces.remote_reward import decode_prompts
from realrl.interfaces.rule_reward import RuleRewardInterface
from realrl.models.tokenizer import build_char_tokenizer
from realrl.workers.model_worker import TokenizerOnlyEngine

ADD_TESTS = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
ADD_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture(scope="module")
def printable_tokenizer(tmp_path_factory):
    charset = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
    return build_char_tokenizer(tmp_path_factory.mktemp("printable"), charset=charset)


def _batch(tokenizer, samples):
    """samples: (prompt, [responses], metadata dict); every response ends with EOS."""
    tokens, prompt_mask, seqlens = [], [], []
    for prompt, responses, _ in samples:
        prompt_ids, lengths = tokenizer.encode(prompt), []
        for response in responses:
            response_ids = tokenizer.encode(response) + [tokenizer.eos_token_id]
            tokens += prompt_ids + response_ids
            prompt_mask += [True] * len(prompt_ids) + [False] * len(response_ids)
            lengths.append(len(prompt_ids) + len(response_ids))
        seqlens.append(lengths)
    names = ("answer", "solutions", "task", "input_output")
    return SequenceSample.from_tensors(
        ids=[f"q{i}" for i in range(len(samples))],
        seqlens={"packed_input_ids": seqlens, "prompt_mask": seqlens},
        data={"packed_input_ids": torch.tensor(tokens), "prompt_mask": torch.tensor(prompt_mask)},
        metadata={name: [meta.get(name) for _, _, meta in samples] for name in names},
    )


def test_rule_reward_scores_math_and_code_sequences_by_task(printable_tokenizer):
    data = _batch(
        printable_tokenizer,
        [
            ("1+2=", ["3", "4", "the answer is \\boxed{3}"], {"answer": "3", "task": "math"}),
            ("half?", ["0.5"], {"solutions": ["\\frac{1}{2}"], "task": "math"}),
            (
                "add:",
                [ADD_PROGRAM, "```python\nprint(6)\n```"],
                {"task": "code", "input_output": ADD_TESTS},
            ),
        ],
    )
    engine = TokenizerOnlyEngine(printable_tokenizer, [printable_tokenizer.eos_token_id])
    interface = RuleRewardInterface(RuleRewardConfig(math_timeout_s=10.0))
    try:
        result = interface.inference(engine, data, MicroBatchSpec())
        verifier = interface._math_verifier
        again = interface.inference(engine, data, MicroBatchSpec())
        assert interface._math_verifier is verifier  # kept alive across calls
    finally:
        interface.close()
    rewards = result.data
    assert rewards.ids == data.ids
    assert rewards.seqlens["rewards"] == [[1, 1, 1], [1], [1, 1]]
    assert rewards.dtypes["rewards"] == torch.float32
    assert rewards.data["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert again.data.data["rewards"].tolist() == rewards.data["rewards"].tolist()
    assert result.stats["task_mean"] == pytest.approx(4 / 6)
    assert result.stats["math_accuracy"] == pytest.approx(3 / 4)
    assert result.stats["code_accuracy"] == pytest.approx(1 / 2)


def test_rule_reward_explains_missing_references_and_tokenizer(printable_tokenizer):
    data = _batch(printable_tokenizer, [("1+2=", ["3"], {"task": "math"})])
    interface = RuleRewardInterface(RuleRewardConfig())
    with pytest.raises(ValueError, match="neither `solutions` nor `answer`"):
        interface.inference(TokenizerOnlyEngine(printable_tokenizer, []), data, MicroBatchSpec())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        interface.inference(None, data, MicroBatchSpec())
    with pytest.raises(NotImplementedError, match="supports inference"):
        interface.train_step(None, data, MicroBatchSpec())


def test_rule_reward_ends_a_response_at_every_eos_id_of_the_checkpoint(printable_tokenizer):
    """A checkpoint's generation_config.json may list EOS ids beyond the tokenizer's (Qwen2.5-
    Instruct: [<|im_end|>, <|endoftext|>]); a response ending with any of them ends there and
    the id is not part of the answer. Any id can be declared EOS; '0' makes it visible here:
    the response "3" + EOS scores 1, the text "30" would score 0."""
    stop = printable_tokenizer.convert_tokens_to_ids("0")
    prompt = printable_tokenizer.encode("1+2=")
    response = printable_tokenizer.encode("3") + [stop]
    length = len(prompt + response)
    data = SequenceSample.from_tensors(
        ids=["q0"],
        seqlens={"packed_input_ids": [[length]], "prompt_mask": [[length]]},
        data={
            "packed_input_ids": torch.tensor(prompt + response),
            "prompt_mask": torch.tensor([True] * len(prompt) + [False] * len(response)),
        },
        metadata={"answer": ["3"], "task": ["math"]},
    )
    engine = TokenizerOnlyEngine(printable_tokenizer, [printable_tokenizer.eos_token_id, stop])
    interface = RuleRewardInterface(RuleRewardConfig(math_timeout_s=10.0))
    try:
        result = interface.inference(engine, data, MicroBatchSpec())
    finally:
        interface.close()
    assert result.data.data["rewards"].tolist() == [1.0]


def test_an_episodes_model_turns_are_scored_without_its_tool_outputs(printable_tokenizer):
    tokenizer = printable_tokenizer
    eos = tokenizer.eos_token_id
    prompt, first, tool, second = (tokenizer.encode(text) for text in
                                   ("12*34=", "31", "out(408)", "408"))
    # prompt | model "31<eos>" | tool "out(408)" | model "408<eos>": the turns' numbers must not
    # run together ("31408"), and the tool's 408 alone must not count as the answer.
    segments = [(prompt, True), (first + [eos], False), (tool, True), (second + [eos], False)]
    tokens = [t for ids, _ in segments for t in ids]
    mask = [flag for ids, flag in segments for _ in ids]
    only_tool = prompt + first + [eos] + tool
    data = SequenceSample.from_tensors(
        ids=["q0"], seqlens={key: [[len(tokens), len(only_tool)]]
                             for key in ("packed_input_ids", "prompt_mask")},
        data={"packed_input_ids": torch.tensor(tokens + only_tool),
              "prompt_mask": torch.tensor(mask + [True] * len(prompt) + [False] * (len(first) + 1)
                                          + [True] * len(tool))},
        metadata={"answer": ["408"], "task": ["math"]},
    )
    engine = TokenizerOnlyEngine(tokenizer, [eos])
    rewards = RuleRewardInterface(RuleRewardConfig()).inference(engine, data, MicroBatchSpec())
    assert rewards.data.data["rewards"].tolist() == [1.0, 0.0]


def test_a_reward_service_gets_an_episodes_prompt_without_its_tool_outputs(printable_tokenizer):
    tokenizer = printable_tokenizer
    prompt, turn, tool = (tokenizer.encode(text) for text in ("12*34=", "calc(12*34)", "out(408)"))
    tokens = prompt + turn + tool
    data = SequenceSample.from_tensors(
        ids=["q0"], seqlens={key: [[len(tokens)]] for key in ("packed_input_ids", "prompt_mask")},
        data={"packed_input_ids": torch.tensor(tokens), "prompt_mask": torch.tensor(
            [True] * len(prompt) + [False] * len(turn) + [True] * len(tool))},
    )
    assert decode_prompts(tokenizer, data) == ["12*34="]
