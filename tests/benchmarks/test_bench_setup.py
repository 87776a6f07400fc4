"""The measuring instruments of the benchmarks: FLOP accounting, memory meter, GRPO pieces."""

import subprocess
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from baseline_loop import group_advantages, response_mask  # noqa: E402
from bench_setup import (  # noqa: E402
    ModelShape,
    ProcessTreeMemory,
    StealMeter,
    arithmetic_reward,
    median_and_spread,
    read_prompts,
    write_benchmark_model,
    write_prompt_file,
)


def test_model_shape_counts_exactly_the_matmul_weights_of_the_benchmark_model(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = write_benchmark_model(tmp_path / "model", "small")
    model = AutoModelForCausalLM.from_pretrained(directory)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # The LM head is tied to the embedding but still multiplies every token's hidden state.
    assert ModelShape.from_config_dir(directory).matmul_params == linear
    assert 3.5e6 < sum(p.numel() for p in model.parameters()) < 4.5e6


def test_model_shape_counts_a_head_dim_apart_from_hidden_over_heads(tmp_path):
    # Qwen3's attention is 16 heads x 128 wide against a hidden size of 1024: here 4 x 32 / 64
    from transformers import AutoModelForCausalLM

    from realrl.launcher.defaults import DEFAULT_ARCHITECTURE, fresh_default_model

    shape = {**DEFAULT_ARCHITECTURE, "model_type": "qwen3", "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32}
    directory = fresh_default_model(tmp_path / "model", 0, shape)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    measured = ModelShape.from_config_dir(directory)
    assert measured.matmul_params == linear and measured.query_width == 4 * 32


def test_prompt_file_holds_fixed_length_prompts_with_answers(tmp_path):
    records = read_prompts(write_prompt_file(tmp_path / "prompts.jsonl", num_prompts=20))
    assert len(records) == 20
    assert {len(r["prompt"]) for r in records} == {8}
    first = records[0]
    left, right = first["prompt"].rstrip("=").split("+")
    assert int(first["answer"]) == int(left) + int(right)


def test_arithmetic_reward_reads_the_text_before_eos():
    assert arithmetic_reward("1017<eos><pad><pad>", "1017") == 1.0
    assert arithmetic_reward("1018<eos>", "1017") == 0.0
    assert arithmetic_reward("10171", "1017") == 0.0


def test_response_mask_keeps_tokens_up_to_and_including_the_first_eos():
    eos = 1
    responses = torch.tensor([[5, 6, 1, 0, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).float()
    assert torch.equal(response_mask(responses, eos), expected)


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, eps=0.0)
    # Group 1: mean 0.25, unbiased std sqrt(0.25) = 0.5 -> (1 - 0.25) / 0.5 = 1.5, -0.5 each.
    assert torch.allclose(advantages[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # Group 2: all equal -> zero advantage (0 / (0 + eps) with eps > 0 in real use).
    assert torch.equal(group_advantages(rewards, 4)[4:], torch.zeros(4))


def test_process_tree_memory_sums_the_peaks_of_parent_and_children():
    # The parent shell starts two children that each touch 60 MiB and then sleep.
    child = ("import time; block = bytearray(60 * 1024 * 1024); "
             "block[::4096] = b'x' * len(block[::4096]); time.sleep(1.5)")
    script = f"{sys.executable} -c \"{child}\" & {sys.executable} -c \"{child}\" & wait"
    process = subprocess.Popen(["bash", "-c", script])
    with ProcessTreeMemory(process.pid, interval_s=0.1) as memory:
        process.wait()
        time.sleep(0.1)
    assert process.returncode == 0
    assert len(memory.peak_kib) >= 3
    assert memory.total_mib > 120


def test_median_and_spread_reports_middle_and_range():
    assert median_and_spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}



def test_steal_meter_is_the_stolen_share_of_the_cpu_time_the_block_spanned(monkeypatch):
    import bench_setup

    steal, total = bench_setup._cpu_ticks()  # this machine's /proc/stat, read as it is
    assert 0 <= steal <= total
    ticks = iter([(100, 1000), (130, 1300)])  # (steal, total) jiffies before and after
    monkeypatch.setattr(bench_setup, "_cpu_ticks", lambda: next(ticks))
    with StealMeter() as meter:
        pass
    assert meter.fraction == 30 / 300
