"""Chat templates through the real CLI, with a checkpoint shaped like Qwen2.5-Instruct (the
`chat_model` fixture: tiny random Qwen2, BPE tokenizer with a Qwen-style chat template).

`gen` must feed the model its prompts as chat turns by default; SFT from a base-style copy,
whose config names only <|endoftext|> as EOS, must leave a checkpoint that stops at the
<|im_end|> its answers were trained to end with; `dataset.apply_chat_template=true` with a
tokenizer that has no template must fail before anything starts.
"""

from __future__ import annotations

import json
import shutil

from e2e_helpers import describe, run_cli
from transformers import AutoTokenizer

PROMPTS = ["What is 1+1?", "What is 3+4?"]


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_gen_feeds_the_model_its_prompts_as_chat_turns(chat_model, cli_env, tmp_path):
    data = tmp_path / "prompts.jsonl"
    # Chat records as ppo-rlhf reads them, no answer needed: a prompt, and a conversation.
    write_jsonl(data, [{"prompt": PROMPTS[0]},
                       {"messages": [{"role": "user", "content": PROMPTS[1]}]}])
    result = run_cli(
        "gen",
        [
            f"model.path={chat_model}",
            f"dataset.path={data}",
            f"output_root={tmp_path}",
            "dataset.batch_size=2",
            "gen.max_new_tokens=4",
            "n_devices_per_node=1",
        ],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "gen" / "trial0"
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    lines = [json.loads(line) for line in open(run_dir / "generated.jsonl")]
    # generated.jsonl names each prompt by the record's own text (a conversation: its last
    # user turn), the join key with the input.
    assert sorted(line["prompt"] for line in lines) == sorted(PROMPTS)
    # samples.jsonl shows each prompt as the model saw it: the chat turn, control tokens kept.
    seen = {}
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        seen[tokenizer.decode(ids)] = prompt
    samples = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
    assert samples and all(sample["prompt"] in seen for sample in samples), samples
    log = (run_dir / "logs" / "master.log").read_text()
    assert "dataset.apply_chat_template=null, and the tokenizer has a chat template" in log
    assert "<|im_start|>user\\nWhat is" in log  # the first prompt, control tokens included


def test_sft_on_templated_answers_saves_their_end_of_turn_token_as_eos(
    chat_model, cli_env, tmp_path
):
    base = tmp_path / "base"
    shutil.copytree(chat_model, base)
    (base / "generation_config.json").unlink()
    tokenizer = AutoTokenizer.from_pretrained(base)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "eos_token_id": end_of_text}))
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(base)
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, [{"prompt": prompt, "answer": "2"} for prompt in PROMPTS])
    result = run_cli(
        "sft",
        [
            f"model.path={base}",
            f"dataset.path={data}",
            f"output_root={tmp_path}",
            "dataset.batch_size=2",
            "total_train_steps=1",
            "n_devices_per_node=1",
            "checkpoint.weights_only=true",
        ],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    saved = tmp_path / "sft" / "trial0" / "checkpoints" / "step000001" / "default"
    generation_config = json.loads((saved / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [end_of_text, im_end]
    assert json.loads((saved / "config.json").read_text())["eos_token_id"] == end_of_text


def test_requiring_a_chat_template_the_tokenizer_lacks_fails_at_launch(
    tiny_model, cli_env, tmp_path
):
    result = run_cli(
        "gen",
        [f"model.path={tiny_model}", f"output_root={tmp_path}", "dataset.apply_chat_template=true"],
        cli_env,
    )
    assert result.returncode != 0
    assert "dataset.apply_chat_template=true" in result.stderr, describe(result)
    assert "has no chat template" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "gen").exists()  # nothing started, no run directory
