"""The reward-per-wall-clock benchmark's pure parts: the loop's recipe against realrl's, the
reward, the padded log-probabilities, and the bookkeeping of curves and thresholds."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_reward_time as bench  # noqa: E402

DEFAULT_ACTOR = Path(__file__).resolve().parents[2] / "realrl" / "assets" / "default-actor-v1"


def test_exact_match_reward_agrees_with_realrls_math_verifier():
    from realrl.rewards import MathVerifier

    completions = ["357", " 357", "35", "0357", "12+3=15", "", "abc", "3.5", "-81", "81", "7 7"]
    references = ["357", "357", "357", "357", "15", "4", "4", "3", "-81", "-81", "77"]
    with MathVerifier(num_workers=1) as verifier:
        expected = verifier.score(completions, [[reference] for reference in references])
    ours = [bench.exact_match_reward(c, r) for c, r in zip(completions, references)]
    assert ours == expected
    assert ours[:5] == [1.0, 1.0, 0.0, 1.0, 1.0]  # "0357" is the number 357; last number wins


def test_loop_group_advantages_equal_realrls_grpo_estimator():
    from realrl.algo.group_stats import group_normalised_scores

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    group_ids = torch.arange(3).repeat_interleave(4)
    realrl = group_normalised_scores(rewards, group_ids, divide_by_std=True, std_eps=1e-6)
    loop = bench.group_advantages(rewards, group_size=4)
    # Group 0: mean 0.25, unbiased std 0.5: (1 - 0.25) / 0.5 = 1.5; all-equal group 1: zeros.
    assert torch.allclose(loop, realrl, atol=1e-5)
    assert loop[0].item() == pytest.approx(1.5, abs=1e-5) and loop[4:8].abs().max() == 0


def test_realrl_command_sets_the_loops_recipe_in_a_valid_config():
    from realrl.api.config import resolve_config
    from realrl.experiments.ppo_math import PPOMathConfig

    command = bench.realrl_command(None, "realrl", seed=3, model=DEFAULT_ACTOR,
                                   run_root=Path("/tmp/x"))
    assert command[1:4] == ["-m", "realrl.apps.quickstart", "ppo-math"]
    config = resolve_config(PPOMathConfig, command[4:])
    assert not config.pipeline_rollout and config.trial_name == "realrl-seed3"
    assert (config.dataset.batch_size, config.group_size, config.gen.max_new_tokens) == (16, 8, 8)
    assert (config.actor.optimizer.lr, config.actor.optimizer.weight_decay) == (2e-4, 0.0)
    assert config.ppo.adv_estimator == "grpo" and config.ppo.disable_value
    assert config.ppo.kl_ctl == 0 and not config.ppo.adv_norm  # group-normalised only, no KL
    assert (config.gen.temperature, config.gen.top_k, config.gen.top_p) == (1.0, 0, 1.0)
    assert config.seed == 3 and config.dataset.builtin_train_size == 256
    pipelined = bench.realrl_command(None, "realrl-pipelined", seed=3, model=DEFAULT_ACTOR,
                                     run_root=Path("/tmp/x"))
    assert resolve_config(PPOMathConfig, pipelined[4:]).pipeline_rollout
    streamed = bench.realrl_command(None, "realrl-async-eta4", seed=3, model=DEFAULT_ACTOR,
                                    run_root=Path("/tmp/x"))
    config = resolve_config(PPOMathConfig, streamed[4:])
    assert config.rollout.is_async and config.rollout.max_head_offpolicyness == 4
    assert not config.ppo.decoupled_loss
    decoupled = bench.realrl_command(None, "realrl-async-eta8-decoupled", seed=3,
                                     model=DEFAULT_ACTOR, run_root=Path("/tmp/x"))
    config = resolve_config(PPOMathConfig, decoupled[4:])
    assert config.rollout.max_head_offpolicyness == 8 and config.ppo.decoupled_loss
    assert config.trial_name == "realrl-async-eta8-decoupled-seed3"


@pytest.mark.parametrize("system", ["realrl-async-eta", "realrl-async-etax", "realrl-sync",
                                    "realrl-async-eta2-coupled"])
def test_an_unknown_system_is_refused_with_the_choices(system):
    with pytest.raises(ValueError, match="realrl-async-eta<N>-decoupled"):
        bench.check_system(system)


def test_decode_completions_stop_at_the_first_eos():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_ACTOR, local_files_only=True)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    digits = tokenizer.convert_tokens_to_ids(["4", "2", "7"])
    responses = torch.tensor(
        [[digits[0], digits[1], eos, pad], [digits[2], eos, digits[0], eos], digits + [digits[0]]]
    )
    assert bench.decode_completions(tokenizer, responses, eos) == ["42", "7", "4274"]


def test_clipped_token_mean_loss_averages_minus_advantage_over_response_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss = bench.clipped_token_mean_loss(logprobs, advantages, mask)
    # Ratio 1 everywhere: per-token loss -A; (3 * -2 + 2 * 1) / 5 tokens = -0.8.
    assert loss.item() == pytest.approx(-0.8)
    loss.backward()
    # d loss / d logprob = -A * ratio / 5 on response tokens, 0 on the masked one.
    expected = torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]])
    assert torch.allclose(logprobs.grad, expected)


def test_response_logprobs_of_a_left_padded_batch_match_each_sequence_alone():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_ACTOR, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    # Prompt lengths 2 and 4 (left-padded to 4), responses of 3 and 2 tokens (then padding).
    sequences = torch.tensor([[pad, pad, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, pad]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with torch.no_grad():
        padded = bench.response_logprobs(model, sequences, prompt_mask, mask)
        for row, (start, length) in enumerate([(2, 5), (0, 6)]):
            alone = sequences[row : row + 1, start : start + length]  # no padding at all
            logits = model(input_ids=alone).logits[0, :-1]
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, alone[0, 1:, None])[:, 0]
            response_len = int(mask[row].sum())
            assert torch.allclose(padded[row, :response_len], logprobs[-response_len:], atol=1e-5)


def test_moving_average_is_none_until_the_window_is_full():
    assert bench.moving_average([1.0, 0.0, 1.0, 1.0], window=2) == [None, 0.5, 0.5, 1.0]


def test_time_to_threshold_is_the_first_crossing_or_infinity():
    times, averages = [1.0, 2.0, 3.0, 4.0], [None, 0.4, 0.5, 0.45]
    assert bench.time_to_threshold(times, averages, 0.45) == 3.0
    assert bench.time_to_threshold(times, averages, 0.6) == math.inf


def _run(system, seed, rewards, seconds_per_step):
    steps = [
        {"elapsed_s": (i + 1) * seconds_per_step, "reward": r, "step_s": seconds_per_step}
        for i, r in enumerate(rewards)
    ]
    return {"system": system, "seed": seed, "startup_s": 5.0, "steps": steps}


def test_summarise_takes_medians_over_seeds_and_counts_seeds_that_miss():
    runs = [
        _run("realrl", 1, [0.0, 1.0, 1.0], 1.0),
        _run("realrl", 2, [0.0, 0.0, 1.0], 2.0),
        _run("realrl", 3, [0.0, 0.0, 0.0], 1.0),
        _run("loop", 1, [1.0, 1.0], 3.0),
    ]
    summary = bench.summarise(runs, thresholds=[0.5], window=2)
    # Window-2 averages cross 0.5 at t=2 (seed 1), t=6 (seed 2), never (seed 3): median 6.
    assert summary["realrl"]["time_to_threshold_s"][0.5] == 6.0
    assert summary["realrl"]["seeds_reaching"][0.5] == 2
    assert summary["realrl"]["final_average"] == 0.5  # finals 1.0, 0.5, 0.0
    assert summary["loop"]["time_to_threshold_s"][0.5] == 6.0
    table = bench.format_table(summary, [0.5], budget_s=150)
    assert "| realrl | 6.0 (2/3) | 3 (3-3) | 1.00 | 0.500 | 5.0 |" in table


def test_step_table_gives_each_marks_median_and_range_and_the_async_utilisation():
    runs = [_run("realrl-async-eta2", seed, [float(seed % 2)] * 30, 1.0) for seed in (1, 2, 3)]
    for run in runs:
        for index, step in enumerate(run["steps"]):
            # The first WARM_UP_STEPS are left out of the means: 0.9 busy after them.
            step["async/generator_busy_fraction"] = 0.9 if index >= bench.WARM_UP_STEPS else 0.1
    summary = bench.summarise(runs, thresholds=[0.5], window=20)["realrl-async-eta2"]
    assert summary["reward_at_step"][25] == [1.0, 0.0, 1.0]
    assert all(math.isnan(value) for value in summary["reward_at_step"][50])
    assert summary["generator_busy"] == pytest.approx(0.9) and math.isnan(summary["bound_wait"])
    table = bench.format_step_table({"realrl-async-eta2": summary})
    assert "| realrl-async-eta2 | 1.000 (0.000-1.000, 3) | - | - | - | 0.90 |  |  |  |" in table


def test_summarise_reports_not_reached_when_most_seeds_miss():
    runs = [_run("loop", seed, [0.0] * 4, 1.0) for seed in (1, 2)]
    summary = bench.summarise(runs, thresholds=[0.5], window=2)
    assert "not reached (0/2)" in bench.format_table(summary, [0.5], budget_s=10)


def test_step_watcher_stamps_only_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    watcher = bench.StepWatcher(path)
    watcher.poll()  # the file does not exist yet
    path.write_text(json.dumps({"step": 1, "step_s": 0.5}) + "\n" + '{"step": 2, "st')
    watcher.poll()
    assert [record["step"] for _, record in watcher.steps] == [1]
    with open(path, "a") as stream:
        stream.write('ep_s": 0.25}\n')
    watcher.poll()
    assert [record for _, record in watcher.steps][1] == {"step": 2, "step_s": 0.25}
    assert watcher.steps[0][0] <= watcher.steps[1][0]


def test_step_seconds_reads_realrl_and_loop_records():
    assert bench.step_seconds({"timing/step_s": 0.3, "reward/task_mean": 0.5}) == 0.3
    assert bench.step_seconds({"step_s": 1.5}) == 1.5


def test_plot_curves_writes_a_png(tmp_path):
    runs = [_run("realrl", 1, [0.0, 1.0, 1.0], 1.0), _run("loop", 1, [1.0, 0.0, 1.0], 3.0)]
    path = tmp_path / "curves.png"
    bench.plot_curves(runs, window=2, thresholds=[0.5], path=path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_loop_arguments_default_to_the_shared_recipe():
    args = bench.parse_args(["loop", "--model", "m", "--seed", "2", "--output", "o.jsonl"])
    assert (args.batch_size, args.group_size, args.max_new_tokens) == (16, 8, 8)
    assert (args.lr, args.train_size, args.threads) == (2e-4, 256, 2)


def _compact(run: dict) -> dict:
    """A run as the copies under benchmarks/results/ keep it: each step a row of `step_keys`,
    None where a step lacks the key."""
    keys = sorted({key for step in run["steps"] for key in step})
    return run | {"step_keys": keys, "steps": [[step.get(key) for key in keys]
                                               for step in run["steps"]]}


@pytest.mark.parametrize("compact", [False, True], ids=["as-written", "compact-copy"])
def test_from_results_re_summarises_and_plots_without_running_anything(tmp_path, capsys,
                                                                       compact):
    runs = [_run("realrl", 1, [0.0, 1.0, 1.0], 1.0), _run("loop", 1, [0.0, 0.0, 1.0], 2.0)]
    if compact:
        runs[0]["steps"][0]["async/generator_busy_fraction"] = 0.5  # a key the others lack
        runs = [_compact(run) for run in runs]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(
        json.dumps(
            {
                "budget_s": 6.0,
                "load_average_start": [1.0, 1.0, 1.0],
                "load_average_end": [2.0, 1.0, 1.0],
                "runs": runs,
            }
        )
    )
    bench.main(
        [
            "--work-dir",
            str(tmp_path / "out"),
            "--from-results",
            str(earlier),
            "--thresholds",
            "0.5",
            "--window",
            "2",
        ]
    )
    table = capsys.readouterr().out
    assert "| realrl | 2.0 (1/1) |" in table and "| loop | 6.0 (1/1) |" in table
    assert (tmp_path / "out" / "reward_time.png").is_file()
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["summary"]["loop"]["steps"] == 3
