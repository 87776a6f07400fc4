"""What the master reads from the step's batch: the reward the actor trains on, named keys'
statistics, decoded samples, and gen's single completions file. Hand-made batches."""

from __future__ import annotations

import json
import math

import pytest
import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef, MFCKind
from realrl.interfaces.configs import GenerationConfig
from realrl.models.tokenizer import build_char_tokenizer
from realrl.workers.samples_log import (
    GeneratedFile,
    batch_metrics,
    generates_rollouts,
    logs_samples_at,
    mean_rewards,
    sample_rows,
    train_reward_key,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))


def encode(tokenizer, text: str) -> list[int]:
    """One id per character; a trailing "<eos>" is the EOS token."""
    eos = text.endswith("<eos>")
    ids = tokenizer.encode(text.removesuffix("<eos>"), add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] * eos


def rollout(tokenizer, prompts: list[str], responses: list[list[str]], **per_response):
    """One sample per prompt holding its responses: `packed_input_ids`, `prompt_mask`,
    `seq_no_eos_mask` as actor_gen writes them, plus float keys with one value per response."""
    token_ids, prompt_mask, lengths = [], [], []
    for prompt, group in zip(prompts, responses):
        prompt_ids = encode(tokenizer, prompt)
        lengths.append([])
        for response in group:
            response_ids = encode(tokenizer, response)
            token_ids += prompt_ids + response_ids
            prompt_mask += [True] * len(prompt_ids) + [False] * len(response_ids)
            lengths[-1].append(len(prompt_ids) + len(response_ids))
    one_each = [[1] * len(group) for group in responses]
    data = {"packed_input_ids": torch.tensor(token_ids), "prompt_mask": torch.tensor(prompt_mask),
            "seq_no_eos_mask": torch.zeros(sum(map(len, responses)), dtype=torch.bool)}
    data |= {key: torch.tensor(values, dtype=torch.float32) for key, values in per_response.items()}
    seqlens = {"packed_input_ids": lengths, "prompt_mask": lengths}
    seqlens |= {key: one_each for key in data if key not in seqlens}
    return SequenceSample.from_tensors(
        ids=[f"q{i}" for i in range(len(prompts))], seqlens=seqlens, data=data,
        metadata={"answer": [str(i) for i in range(len(prompts))],
                  "input_output": [{"inputs": []} for _ in prompts]},
    )


def mfc(name: str, kind: MFCKind, inputs=(), outputs=(), remap=None, config=None) -> MFCDef:
    return MFCDef(name=name, model_role="actor", kind=kind, interface="ppo_actor",
                  interface_config=config, input_keys=inputs, output_keys=outputs,
                  input_key_remap=remap or {})


def test_the_reward_is_the_key_the_train_mfcs_read_as_rewards_whichever_mfc_made_it(tokenizer):
    rule_graph = [mfc("rew_inf", MFCKind.inference, outputs=("rewards",)),
                  mfc("actor_train", MFCKind.train_step, inputs=("packed_input_ids", "rewards"))]
    model_graph = [mfc("rew_inf", MFCKind.inference, outputs=("rewards",)),
                   mfc("rm_inf", MFCKind.inference, outputs=("rm_scores",)),
                   mfc("actor_train", MFCKind.train_step, inputs=("rm_scores",),
                       remap={"rm_scores": "rewards"})]
    assert train_reward_key(rule_graph) == "rewards"
    assert train_reward_key(model_graph) == "rm_scores"
    assert train_reward_key([mfc("trainDefault", MFCKind.train_step, ("packed_input_ids",))]) is None

    data = rollout(tokenizer, ["1+1=", "2+2="], [["2", "3"], ["4", "5"]],
                   rewards=[1.0, 0.0, 1.0, 0.0], rm_scores=[0.5, -0.5, 2.0, 1.0])
    assert batch_metrics(data, "rewards", [])["reward/task_mean"] == 0.5
    assert batch_metrics(data, "rm_scores", [])["reward/task_mean"] == 0.75  # 3.0 / 4


def test_named_keys_are_logged_as_mean_std_min_max_over_every_value(tokenizer):
    data = rollout(tokenizer, ["1+1=", "2+2="], [["2", "3"], ["4", "5"]],
                   rm_scores=[1.0, 2.0, 3.0, 6.0])
    metrics = batch_metrics(data, None, ["rm_scores"])
    # mean 12 / 4 = 3; population variance (4 + 1 + 0 + 9) / 4 = 3.5
    assert metrics == pytest.approx({"batch/rm_scores/mean": 3.0,
                                     "batch/rm_scores/std": math.sqrt(3.5),
                                     "batch/rm_scores/min": 1.0, "batch/rm_scores/max": 6.0})
    assert "reward/task_mean" not in metrics


def test_samples_take_each_prompts_first_response_first_with_every_per_response_value(tokenizer):
    data = rollout(tokenizer, ["1+1=", "2+2="], [["2", "3"], ["4", "5"]],
                   rewards=[1.0, 0.0, 1.0, 0.0], rm_scores=[0.5, -0.5, 2.0, 1.0])
    rows = sample_rows(data, tokenizer, 3, "rewards")
    assert [(row["query_id"], row["prompt"], row["response"]) for row in rows] == [
        ("q0", "1+1=", "2"), ("q1", "2+2=", "4"), ("q0", "1+1=", "3")]
    assert rows[2] == {"query_id": "q0", "prompt": "1+1=", "response": "3", "reward": 0.0,
                       "rm_scores": -0.5, "seq_no_eos_mask": False, "answer": "0"}
    assert sample_rows(data, tokenizer, 0, "rewards") == []
    assert len(sample_rows(data, tokenizer, 10, "rewards")) == 4


def test_an_episodes_tool_output_stays_in_its_response_in_order(tokenizer):
    data = rollout(tokenizer, ["12*34="], [["calc(12*34)<eos>"]])
    tool_ids = encode(tokenizer, "out(408)")
    answer_ids = encode(tokenizer, "408<eos>")
    length = data.seqlens["packed_input_ids"][0][0] + len(tool_ids) + len(answer_ids)
    data = SequenceSample.from_tensors(
        ids=data.ids, seqlens={key: [[length]] for key in ("packed_input_ids", "prompt_mask")}
        | {"seq_no_eos_mask": [[1]]},
        data={"packed_input_ids": torch.cat([data.data["packed_input_ids"],
                                             torch.tensor(tool_ids + answer_ids)]),
              "prompt_mask": torch.cat([data.data["prompt_mask"], torch.tensor(
                  [True] * len(tool_ids) + [False] * len(answer_ids))]),
              "seq_no_eos_mask": data.data["seq_no_eos_mask"]},
        metadata=data.metadata)
    row = sample_rows(data, tokenizer, 1, None)[0]
    assert (row["prompt"], row["response"]) == ("12*34=", "calc(12*34)<eos>out(408)408<eos>")


def test_samples_come_only_from_graphs_that_generate_rollouts():
    gen = mfc("actor_gen", MFCKind.generate, outputs=("packed_input_ids", "prompt_mask"))
    assert generates_rollouts([gen])
    sft = mfc("trainDefault", MFCKind.train_step, inputs=("packed_input_ids", "prompt_mask"))
    assert not generates_rollouts([sft])


def test_samples_are_logged_on_step_one_and_every_nth_step():
    assert [step for step in range(1, 31) if logs_samples_at(step, 10)] == [1, 10, 20, 30]
    assert [step for step in range(1, 4) if logs_samples_at(step, 1)] == [1, 2, 3]
    assert not any(logs_samples_at(step, 0) for step in range(1, 4))


class PromptRecords:
    """The two attributes of `PromptDataset` that `GeneratedFile` reads."""

    def __init__(self, prompts: list[str]):
        self.ids = [f"q{i}" for i in range(len(prompts))]
        self.records = [{"prompt": prompt} for prompt in prompts]


def test_gen_completions_end_in_one_file_in_dataset_order(tokenizer, tmp_path):
    generation = mfc("genDefault", MFCKind.generate, config=GenerationConfig(n_samples=2))
    dataset = PromptRecords(["1+1=", "2+2=", "3+3="])
    (generated,) = GeneratedFile.for_mfcs([generation], tmp_path, dataset, 0, tokenizer)
    second_batch = rollout(tokenizer, ["3+3=", "1+1="], [["6", "7"], ["2", "3"]])
    second_batch.ids = ["q2", "q0"]
    generated.append(1, second_batch)
    first_batch = rollout(tokenizer, ["2+2="], [["4<eos>", "5"]])
    first_batch.ids = ["q1"]
    generated.append(2, first_batch)
    generated.finish()
    records = [json.loads(line) for line in (tmp_path / "generated.jsonl").read_text().splitlines()]
    assert [(r["query_id"], r["completion"], r["step"]) for r in records] == [
        ("q0", "2", 1), ("q0", "3", 1), ("q1", "4", 2), ("q1", "5", 2), ("q2", "6", 1),
        ("q2", "7", 1)]  # EOS dropped from "4<eos>"
    assert records[0] == {"query_id": "q0", "prompt": "1+1=", "completion": "2",
                          "no_eos": False, "step": 1}

    # A run resumed from its step-1 checkpoint redoes step 2: its lines go, step 1's stay.
    (resumed,) = GeneratedFile.for_mfcs([generation], tmp_path, dataset, 1, tokenizer)
    resumed.finish()
    lines = (tmp_path / "generated.jsonl").read_text().splitlines()
    assert [json.loads(line)["query_id"] for line in lines] == ["q0", "q0", "q2", "q2"]
    assert GeneratedFile.for_mfcs([mfc("actor_gen", MFCKind.generate)], tmp_path, dataset, 0,
                                  tokenizer) == []


def test_scored_gen_completions_carry_their_rewards_and_chat_records_their_user_turn(
    tokenizer, tmp_path, caplog
):
    generation = mfc("genDefault", MFCKind.generate, config=GenerationConfig(n_samples=2))
    dataset = PromptRecords(["1+1=", ""])
    dataset.records[1] = {"messages": [{"role": "system", "content": "Be terse."},
                                       {"role": "user", "content": "2+2="}]}
    (generated,) = GeneratedFile.for_mfcs([generation], tmp_path, dataset, 0, tokenizer)
    # gen reward.sources=[rule,model]: reward_sum's `rewards` and each source's key.
    batch = rollout(tokenizer, ["1+1=", "2+2="], [["2", "3"], ["4", "5"]],
                    rewards=[2.5, 0.5, 3.0, 1.0], rule_rewards=[1.0, 0.0, 1.0, 0.0],
                    model_rewards=[1.5, 0.5, 2.0, 1.0])
    batch.ids = ["q0", "q1"]
    generated.append(1, batch)
    with caplog.at_level("INFO", logger="realrl.workers.samples_log"):
        generated.finish()
    records = [json.loads(line) for line in (tmp_path / "generated.jsonl").read_text().splitlines()]
    assert records[2] == {"query_id": "q1", "prompt": "2+2=", "completion": "4", "no_eos": False,
                          "step": 1, "reward": 3.0, "rule_rewards": 1.0, "model_rewards": 2.0}
    # Means over the four completions: (2.5+0.5+3+1)/4, (1+0+1+0)/4, (1.5+0.5+2+1)/4.
    assert mean_rewards(records) == {"reward": 1.75, "rule_rewards": 0.5, "model_rewards": 1.25}
    assert "4 completions in" in caplog.text and "mean rule_rewards 0.5000" in caplog.text
