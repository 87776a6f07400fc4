"""The RL-step benchmark's bookkeeping: realrl's metrics split into parts, paired speed-ups."""

import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from bench_rl_step import (  # noqa: E402
    format_gpu_table,
    format_table,
    gpu_columns,
    gpu_targets,
    measured_steps,
    microbatch_overrides,
    parse_args,
    realrl_step_rows,
    speedups,
    summarise,
    trl_micro_batch,
)

TINY_CONFIG = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
               "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 10}


def _metrics_file(tmp_path, metrics):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(metrics) + "\n")
    return path


def test_realrl_step_rows_split_a_step_into_generate_inference_train_and_other(tmp_path):
    metrics = {"step": 2, "timing/step_s": 10.0, "perf/compute_s": 9.2,
               "timing/actor_gen": 4.0, "timing/rew_inf": 0.1, "timing/ref_inf": 1.0,
               "timing/critic_inf": 0.9, "timing/actor_train": 2.0, "timing/critic_train": 1.5,
               "timing/realloc/actor_gen": 0.3, "actor_gen/response_length": 30.0}
    [row] = realrl_step_rows(_metrics_file(tmp_path, metrics), num_seqs=32)
    assert row["generate_s"] == 4.0
    assert abs(row["inference_s"] - 2.0) < 1e-12  # 0.1 + 1.0 + 0.9
    assert row["train_s"] == 3.5
    assert abs(row["other_s"] - 0.8) < 1e-12  # 10.0 - 9.2: outside every worker's compute
    assert row["realloc_s"] == 0.3
    assert row["generated_tokens"] == 960.0


def test_other_is_undefined_when_calls_overlapped(tmp_path):
    # actor_train and critic_train side by side on two workers: 0.4 + 0.4 s in a 0.6 s step.
    metrics = {"step": 1, "timing/step_s": 0.6, "perf/compute_s": 0.8,
               "timing/actor_train": 0.4, "timing/critic_train": 0.4}
    [row] = realrl_step_rows(_metrics_file(tmp_path, metrics), num_seqs=32)
    assert row["other_s"] != row["other_s"]  # NaN, printed as "-"


def _run(system, repeat, seconds):
    return {"system": system, "mode": "fixed", "dtype": "float32", "repeat": repeat,
            "steps": [{"step_s": s} for s in seconds]}


def test_speedups_pair_runs_of_the_same_repeat():
    runs = [_run("realrl-grpo", 0, [1.0, 1.2, 1.1]), _run("trl", 0, [3.3]),
            _run("realrl-grpo", 1, [4.0]), _run("trl", 1, [8.0])]
    # Repeat 0: 3.3 / 1.1 = 3.0; repeat 1: 8 / 4 = 2.0; median 2.5.
    [line] = speedups(runs)
    assert "2.50x faster than trl" in line and "[3.0, 2.0]" in line


def test_speedups_compare_each_realrl_system_with_the_baselines_of_its_algorithm():
    runs = [_run("realrl-grpo", 0, [1.0]), _run("realrl-ppo", 0, [2.0]), _run("trl", 0, [3.0]),
            _run("trl-ppo", 0, [7.0])]
    assert speedups(runs) == [
        "fixed float32: realrl-grpo is 3.00x faster than trl (per-repeat ratios [3.0])",
        "fixed float32: realrl-ppo is 3.50x faster than trl-ppo (per-repeat ratios [3.5])",
    ]


def test_format_table_prints_one_row_per_system():
    summary = {"system": "loop", "mode": "fixed", "dtype": "float32",
               "step_s": {"median": 2.0, "min": 1.5, "max": 2.5, "n": 2}, "mean_step_s": 2.25,
               "generate_s": 1.5, "inference_s": 0.0, "train_s": 0.5, "other_s": float("nan"),
               "other_fraction": None, "response_length": 21.5, "generated_tokens_per_s": 680.0,
               "model_gflops_per_s": 10.0, "fraction_of_ceiling": 0.1, "peak_memory_mib": 600.0,
               "run_wall_s": 20.0, "run_cpu_s": 38.0, "load_average": 2.1}
    table = format_table([summary]).splitlines()
    assert len(table) == 3
    assert "| 2.00 (1.50-2.50, n=2) | 2.25 |" in table[2] and "10.0 (10.0%)" in table[2]
    assert "| 21.5 | 680 |" in table[2]  # mean response length, then generated tokens/s


def test_summary_reports_the_mean_response_length_over_every_measured_step(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    args = parse_args(["--batch-size", "2", "--group-size", "2"])
    args.model_dir = tmp_path

    def run(repeat, tokens):
        steps = [{"step_s": t / 40, "generate_s": 0.5, "generated_tokens": t} for t in tokens]
        return {"system": "trl", "mode": "natural", "dtype": "float32", "repeat": repeat,
                "steps": steps, "peak_memory_mib": 1.0, "cpu_s": 1.0,
                "load_average_before": 0.0, "wall_s": 1.0}

    [summary] = summarise(args, [run(0, [40.0, 48.0]), run(1, [100.0])], {"float32": 1.0})
    # 4 sequences a step; (40 + 48 + 100) / 3 steps / 4 = 15.67 tokens a response.
    assert abs(summary["response_length"] - 188.0 / 12) < 1e-9
    # Medians per run (1.1 s, 2.5 s), their median 1.8 s; the mean of all three steps 1.57 s.
    assert abs(summary["step_s"]["median"] - 1.8) < 1e-9
    assert abs(summary["mean_step_s"] - 188.0 / 40 / 3) < 1e-9


def test_measured_steps_drop_the_warm_up_and_a_pipelined_runs_last_step():
    rows = [{"step": step} for step in range(1, 8)]
    assert [r["step"] for r in measured_steps(rows, "realrl-grpo", 2, 7)] == [3, 4, 5, 6, 7]
    assert [r["step"] for r in measured_steps(rows, "trl", 2, 7)] == [3, 4, 5, 6, 7]
    for pipelined in ("realrl-grpo-pipelined", "realrl-grpo-pipelined-noshare"):
        assert [r["step"] for r in measured_steps(rows, pipelined, 2, 7)] == [3, 4, 5, 6]


def test_realrl_step_rows_take_the_largest_peak_over_mfcs(tmp_path):
    metrics = {"step": 1, "timing/step_s": 1.0, "perf/compute_s": 1.0,
               "actor_gen/peak_memory_gb": 3.5, "actor_train/peak_memory_gb": 7.25}
    [row] = realrl_step_rows(_metrics_file(tmp_path, metrics), num_seqs=4)
    assert row["peak_memory_gb"] == 7.25
    assert row["peak_memory_gb_by_mfc"] == {"actor_gen": 3.5, "actor_train": 7.25}


def test_gpu_columns_against_hand_computed_floor_and_mfu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    args = parse_args(["--device", "cuda", "--batch-size", "2", "--group-size", "2",
                       "--max-new-tokens", "4"])
    args.model_dir = tmp_path
    # Matmul parameters: q,o 2 * 8 * 8 + k,v 2 * 8 * 4 + MLP 3 * 8 * 16 + LM head 8 * 10 = 656.
    # Decode at 4 sequences, mean context 8 prompt + 4 / 2 = 10 tokens: bytes 2 * 656 weights
    # + 16 KV bytes a token (2 * 1 layer * 1 head * 4 dims * 2 bytes) * 4 * 10 = 1952 at
    # 1000 B/s = 1.952 s; FLOPs 2 * 656 * 4 = 5248 at 1000 FLOP/s = 5.248 s: the floor.
    ceilings = {"bandwidth_gb_per_s": 1e-6, "bfloat16": 1e-6}
    # Training: 4 sequences of 12 tokens, 48 tokens; forward 2 * 656 * 48 + attention
    # 4 * 1 layer * 8 * 6 mean context * 48 = 72192 FLOPs, forward and backward 216576.
    parts = {"generate_s": 4 * 5.248 * 2, "train_s": 216576 / 1000 / 0.5}
    grpo = gpu_columns(args, "realrl-grpo", "fixed", "bfloat16", parts, ceilings)
    assert abs(grpo["decode_floor_ms"] - 5248.0) < 1e-6
    assert abs(grpo["decode_ms_per_step"] - 2 * 5248.0) < 1e-6
    assert abs(grpo["decode_x_floor"] - 2.0) < 1e-9
    assert abs(grpo["train_mfu"] - 0.5) < 1e-9
    # PPO trains the critic too: the same trunk without the LM head's 3 * 2 * 80 * 48 FLOPs.
    ppo = gpu_columns(args, "realrl-ppo", "fixed", "bfloat16", parts, ceilings)
    assert abs(ppo["train_mfu"] - (216576 + 216576 - 23040) / 216576 * 0.5) < 1e-9
    # Natural-length responses: no decode step time (the step count is not the token count).
    natural = gpu_columns(args, "realrl-grpo", "natural", "bfloat16", parts, ceilings)
    assert natural["decode_ms_per_step"] is None and natural["decode_x_floor"] is None
    # TRL's step is not split by call: no train seconds, no MFU.
    trl = gpu_columns(args, "trl", "fixed", "bfloat16",
                      {"generate_s": float("nan"), "train_s": float("nan")}, ceilings)
    assert trl["train_mfu"] is None and trl["decode_x_floor"] is None


def _gpu_summary(system, step_s, decode_x_floor=None, train_mfu=None):
    return {"system": system, "mode": "fixed", "dtype": "bfloat16",
            "step_s": {"median": step_s}, "generate_s": 1.0, "train_s": 0.5,
            "generated_tokens_per_s": 1000.0, "decode_ms_per_step": None,
            "decode_floor_ms": 2.0, "decode_x_floor": decode_x_floor, "train_mfu": train_mfu,
            "peak_gpu_memory_gb": 20.0}


def test_gpu_targets_say_which_are_met():
    summaries = [_gpu_summary("realrl-grpo", 10.0, decode_x_floor=2.5, train_mfu=0.4),
                 _gpu_summary("realrl-ppo", 20.0, decode_x_floor=1.5, train_mfu=0.3),
                 _gpu_summary("trl", 35.0)]
    assert gpu_targets(summaries, 512) == [
        "fixed bfloat16 realrl-grpo: step 3.50x TRL's (target >= 3x: met)",
        "fixed bfloat16 realrl-grpo: decode 2.5x its floor at batch 512 (target <= 2x: not met)",
        "fixed bfloat16 realrl-grpo: training MFU 40.0% (target > 35%: met)",
        "fixed bfloat16 realrl-ppo: decode 1.5x its floor at batch 512 (target <= 2x: met)",
        "fixed bfloat16 realrl-ppo: training MFU 30.0% (target > 35%: not met)",
    ]


def test_format_gpu_table_prints_missing_columns_as_dashes():
    table = format_gpu_table([_gpu_summary("trl", 35.0)]).splitlines()
    assert len(table) == 3
    assert table[2] == ("| fixed | bfloat16 | trl | 35.00 | 1.00 | 0.50 | 1000 | - | 2.00 | - | "
                        "-% | 20.0 |")


def test_microbatch_budget_reaches_every_forward_and_train_mfc_and_trls_batch():
    args = parse_args(["--batch-size", "64", "--group-size", "8", "--max-new-tokens", "512",
                       "--max-tokens-per-microbatch", "16384"])
    assert microbatch_overrides(args, "realrl-grpo") == [
        "actor_train.max_tokens_per_microbatch=16384"]
    assert len(microbatch_overrides(args, "realrl-ppo")) == 4
    # 16384 tokens hold 31 completions of 8 + 512 tokens; the most that divide 512 is 16.
    assert trl_micro_batch(args) == 16
    unbounded = parse_args(["--batch-size", "4"])
    assert microbatch_overrides(unbounded, "realrl-ppo") == [] and trl_micro_batch(unbounded) == 0
