"""The RL-step benchmark's bookkeeping: realrl's metrics split into parts, paired speed-ups."""

import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from bench_rl_step import (  # noqa: E402
    format_table,
    measured_steps,
    parse_args,
    realrl_step_rows,
    speedups,
    summarise,
)


def test_realrl_step_rows_split_a_step_into_generate_inference_train_and_other(tmp_path):
    metrics = {"step": 2, "timing/step_s": 10.0, "perf/compute_s": 9.2,
               "timing/actor_gen": 4.0, "timing/rew_inf": 0.1, "timing/ref_inf": 1.0,
               "timing/critic_inf": 0.9, "timing/actor_train": 2.0, "timing/critic_train": 1.5,
               "timing/realloc/actor_gen": 0.3, "actor_gen/response_length": 30.0}
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text(json.dumps(metrics) + "\n")
    [row] = realrl_step_rows(metrics_file, num_seqs=32)
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
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text(json.dumps(metrics) + "\n")
    [row] = realrl_step_rows(metrics_file, num_seqs=32)
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
    config = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
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
