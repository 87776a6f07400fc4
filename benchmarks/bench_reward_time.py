"""Reward per wall-clock second (issue 8): realrl against a hand-written GRPO loop.

Both systems train the built-in default actor (`realrl/assets/default-actor-v1`) on the
built-in arithmetic prompts (`builtin_records(prompt, train_size=256)`, served in realrl's
seeded `EpochIterator` order) with the same GRPO recipe, for the same wall-clock budget, for
several seeds, and we compare how fast each one's task reward climbs:

- `realrl`: `python -m realrl.apps.quickstart ppo-math ppo.disable_value=true
  ppo.adv_estimator=grpo ppo.kl_ctl=0 ppo.adv_norm=false ...`, its default 2 single-threaded
  model workers, stopped with SIGTERM when the budget is used;
- `realrl-pipelined` (opt-in): the same with `pipeline_rollout=true`: worker 0 generates step
  i+1's rollout while worker 1 trains step i, so rollouts are one train step off-policy;
- `realrl-async-eta<N>` (opt-in, any N, e.g. 1, 2, 4, 8): `rollout.mode=async` with
  `rollout.max_head_offpolicyness=N`: worker 0 streams rollout requests while worker 1
  trains, each group at most N train steps off-policy, plain PPO loss on the stale samples;
  `realrl-async-eta<N>-decoupled`: the same with AReaL's decoupled objective
  (`ppo.decoupled_loss=true`, proximal log-probs from the training forward itself: one
  optimizer step per batch, so no extra forward);
- `loop`: `run_loop` below, one process with 2 torch threads: transformers `generate` (left
  padding, KV cache, sampling) for the rollouts, one padded forward/backward, one AdamW step;
- `loop-passive` (opt-in): the same loop with `OMP_WAIT_POLICY=PASSIVE`, the setting realrl's
  launcher gives its workers; on a loaded machine it decides most of the gap (reward_time.md).

Shared recipe: 16 prompts x 8 samples per step, at most 8 new tokens, temperature 1 (no
top-k/top-p), reward 1 when the answer extracted from the response equals the reference
(`realrl.rewards.extract_answer` + `fast_match`, what realrl's math reward does for integer
answers), GRPO advantages `A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-6)` (Shao et al.
2024, eq. 3, unbiased std, no extra batch whitening), the clipped surrogate of PPO (Schulman
et al. 2017, eq. 7, eps 0.2) averaged over all response tokens of the batch, no KL, gradient
clipping at 1.0, AdamW lr 2e-4 with no weight decay, one optimizer step per batch, fp32.

Time axis: seconds since the run's first step began. The parent polls each run's metrics file
and stamps every step's line when it appears; the first step began at that stamp minus the
step's own `step_s`. Process start to first step (imports, worker start-up, model loading) is
measured separately and reported as `startup_s`. Runs are interleaved (seed 1 realrl, seed 1
loop, seed 2 realrl, ...) so the machine's background load hits both alike.

    .venv/bin/python benchmarks/bench_reward_time.py --seeds 1,2,3 --budget-s 150
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_loop import group_advantages, response_mask  # noqa: E402

logger = logging.getLogger("bench_reward_time")
BENCH_FILE = Path(__file__).resolve()
REPO_ROOT = BENCH_FILE.parents[1]
SYSTEMS = ("realrl", "realrl-pipelined", "loop", "loop-passive")  # and realrl-async-eta<N>...
ASYNC_PREFIX, DECOUPLED_SUFFIX = "realrl-async-eta", "-decoupled"
RECIPE = {"batch_size": 16, "group_size": 8, "max_new_tokens": 8, "lr": 2e-4, "train_size": 256}
GRPO_OVERRIDES = [
    "ppo.disable_value=true",
    "ppo.adv_estimator=grpo",
    "ppo.kl_ctl=0",
    "ppo.adv_norm=false",
]


# ---------------------------------------------------------------- the hand-written loop


def exact_match_reward(completion: str, reference: str) -> float:
    """1.0 when the answer realrl's math reward extracts from `completion` equals `reference`.

    For integer references `fast_match` always decides; the rare undecided case (a decimal
    prediction) would go to math-verify in realrl and can only be unequal to an integer."""
    from realrl.rewards.math_answer import extract_answer, fast_match

    answer = extract_answer(completion)
    return 1.0 if answer is not None and fast_match(answer, reference) is True else 0.0


def decode_completions(tokenizer, responses: torch.Tensor, eos_token_id: int) -> list[str]:
    """Text of each response up to (not including) its first EOS. responses: [num_seqs, T]"""
    texts = []
    for row in responses.tolist():
        end = row.index(eos_token_id) if eos_token_id in row else len(row)
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return texts


def clipped_token_mean_loss(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_clip: float = 0.2
) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) averaged over response tokens.

    One optimizer step per batch, so the old log-probabilities are the detached current ones:
    the ratio is 1 and the gradient is `-A * grad log pi` per token, as in realrl's actor.
    logprobs, mask: [num_seqs, T]; advantages: [num_seqs]."""
    ratio = torch.exp(logprobs - logprobs.detach())
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def sample_groups(model, tokenizer, prompts: list[str], args):
    """Sequences [num_seqs, P + T] (left-padded prompts), their prompt mask [num_seqs, P]."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        sequences = model.generate(
            **encoded,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            num_return_sequences=args.group_size,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt_mask = encoded["attention_mask"].repeat_interleave(args.group_size, dim=0)
    return sequences, prompt_mask


def response_logprobs(
    model, sequences: torch.Tensor, prompt_mask: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of the response tokens [num_seqs, T] from one padded forward.

    Prompts are left-padded, so positions count real tokens only (as `generate` numbered
    them); padding after a response's EOS is masked out of attention."""
    prompt_width = prompt_mask.shape[1]
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)  # [num_seqs, P + T]
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(
        input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids
    ).logits
    logits = logits[:, prompt_width - 1 : -1].float()  # [num_seqs, T, vocab], predicts responses
    return (
        torch.log_softmax(logits, dim=-1)
        .gather(-1, sequences[:, prompt_width:].unsqueeze(-1))
        .squeeze(-1)
    )  # [num_seqs, T]


def train_on_groups(model, optimizer, sequences, prompt_mask, mask, advantages) -> float:
    """One forward/backward over prompt + response and one AdamW step; returns the loss."""
    model.train()
    logprobs = response_logprobs(model, sequences, prompt_mask, mask)
    loss = clipped_token_mean_loss(logprobs, advantages, mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def run_loop(args: argparse.Namespace) -> None:
    """The baseline, run in its own process; one JSON line per step, until it is stopped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realrl.api.experiment import DatasetKind
    from realrl.datasets.loader import EpochIterator
    from realrl.workers.data_source import builtin_records

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    records = builtin_records(DatasetKind.prompt, train_size=args.train_size)
    batches = EpochIterator(len(records), args.batch_size, args.seed, drop_last=True)
    with open(args.output, "w") as output:
        for step in range(1, args.max_steps + 1):
            started = time.perf_counter()
            batch = [records[index] for index in batches.next_batch()]
            sequences, prompt_mask = sample_groups(
                model, tokenizer, [r["prompt"] for r in batch], args
            )
            responses = sequences[:, prompt_mask.shape[1] :]  # [num_seqs, T]
            mask = response_mask(responses, tokenizer.eos_token_id)
            texts = decode_completions(tokenizer, responses, tokenizer.eos_token_id)
            answers = [r["answer"] for r in batch for _ in range(args.group_size)]
            rewards = torch.tensor([exact_match_reward(t, a) for t, a in zip(texts, answers)])
            advantages = group_advantages(rewards, args.group_size)
            loss = train_on_groups(model, optimizer, sequences, prompt_mask, mask, advantages)
            output.write(
                json.dumps(
                    {
                        "step": step,
                        "step_s": time.perf_counter() - started,
                        "reward": float(rewards.mean()),
                        "loss": loss,
                    }
                )
                + "\n"
            )
            output.flush()


# ---------------------------------------------------------------- running and stopping


class StepWatcher:
    """Reads the complete JSON lines appended to a metrics file and stamps each on arrival."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.pending = path, 0, ""
        self.steps: list[tuple[float, dict]] = []  # (perf_counter at arrival, record)

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path) as stream:
            stream.seek(self.offset)
            text = stream.read()
            self.offset = stream.tell()
        now = time.perf_counter()
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()  # a line still being written
        self.steps += [(now, json.loads(line)) for line in lines if line.strip()]


def step_seconds(record: dict) -> float:
    """A step's own duration: realrl logs `timing/step_s`, the loop `step_s`."""
    return record["timing/step_s"] if "timing/step_s" in record else record["step_s"]


def stop_process(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM the process we started (realrl's launcher stops all of its children), then wait;
    SIGKILL only if it ignores the request."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d ignored SIGTERM for %.0f s; killing it", process.pid, grace_s)
        process.kill()
        process.wait()


def watch_run(
    command: list[str], env: dict, metrics_path: Path, log_path: Path, args: argparse.Namespace
) -> dict:
    """Start `command`, stamp its steps, stop it `budget_s` after its first step began."""
    load_before = os.getloadavg()[0]
    watcher = StepWatcher(metrics_path)
    launched = time.perf_counter()
    first_step_began = None
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            while True:
                time.sleep(args.poll_s)
                watcher.poll()
                now = time.perf_counter()
                if first_step_began is None and watcher.steps:
                    arrival, record = watcher.steps[0]
                    first_step_began = arrival - step_seconds(record)
                if first_step_began is not None and now - first_step_began >= args.budget_s:
                    break
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{command[:4]} exited with {process.returncode} before "
                        f"the budget was used; see {log_path}"
                    )
                if first_step_began is None and now - launched > args.startup_timeout_s:
                    raise RuntimeError(f"no step within {args.startup_timeout_s} s; see {log_path}")
        finally:
            stop_process(process)
    watcher.poll()
    return {
        "startup_s": first_step_began - launched,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "steps": [
            {"elapsed_s": arrival - first_step_began, **record}
            for arrival, record in watcher.steps
            if arrival - first_step_began <= args.budget_s
        ],
    }


def check_system(system: str) -> str:
    """`system` if the benchmark knows it, else a ValueError naming the choices."""
    bound = system.removeprefix(ASYNC_PREFIX).removesuffix(DECOUPLED_SUFFIX)
    if system in SYSTEMS or (system.startswith(ASYNC_PREFIX) and bound.isdigit()):
        return system
    raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}, "
                     f"{ASYNC_PREFIX}<N> or {ASYNC_PREFIX}<N>{DECOUPLED_SUFFIX} (N >= 0)")


def schedule_overrides(system: str) -> list[str]:
    """`realrl-pipelined`: pipeline_rollout=true; `realrl-async-eta<N>[-decoupled]`:
    rollout.mode=async with the staleness bound N (default request size), with the decoupled
    objective or without; `realrl`: synchronous."""
    if system == "realrl-pipelined":
        return ["pipeline_rollout=true"]
    if system.startswith(ASYNC_PREFIX):
        eta = int(system.removeprefix(ASYNC_PREFIX).removesuffix(DECOUPLED_SUFFIX))
        decoupled = ["ppo.decoupled_loss=true"] if system.endswith(DECOUPLED_SUFFIX) else []
        return ["rollout.mode=async", f"rollout.max_head_offpolicyness={eta}", *decoupled]
    return []


def realrl_command(args, system: str, seed: int, model: Path, run_root: Path) -> list[str]:
    pipelined = schedule_overrides(system)
    return [
        sys.executable,
        "-m",
        "realrl.apps.quickstart",
        "ppo-math",
        *GRPO_OVERRIDES,
        *pipelined,
        f"seed={seed}",
        "total_train_steps=1000000",
        "wandb.mode=disabled",
        "tensorboard=false",
        f"actor.path={model}",
        "actor.dtype=float32",
        f"dataset.batch_size={RECIPE['batch_size']}",
        f"group_size={RECIPE['group_size']}",
        f"dataset.builtin_train_size={RECIPE['train_size']}",
        f"gen.max_new_tokens={RECIPE['max_new_tokens']}",
        "gen.min_new_tokens=0",
        f"actor.optimizer.lr={RECIPE['lr']}",
        "actor.optimizer.weight_decay=0.0",
        "actor.optimizer.gradient_clipping=1.0",
        "ppo.eps_clip=0.2",
        "ppo.loss_agg_mode=token-mean",
        "ppo.num_minibatches=1",
        "ppo.num_epochs=1",
        f"output_root={run_root}",
        "experiment_name=reward-time",
        f"trial_name={system}-seed{seed}",
        *(args.overrides.split() if args else []),
    ]


def loop_command(args, seed: int, model: Path, output: Path) -> list[str]:
    return [
        sys.executable,
        str(BENCH_FILE),
        "loop",
        "--model",
        str(model),
        "--seed",
        str(seed),
        "--output",
        str(output),
        "--threads",
        str(args.threads),
    ]


def run_system(args, system: str, seed: int, model: Path) -> dict:
    """One run in a fresh process tree; its stamped steps, with reward under `reward`."""
    work_dir: Path = args.work_dir
    log_path = work_dir / "logs" / f"{system}-seed{seed}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if system.startswith("realrl"):
        run_dir = work_dir / "runs" / "reward-time" / f"{system}-seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        command = realrl_command(args, system, seed, model, work_dir / "runs")
        metrics_path, env = run_dir / "metrics.jsonl", dict(os.environ)
        env.pop("OMP_WAIT_POLICY", None)  # realrl's launcher picks its own (PASSIVE)
    else:
        metrics_path = work_dir / "loop" / f"{system}-seed{seed}.jsonl"
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)
        command = loop_command(args, seed, model, metrics_path)
        threads = str(args.threads)
        env = dict(
            os.environ,
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            TOKENIZERS_PARALLELISM="false",
        )
        env.pop("OMP_WAIT_POLICY", None)  # `loop`: OpenMP's default, as a user runs it
        if system == "loop-passive":  # idle OpenMP threads sleep, as realrl's workers' do
            env["OMP_WAIT_POLICY"] = "PASSIVE"
    run = watch_run(command, env, metrics_path, log_path, args)
    for step in run["steps"]:
        step.setdefault("reward", step.get("reward/task_mean"))
        step["step_s"] = step_seconds(step)
    logger.info(
        "%s seed %d: %d steps in %.0f s (start-up %.1f s), last reward %.3f, load %.1f->%.1f",
        system,
        seed,
        len(run["steps"]),
        args.budget_s,
        run["startup_s"],
        run["steps"][-1]["reward"] if run["steps"] else float("nan"),
        run["load_before"],
        run["load_after"],
    )
    return {"system": system, "seed": seed, **run}


# ---------------------------------------------------------------- analysis


def moving_average(values: list[float], window: int) -> list[float | None]:
    """Trailing mean over `window` steps; None until `window` values exist."""
    averages: list[float | None] = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averages.append(total / window if index + 1 >= window else None)
    return averages


def time_to_threshold(times: list[float], averages: list[float | None], threshold: float) -> float:
    """First time the moving average reaches `threshold`; `inf` if it never does."""
    for elapsed, average in zip(times, averages):
        if average is not None and average >= threshold:
            return elapsed
    return math.inf


def _mean_step_s(run: dict) -> float:
    """Wall-clock seconds per step over the run (a median would hide the slow outliers)."""
    steps = run["steps"]
    return steps[-1]["elapsed_s"] / len(steps) if steps else math.nan


def summarise(runs: list[dict], thresholds: list[float], window: int) -> dict[str, dict]:
    """Per system, over seeds: median time to each threshold (`inf` counts as not reached),
    how many seeds reached it, median steps within the budget, median final moving average."""
    summary = {}
    for system in dict.fromkeys(run["system"] for run in runs):
        own = [run for run in runs if run["system"] == system]
        reached, final, steps, startup = {t: [] for t in thresholds}, [], [], []
        for run in own:
            times = [step["elapsed_s"] for step in run["steps"]]
            averages = moving_average([step["reward"] for step in run["steps"]], window)
            for threshold in thresholds:
                reached[threshold].append(time_to_threshold(times, averages, threshold))
            final.append(averages[-1] if averages and averages[-1] is not None else math.nan)
            steps.append(len(run["steps"]))
            startup.append(run["startup_s"])
        summary[system] = {
            "time_to_threshold_s": {t: statistics.median(v) for t, v in reached.items()},
            "seeds_reaching": {t: sum(math.isfinite(x) for x in v) for t, v in reached.items()},
            "per_seed_time_to_threshold_s": reached,
            "steps": statistics.median(steps),
            "steps_per_seed": steps,
            "final_average": statistics.median(final),
            "step_s": statistics.median(_mean_step_s(run) for run in own),
            "median_step_s": statistics.median(s["step_s"] for run in own for s in run["steps"]),
            "final_average_per_seed": final,
            "startup_s": statistics.median(startup),
            "num_seeds": len(own),
            "reward_at_step": {
                step: [averages_at(run, window, step) for run in own] for step in STEP_MARKS},
            **{name: statistics.median(_run_mean(run, key) for run in own)
               for name, key in ASYNC_METRICS.items()},
        }
    return summary


# Steps at which the reward-per-step table compares the systems' moving averages.
STEP_MARKS = (25, 50, 100, 150)
# Async metrics, each the mean over a run's steps past the first few (then the seeds' median).
ASYNC_METRICS = {"generator_busy": "async/generator_busy_fraction",
                 "trainer_busy": "async/trainer_busy_fraction",
                 "bound_wait": "async/bound_wait_fraction",
                 "staleness": "actor_train/policy_lag"}
WARM_UP_STEPS = 5


def averages_at(run: dict, window: int, step: int) -> float:
    """The run's moving-average reward at `step` (1-based); NaN if it stopped before."""
    averages = moving_average([record["reward"] for record in run["steps"]], window)
    value = averages[step - 1] if len(averages) >= step else None
    return math.nan if value is None else value


def _run_mean(run: dict, key: str) -> float:
    values = [record[key] for record in run["steps"][WARM_UP_STEPS:] if key in record]
    return statistics.fmean(values) if values else math.nan


def format_table(summary: dict[str, dict], thresholds: list[float], budget_s: float) -> str:
    def seconds(value: float) -> str:
        return f"{value:.1f}" if math.isfinite(value) else "not reached"

    header = [
        "system",
        *[f"time to {t:g} (s)" for t in thresholds],
        f"steps in {budget_s:g} s",
        "s/step (mean)",
        "final reward (MA)",
        "start-up (s)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system, row in summary.items():
        cells = [system]
        for t in thresholds:
            cells.append(
                f"{seconds(row['time_to_threshold_s'][t])} "
                f"({row['seeds_reaching'][t]}/{row['num_seeds']})"
            )
        cells += [
            f"{row['steps']:g} ({min(row['steps_per_seed'])}-{max(row['steps_per_seed'])})",
            f"{row['step_s']:.2f}",
            f"{row['final_average']:.3f}",
            f"{row['startup_s']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_step_table(summary: dict[str, dict]) -> str:
    """Reward against steps (median and range over seeds of the moving average at each mark)
    and the async runs' utilisation: learning per step, apart from speed."""
    def spread(values: list[float]) -> str:
        done = [v for v in values if math.isfinite(v)]
        if not done:
            return "-"
        return f"{statistics.median(done):.3f} ({min(done):.3f}-{max(done):.3f}, {len(done)})"

    def fraction(value: float) -> str:
        return f"{value:.2f}" if math.isfinite(value) else ""

    header = ["system", *[f"reward at step {step}" for step in STEP_MARKS],
              "generator busy", "trainer busy", "bound wait", "mean staleness"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system, row in summary.items():
        cells = [system, *[spread(row["reward_at_step"][step]) for step in STEP_MARKS],
                 *[fraction(row[name]) for name in ASYNC_METRICS]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(runs: list[dict], window: int, thresholds: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10").colors
    colours = {system: palette[index % len(palette)]
               for index, system in enumerate(dict.fromkeys(run["system"] for run in runs))}
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        averages = moving_average([step["reward"] for step in run["steps"]], window)
        points = [(s["elapsed_s"], a) for s, a in zip(run["steps"], averages) if a is not None]
        axis.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            color=colours[run["system"]],
            alpha=0.8,
            linewidth=1.2,
            label=f"{run['system']} seed {run['seed']}",
        )
    for threshold in thresholds:
        axis.axhline(threshold, color="grey", linestyle=":", linewidth=0.8)
    axis.set_xlabel("seconds since the first step began")
    axis.set_ylabel(f"task reward ({window}-step moving average)")
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv and argv[0] == "loop":  # the baseline's own process
        parser = argparse.ArgumentParser(prog="bench_reward_time.py loop")
        parser.add_argument("--model", required=True)
        parser.add_argument("--seed", type=int, required=True)
        parser.add_argument("--output", required=True)
        parser.add_argument("--threads", type=int, default=2)
        parser.add_argument("--max-steps", type=int, default=1_000_000)
        for key, value in RECIPE.items():
            parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
        return parser.parse_args(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-reward-time")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument(
        "--systems",
        default="realrl,loop",
        help="Any of realrl, realrl-pipelined (pipeline_rollout=true: generation on one "
        "worker, training on the other, one step off-policy), realrl-async-eta<N> "
        "(rollout.mode=async with staleness bound N), realrl-async-eta<N>-decoupled (the same "
        "with ppo.decoupled_loss=true), loop, loop-passive (the loop with "
        "OMP_WAIT_POLICY=PASSIVE, which realrl's launcher gives its workers).",
    )
    parser.add_argument(
        "--overrides", default="",
        help="More key=value overrides of every realrl run, space-separated (e.g. 'mode=slurm "
        "slurm.gpu_request=none n_devices_per_node=4 allow_oversubscribe=true').")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="Wall-clock seconds per run, counted from its first step.",
    )
    parser.add_argument("--thresholds", default="0.45,0.5,0.55")
    parser.add_argument("--window", type=int, default=20, help="Moving-average steps.")
    parser.add_argument("--threads", type=int, default=2, help="Torch threads of the loop.")
    parser.add_argument("--poll-s", type=float, default=0.05)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--from-results",
        default=None,
        help="Re-summarise and re-plot the runs of an earlier results.json; runs nothing.",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if argv and argv[0] == "loop":
        run_loop(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.work_dir = Path(args.work_dir).resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        result = json.loads(Path(args.from_results).read_text())
        for run in result["runs"]:
            # The copies under benchmarks/results/ keep each step as a row of `step_keys`.
            keys = run.pop("step_keys", None)
            if keys is not None:
                run["steps"] = [{key: value for key, value in zip(keys, row) if value is not None}
                                for row in run["steps"]]
    else:
        result = measure(args, argv)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    result["summary"] = summarise(result["runs"], thresholds, args.window)
    plot_path = args.work_dir / "reward_time.png"
    plot_curves(result["runs"], args.window, thresholds, plot_path)
    (args.work_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.write(format_table(result["summary"], thresholds, result["budget_s"]) + "\n\n")
    sys.stdout.write(format_step_table(result["summary"]) + "\n\n")
    sys.stdout.write(
        f"load average (1, 5, 15 min) at start {result['load_average_start']}, at end "
        f"{result['load_average_end']}; plot {plot_path}; results {args.work_dir}/results.json\n"
    )


def measure(args: argparse.Namespace, argv: list[str]) -> dict:
    """Every run, interleaved seed by seed, with the machine's load around them."""
    from realrl.launcher.warm_start import ensure_warm_start

    model = ensure_warm_start()
    systems = [check_system(system) for system in args.systems.split(",") if system]
    load_start = os.getloadavg()
    runs = [
        run_system(args, system, int(seed), model)
        for seed in args.seeds.split(",")
        for system in systems
    ]
    return {
        "argv": argv,
        "model": str(model),
        "recipe": RECIPE,
        "budget_s": args.budget_s,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "runs": runs,
    }


if __name__ == "__main__":
    main()
