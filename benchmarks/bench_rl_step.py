"""One RL step on a fixed tiny model: realrl against a hand-written loop and TRL, side by side.

Workload (issue 8): the 3.95M-parameter Qwen2-architecture model of `bench_setup.py`, 8
fixed-length arithmetic prompts x 4 samples x 32 new tokens per step, sampling at
temperature 1. Systems:

- `realrl-grpo`: `python -m realrl.apps.quickstart ppo-math` with `ppo.disable_value=true
  ppo.adv_estimator=grpo ppo.kl_ctl=0` (critic-free, no reference: the same graph as TRL's
  GRPO with `beta=0`), run through the real CLI in a fresh process tree;
- `realrl-grpo-compiled`: the same with `gen.compile=true actor.compile=true` (compiled
  decode step and compiled blocks in the training forward; the compiles happen in the warm-up
  step, which is dropped);
- `realrl-grpo-pipelined`: compiled decode and `pipeline_rollout=true` on two model workers
  (one thread each): the rollout of step i+1 (generation, reward) runs on worker 0 while
  step i trains on worker 1, so rollouts are one train step off-policy (AReaL-style). Not the
  same algorithm as the others: compare it as the asynchronous option it is;
- `realrl-ppo`: full PPO (actor, critic, reference, rule reward; GAE, KL in the reward). On
  two CPU workers the launcher's `allocation_mode=auto` trains the actor and the critic side
  by side, one worker each (`ref_inf` with the actor), and generates on both;
- `realrl-ppo-compiled`: the same with the decode step and every model's blocks compiled;
- `loop`: `baseline_loop.py`, one process, transformers `generate` + one forward/backward;
- `trl`: `trl_grpo.py`, TRL's `GRPOTrainer` (skipped when `trl` is not importable);
- `trl-ppo`: `trl_ppo.py`, TRL's `PPOTrainer` doing `realrl-ppo`'s work. TRL dropped it after
  1.12.0, so it runs against that release installed in `--trl-ppo-path` (skipped without it).

Each configuration runs `--repeats` times in fresh processes, interleaved (system by system
inside each repeat) so that load from other users of the machine hits all systems alike.
The first `--warmup` steps of every run are dropped, and so is a pipelined run's last step,
which trains with no rollout beside it (not the steady state). Reported per system: seconds per
step (median of per-run medians, with min-max over runs), the split into generate / inference /
train / other (for realrl "other" is step time minus the worker-side compute of every MFC:
transport, splitting, merging and reallocation), the mean response length (natural-length
runs stop at EOS, so it says whether two systems did the same work), generated tokens/s,
model FLOP/s against the fp32 and bf16 matmul ceilings measured at the start of the same run,
and peak resident memory summed over every process of the run. Per run, also its wall and CPU
seconds (all processes, start-up included) and the 1-minute load average when it started: on a
shared machine a load above the core count means every system got less than its threads'
worth of CPU.

Threads: every system gets `--threads` (default 2, the machine's cores); realrl's launcher
gives its model workers the cores between them (its master mostly waits on sockets). By default
realrl runs as a user gets it: `n_devices_per_node=0`, which on a 2-core machine starts two
single-threaded model workers and runs every MFC data parallel over both (`--realrl-workers 1`:
one worker with both threads).

    .venv/bin/python benchmarks/bench_rl_step.py --repeats 3 --steps 4 --warmup 1

On one CUDA GPU (`--device cuda`, issue 23's benchmark): every realrl role colocated on the GPU
(`n_devices_per_node=1`), TRL's `GRPOTrainer` on the same GPU (transformers generation), in one
run; the loop and `trl-ppo` baselines are CPU-only. The recipe is issue 23's: the
Qwen2.5-0.5B-shaped model (`--model-size qwen2.5-0.5b`, random weights), 64 prompts x 8
samples x 512 forced new tokens, bf16, activations bounded by `--max-tokens-per-microbatch`
(realrl's `<mfc>.max_tokens_per_microbatch` of every forward and train MFC; TRL's
`--micro-batch`, the completions that fit in that many tokens). Besides the CPU columns: the
peak of allocated GPU memory per step (largest over MFCs), each decode step's time (generate
seconds over the forced token count, prefill included) against its floor (the larger of bytes
moved, bf16 weights plus the KV cache at its mean length, over the measured copy bandwidth, and
FLOPs over the measured bf16 matmul rate), the training MFU (model FLOPs of the trained models'
forward and backward over train seconds and the measured bf16 rate), and issue 23's three
targets checked:

    python3 benchmarks/bench_rl_step.py --device cuda --model-size qwen2.5-0.5b \
        --batch-size 64 --group-size 8 --max-new-tokens 512 --precisions bfloat16 \
        --max-tokens-per-microbatch 16384 --systems realrl-grpo,realrl-ppo,trl \
        --repeats 1 --steps 4 --warmup 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import (  # noqa: E402
    MODEL_SIZES,
    ModelShape,
    ProcessTreeMemory,
    load_average,
    measure_matmul_gflops,
    median_and_spread,
    rl_step_flops,
    write_benchmark_model,
    write_prompt_file,
)

logger = logging.getLogger("bench_rl_step")
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
GRPO_OVERRIDES = ["ppo.disable_value=true", "ppo.adv_estimator=grpo", "ppo.kl_ctl=0"]
PPO_OVERRIDES = ["ppo.adv_estimator=gae", "ppo.kl_ctl=0.1"]
PPO_COMPILED_OVERRIDES = [*PPO_OVERRIDES, "gen.compile=true",
                          *(f"{role}.compile=true" for role in ("actor", "critic", "ref"))]
PIPELINED_OVERRIDES = [*GRPO_OVERRIDES, "gen.compile=true", "actor.compile=true",
                       "pipeline_rollout=true", "n_devices_per_node=2"]
# Each realrl system's overrides; they come last on the command line, so they win.
REALRL_SYSTEMS = {
    "realrl-grpo": GRPO_OVERRIDES,
    "realrl-grpo-compiled": [*GRPO_OVERRIDES, "gen.compile=true", "actor.compile=true"],
    "realrl-grpo-pipelined": PIPELINED_OVERRIDES,
    "realrl-grpo-pipelined-noshare": [*PIPELINED_OVERRIDES, "share_idle_cores=false"],
    "realrl-ppo": PPO_OVERRIDES,
    "realrl-ppo-compiled": PPO_COMPILED_OVERRIDES,
}
REALRL_GRPO = ("realrl-grpo", "realrl-grpo-compiled", "realrl-grpo-pipelined",
               "realrl-grpo-pipelined-noshare")
PIPELINED_SYSTEMS = ("realrl-grpo-pipelined", "realrl-grpo-pipelined-noshare")
REALRL_PPO = ("realrl-ppo", "realrl-ppo-compiled")
ALL_SYSTEMS = (*REALRL_GRPO, "loop", "trl", *REALRL_PPO, "trl-ppo")
# Each realrl system against the baselines doing the same algorithm's work.
BASELINES = {**{system: ("loop", "trl") for system in REALRL_GRPO},
             **{system: ("trl-ppo",) for system in REALRL_PPO}}
PPO_SYSTEMS = (*REALRL_PPO, "trl-ppo")
INFERENCE_MFCS = ("rew_inf", "ref_inf", "critic_inf")
TRAIN_MFCS = ("actor_train", "critic_train")
# Train calls and their forwards sent ahead (`MFCDef.forward_keys`).
TRAIN_TIMINGS = (*TRAIN_MFCS, *(f"{name}/forward" for name in TRAIN_MFCS))
# The systems that run on a GPU (`--device cuda`).
GPU_SYSTEMS = (*REALRL_GRPO, *REALRL_PPO, "trl")
PROMPT_TOKENS = 8  # `write_prompt_file`'s prompts: 3-digit + 3-digit, then "="
# Issue 23's targets on one GPU.
TARGET_SPEEDUP_OVER_TRL = 3.0
TARGET_DECODE_X_FLOOR = 2.0
TARGET_TRAIN_MFU = 0.35


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench",
                        help="Model, prompts, run directories and results go here.")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    parser.add_argument("--modes", default="fixed", help="fixed,natural (comma-separated).")
    parser.add_argument("--precisions", default="float32", help="float32,bfloat16.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="Steps per run, warm-up included.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--realrl-workers", type=int, default=0,
                        help="n_devices_per_node of the realrl runs (model-worker processes); "
                             "0: the launcher's default, what a user gets (one single-threaded "
                             "worker per core on a 2-core machine).")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="Per run.")
    parser.add_argument("--trl-ppo-path", default=None,
                        help="Folder holding TRL 1.12.0 for the trl-ppo baseline (`pip install "
                             "--no-deps --target DIR trl==1.12.0`); default: <work-dir>/trl-1.12.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every system on one GPU (realrl n_devices_per_node=1).")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                        help="bench_setup.MODEL_SIZES: small (3.95M) on CPU, qwen2.5-0.5b on a "
                             "GPU.")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=0,
                        help="Token budget of one forward/backward (realrl's "
                             "<mfc>.max_tokens_per_microbatch, TRL's --micro-batch); 0: none.")
    parser.add_argument("--baseline-omp-wait-policy", default=None,
                        help="OMP_WAIT_POLICY for the loop and TRL (e.g. PASSIVE, what realrl's "
                             "launcher gives its workers); default: inherited, as a user runs them.")
    return parser.parse_args(argv)


def realrl_workers(args) -> int:
    """n_devices_per_node of the realrl runs: on a GPU one worker holding every role."""
    return args.realrl_workers or (1 if args.device == "cuda" else 0)


def microbatch_overrides(args, system: str) -> list[str]:
    """`--max-tokens-per-microbatch` as the token budget of every forward and train MFC."""
    if not args.max_tokens_per_microbatch:
        return []
    mfcs = ["actor_train"] if system in REALRL_GRPO else [
        "actor_train", "critic_train", "ref_inf", "critic_inf"]
    return [f"{mfc}.max_tokens_per_microbatch={args.max_tokens_per_microbatch}" for mfc in mfcs]


def trl_micro_batch(args) -> int:
    """The most completions per TRL forward/backward within the token budget that divide the
    batch's completions (0: the whole batch)."""
    completions = args.batch_size * args.group_size
    if not args.max_tokens_per_microbatch:
        return 0
    fits = max(1, args.max_tokens_per_microbatch // (PROMPT_TOKENS + args.max_new_tokens))
    return max(n for n in range(1, min(fits, completions) + 1) if completions % n == 0)


def realrl_command(args, system: str, mode: str, dtype: str, run_root: Path, trial: str):
    roles = ["actor"] if system in REALRL_GRPO else ["actor", "critic", "ref"]
    return [
        sys.executable, "-m", "realrl.apps.quickstart", "ppo-math",
        f"actor.path={args.model_dir}", f"dataset.path={args.prompt_file}",
        f"dataset.batch_size={args.batch_size}", f"group_size={args.group_size}",
        f"gen.max_new_tokens={args.max_new_tokens}",
        f"gen.min_new_tokens={args.max_new_tokens if mode == 'fixed' else 0}",
        *[f"{role}.dtype={dtype}" for role in roles],
        "actor.optimizer.lr=1e-4", f"n_devices_per_node={realrl_workers(args)}",
        f"total_train_steps={args.steps}", "wandb.mode=disabled", "tensorboard=false",
        f"output_root={run_root}", f"experiment_name={system}", f"trial_name={trial}",
        *microbatch_overrides(args, system),
        *REALRL_SYSTEMS[system],
    ]


def baseline_command(args, system: str, mode: str, dtype: str, output: Path) -> list[str]:
    script = {"loop": "baseline_loop.py", "trl": "trl_grpo.py", "trl-ppo": "trl_ppo.py"}[system]
    command = [sys.executable, str(BENCH_DIR / script), "--model", str(args.model_dir),
               "--prompts", str(args.prompt_file), "--output", str(output),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--group-size", str(args.group_size), "--max-new-tokens",
               str(args.max_new_tokens), "--dtype", dtype, "--threads", str(args.threads)]
    if system == "trl":
        command += ["--device", args.device, "--micro-batch", str(trl_micro_batch(args))]
    return command + (["--fixed-length"] if mode == "fixed" else [])


def realrl_step_rows(metrics_file: Path, num_seqs: int) -> list[dict]:
    rows = []
    for line in metrics_file.read_text().splitlines():
        metrics = json.loads(line)
        timing = {k[len("timing/"):]: v for k, v in metrics.items() if k.startswith("timing/")}
        realloc = sum(v for k, v in timing.items() if k.startswith("realloc/"))
        step = metrics["timing/step_s"]
        # On CUDA the most bytes torch allocated during each call (on CPU a resident set).
        peaks = {k[: -len("/peak_memory_gb")]: v for k, v in metrics.items()
                 if k.endswith("/peak_memory_gb")}
        rows.append({
            "step": metrics["step"], "step_s": step, "generate_s": timing.get("actor_gen", 0.0),
            "inference_s": sum(timing.get(name, 0.0) for name in INFERENCE_MFCS),
            "train_s": sum(timing.get(name, 0.0) for name in TRAIN_TIMINGS),
            # Undefined when calls overlapped (their compute sums to more than the step).
            "other_s": other if (other := step - metrics["perf/compute_s"]) >= 0
            else float("nan"),
            "realloc_s": realloc,
            "generated_tokens": num_seqs * metrics.get("actor_gen/response_length", 0.0),
            "peak_memory_gb": max(peaks.values(), default=None), "peak_memory_gb_by_mfc": peaks,
        })
    return rows


def measured_steps(rows: list[dict], system: str, warmup: int, steps: int) -> list[dict]:
    """The steps a run's speed is measured on: after the warm-up, and for a pipelined run not
    its last step, which trains with no next rollout beside it."""
    last = steps - 1 if system in PIPELINED_SYSTEMS else steps
    return [row for row in rows if warmup < row["step"] <= last]


def run_one(args, system: str, mode: str, dtype: str, repeat: int) -> dict:
    """Run one configuration in a fresh process tree; its measured steps and peak memory."""
    trial = f"{mode}-{dtype}-r{repeat}"
    run_root = args.work_dir / "runs"
    output = args.work_dir / "baselines" / f"{system}-{trial}.jsonl"
    output.parent.mkdir(parents=True, exist_ok=True)
    if system.startswith("realrl"):
        command = realrl_command(args, system, mode, dtype, run_root, trial)
        env = dict(os.environ)
    else:
        command = baseline_command(args, system, mode, dtype, output)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        if args.baseline_omp_wait_policy:
            env["OMP_WAIT_POLICY"] = args.baseline_omp_wait_policy
        if system == "trl-ppo":
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(args.trl_ppo_path), env.get("PYTHONPATH")]))
    log_file = args.work_dir / "logs" / f"{system}-{trial}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log_file, "w") as log, subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) as process:
        with ProcessTreeMemory(process.pid) as memory:
            return_code = process.wait(timeout=args.timeout_s)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    if return_code != 0:
        raise RuntimeError(f"{system} ({trial}) exited with {return_code}; see {log_file}")
    num_seqs = args.batch_size * args.group_size
    if system.startswith("realrl"):
        rows = realrl_step_rows(run_root / system / trial / "metrics.jsonl", num_seqs)
    else:
        rows = [json.loads(line) for line in output.read_text().splitlines()]
    measured = measured_steps(rows, system, args.warmup, args.steps)
    logger.info("%s %s: %s s/step (load %.1f)", system, trial,
                [round(row["step_s"], 2) for row in measured], load_before)
    return {"system": system, "mode": mode, "dtype": dtype, "repeat": repeat,
            "steps": measured, "peak_memory_mib": memory.total_mib,
            "num_processes": len(memory.peak_kib), "wall_s": time.perf_counter() - started,
            "load_average_before": load_before, "cpu_s": cpu_s}


def step_flops(args, system: str, generated_tokens: float) -> float:
    shape = ModelShape.from_config_dir(args.model_dir)
    num_seqs = args.batch_size * args.group_size
    ppo = system in PPO_SYSTEMS
    # PPO: reference and critic forwards; actor and critic trained. Prompts are 8 tokens.
    return rl_step_flops(shape, num_seqs, 8, generated_tokens / num_seqs,
                         num_forward_passes=2 if ppo else 0, num_trained_models=2 if ppo else 1)


def _median_of_known(values: list[float]) -> float:
    """The median of the values that are not NaN (NaN: none is known)."""
    known = [value for value in values if value == value]
    return statistics.median(known) if known else float("nan")


def summarise(args, runs: list[dict], ceilings: dict[str, float]) -> list[dict]:
    summaries = []
    num_seqs = args.batch_size * args.group_size
    keys = sorted({(r["mode"], r["dtype"], r["system"]) for r in runs},
                  key=lambda k: (k[0], k[1], ALL_SYSTEMS.index(k[2])))
    for mode, dtype, system in keys:
        group = [r for r in runs if (r["mode"], r["dtype"], r["system"]) == (mode, dtype, system)]
        steps = [s for r in group for s in r["steps"]]
        per_run = [statistics.median(s["step_s"] for s in r["steps"]) for r in group if r["steps"]]
        parts = {part: _median_of_known([s.get(part, float("nan")) for s in steps])
                 for part in ("generate_s", "inference_s", "train_s", "other_s", "realloc_s")}
        tokens = statistics.median(s.get("generated_tokens", float("nan")) for s in steps)
        # Natural-length runs stop at EOS: the mean response length says whether two systems'
        # step times cover the same work.
        response_length = statistics.mean(
            s.get("generated_tokens", float("nan")) for s in steps) / num_seqs
        step_s = statistics.median(per_run)
        # Medians keep the machine's noise out of the ratios; the mean also counts rare slow
        # steps (a late recompile, a garbage collection), which a user's wall clock does.
        mean_step_s = statistics.mean(s["step_s"] for s in steps)
        flops_per_s = step_flops(args, system, tokens) / step_s if tokens == tokens else None
        peaks = [s["peak_memory_gb"] for s in steps if s.get("peak_memory_gb") is not None]
        gpu = gpu_columns(args, system, mode, dtype, parts, ceilings) if args.device == "cuda" \
            else {}
        summaries.append({
            "system": system, "mode": mode, "dtype": dtype,
            "step_s": median_and_spread(per_run), "mean_step_s": mean_step_s, **parts,
            "response_length": response_length,
            "other_fraction": parts["other_s"] / step_s if system.startswith("realrl") else None,
            "generated_tokens_per_s": tokens / parts["generate_s"] if tokens == tokens else None,
            "model_gflops_per_s": flops_per_s / 1e9 if flops_per_s else None,
            "fraction_of_ceiling": flops_per_s / 1e9 / ceilings[dtype] if flops_per_s else None,
            "peak_memory_mib": statistics.median(r["peak_memory_mib"] for r in group),
            "run_cpu_s": statistics.median(r["cpu_s"] for r in group),
            "load_average": statistics.median(r["load_average_before"] for r in group),
            "run_wall_s": statistics.median(r["wall_s"] for r in group),
            "peak_gpu_memory_gb": max(peaks) if args.device == "cuda" and peaks else None,
            **gpu,
        })
    return summaries


def gpu_columns(args, system: str, mode: str, dtype: str, parts: dict,
                ceilings: dict[str, float]) -> dict:
    """Decode step time against its floor and training MFU (`--device cuda`); None where the
    system's steps are not split by call (TRL) or, for decode, responses are not forced to
    one length."""
    from bench_gpu_generation import decode_floor_s

    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    shape = ModelShape.from_config_dir(args.model_dir)
    num_seqs = args.batch_size * args.group_size
    seq_len = PROMPT_TOKENS + args.max_new_tokens
    rates = {"bandwidth_bytes_per_s": ceilings["bandwidth_gb_per_s"] * 1e9,
             "bf16_flops_per_s": ceilings["bfloat16"] * 1e9}
    floor_s = decode_floor_s(config, shape.matmul_params, num_seqs,
                             PROMPT_TOKENS + args.max_new_tokens / 2, rates)
    generate_s, train_s = parts["generate_s"], parts["train_s"]
    decode_s = (generate_s / args.max_new_tokens
                if mode == "fixed" and generate_s == generate_s and generate_s > 0 else None)
    # Forward and backward of the actor and, in PPO, of the critic: the same trunk with a
    # one-output value head in place of the LM head.
    actor_flops = 3.0 * shape.forward_flops(num_seqs * seq_len, seq_len / 2)
    lm_head_flops = 3.0 * 2.0 * config["hidden_size"] * config["vocab_size"] * num_seqs * seq_len
    train_flops = actor_flops + (actor_flops - lm_head_flops if system in PPO_SYSTEMS else 0.0)
    mfu = (train_flops / train_s / (ceilings[dtype] * 1e9)
           if train_s == train_s and train_s > 0 else None)
    return {"decode_ms_per_step": decode_s * 1e3 if decode_s else None,
            "decode_floor_ms": floor_s * 1e3,
            "decode_x_floor": decode_s / floor_s if decode_s else None,
            "train_mfu": mfu}


def format_gpu_table(summaries: list[dict]) -> str:
    def number(value, digits=2):
        return "-" if value is None or value != value else f"{value:.{digits}f}"

    lines = ["| mode | dtype | system | s/step | gen s | train s | gen tok/s | decode ms/step | "
             "floor ms | x floor | train MFU | peak GPU GB |", "|" + "---|" * 12]
    for s in summaries:
        mfu = s.get("train_mfu")
        lines.append(
            f"| {s['mode']} | {s['dtype']} | {s['system']} | {number(s['step_s']['median'])} | "
            f"{number(s['generate_s'])} | {number(s['train_s'])} | "
            f"{number(s['generated_tokens_per_s'], 0)} | {number(s.get('decode_ms_per_step'))}"
            f" | {number(s.get('decode_floor_ms'))} | {number(s.get('decode_x_floor'), 1)} | "
            f"{number(100 * mfu if mfu is not None else None, 1)}% | "
            f"{number(s.get('peak_gpu_memory_gb'), 1)} |")
    return "\n".join(lines)


def gpu_targets(summaries: list[dict], num_seqs: int) -> list[str]:
    """Issue 23's targets against the measured summaries: realrl's GRPO step against TRL's,
    decode against its floor at this batch, training MFU."""
    lines = []
    by_key = {(s["mode"], s["dtype"], s["system"]): s for s in summaries}
    for (mode, dtype, system), s in sorted(by_key.items()):
        trl = by_key.get((mode, dtype, "trl"))
        if system in REALRL_GRPO and trl is not None:
            ratio = trl["step_s"]["median"] / s["step_s"]["median"]
            lines.append(f"{mode} {dtype} {system}: step {ratio:.2f}x TRL's (target >= "
                         f"{TARGET_SPEEDUP_OVER_TRL:.0f}x: "
                         f"{'met' if ratio >= TARGET_SPEEDUP_OVER_TRL else 'not met'})")
        if s.get("decode_x_floor") is not None:
            x = s["decode_x_floor"]
            lines.append(f"{mode} {dtype} {system}: decode {x:.1f}x its floor at batch {num_seqs}"
                         f" (target <= {TARGET_DECODE_X_FLOOR:.0f}x: "
                         f"{'met' if x <= TARGET_DECODE_X_FLOOR else 'not met'})")
        if s.get("train_mfu") is not None:
            mfu = s["train_mfu"]
            lines.append(f"{mode} {dtype} {system}: training MFU {100 * mfu:.1f}% (target > "
                         f"{100 * TARGET_TRAIN_MFU:.0f}%: "
                         f"{'met' if mfu > TARGET_TRAIN_MFU else 'not met'})")
    return lines


def machine_info(device: str) -> dict:
    """What the numbers were measured on: the GPU, its driver and torch's CUDA, or the CPU."""
    info = {"torch": torch.__version__, "cpus": os.cpu_count()}
    if device == "cuda":
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False).stdout.strip()
        info |= {"gpu": torch.cuda.get_device_name(), "driver": driver,
                 "cuda": torch.version.cuda}
    return info


def measure_ceilings(args) -> dict[str, float]:
    """Matmul GFLOP/s per dtype on `--device` (and on CUDA the copy bandwidth, GB/s)."""
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        return {"float32": measure_matmul_gflops(torch.float32),
                "bfloat16": measure_matmul_gflops(torch.bfloat16)}
    from bench_gpu_generation import measured_ceilings

    gpu = measured_ceilings()
    ceilings = {"float32": measure_matmul_gflops(torch.float32, 8192, 2.0, "cuda"),
                "bfloat16": gpu["bf16_flops_per_s"] / 1e9,
                "bandwidth_gb_per_s": gpu["bandwidth_bytes_per_s"] / 1e9}
    torch.cuda.empty_cache()  # the runs are other processes: give them the memory
    return ceilings


def format_table(summaries: list[dict]) -> str:
    def number(value, digits=2):
        return "-" if value is None or value != value else f"{value:.{digits}f}"

    lines = ["| mode | dtype | system | s/step (min-max) | mean | gen | inf | train | other | "
             "other % | resp len | gen tok/s | GFLOP/s (% ceil) | peak MiB | run wall/CPU s "
             "| load |",
             "|" + "---|" * 16]
    for s in summaries:
        spread = s["step_s"]
        lines.append(
            f"| {s['mode']} | {s['dtype']} | {s['system']} | {number(spread['median'])} "
            f"({number(spread['min'])}-{number(spread['max'])}, n={spread['n']}) | "
            f"{number(s['mean_step_s'])} | "
            f"{number(s['generate_s'])} | {number(s['inference_s'])} | {number(s['train_s'])} | "
            f"{number(s['other_s'])} | "
            f"{number(100 * s['other_fraction'] if s['other_fraction'] is not None else None, 1)}"
            f" | {number(s['response_length'], 1)} | {number(s['generated_tokens_per_s'], 0)}"
            f" | {number(s['model_gflops_per_s'], 1)}"
            f" ({number(100 * (s['fraction_of_ceiling'] or float('nan')), 1)}%) | "
            f"{number(s['peak_memory_mib'], 0)} | {number(s['run_wall_s'], 0)}/"
            f"{number(s['run_cpu_s'], 0)} | {number(s['load_average'], 1)} |")
    return "\n".join(lines)


def speedups(runs: list[dict]) -> list[str]:
    """Each realrl system's speed-up over each baseline of its algorithm (`BASELINES`): the
    median over repeats of the ratio of the two systems' median step times within one repeat
    (runs of a repeat are minutes apart, so they share the machine's load better than runs of
    different repeats)."""
    step_s = {(r["mode"], r["dtype"], r["system"], r["repeat"]): statistics.median(
        s["step_s"] for s in r["steps"]) for r in runs if r["steps"]}
    lines = []
    for mode, dtype, system in sorted({key[:3] for key in step_s}):
        for ours in (ours for ours, baselines in BASELINES.items() if system in baselines):
            ratios = [seconds / step_s[(mode, dtype, ours, repeat)]
                      for (m, d, s, repeat), seconds in step_s.items()
                      if (m, d, s) == (mode, dtype, system)
                      and (mode, dtype, ours, repeat) in step_s]
            if ratios:
                lines.append(f"{mode} {dtype}: {ours} is {statistics.median(ratios):.2f}x faster "
                             f"than {system} (per-repeat ratios {[round(r, 2) for r in ratios]})")
    return lines


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    args.work_dir = Path(args.work_dir).resolve()
    systems = [s for s in args.systems.split(",") if s]
    if args.device == "cuda" and (cpu_only := [s for s in systems if s not in GPU_SYSTEMS]):
        raise SystemExit(f"--device cuda runs {', '.join(GPU_SYSTEMS)}; {', '.join(cpu_only)} "
                         "run on CPU only: leave them out of --systems")
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        logger.warning("trl is not installed: skipping the TRL baseline")
        systems.remove("trl")
    args.trl_ppo_path = Path(args.trl_ppo_path or args.work_dir / "trl-1.12").resolve()
    if "trl-ppo" in systems and not (args.trl_ppo_path / "trl/experimental/ppo").is_dir():
        logger.warning("no TRL with a PPO trainer in %s (pip install --no-deps --target %s "
                       "trl==1.12.0): skipping the trl-ppo baseline",
                       args.trl_ppo_path, args.trl_ppo_path)
        systems.remove("trl-ppo")
    args.model_dir = write_benchmark_model(args.work_dir / f"model-{args.model_size}",
                                           args.model_size)
    args.prompt_file = write_prompt_file(args.work_dir / "prompts.jsonl")
    ceilings = measure_ceilings(args)
    logger.info("matmul ceiling on %s: %.0f GFLOP/s fp32, %.0f GFLOP/s bf16", args.device,
                ceilings["float32"], ceilings["bfloat16"])
    runs = []
    for repeat in range(args.repeats):
        for mode in args.modes.split(","):
            for dtype in args.precisions.split(","):
                for system in systems:
                    runs.append(run_one(args, system, mode, dtype, repeat))
    summaries = summarise(args, runs, ceilings)
    result = {"ceilings_gflops": ceilings, "threads": args.threads, "summaries": summaries,
              "runs": runs, "argv": sys.argv[1:], "machine": machine_info(args.device)}
    if args.device == "cuda":
        result["targets"] = gpu_targets(summaries, args.batch_size * args.group_size)
    (args.work_dir / "results.json").write_text(json.dumps(result, indent=1))
    sys.stdout.write(format_table(summaries) + "\n\n" + "\n".join(speedups(runs)) + "\n")
    if args.device == "cuda":
        sys.stdout.write("\n" + format_gpu_table(summaries) + "\n\n"
                         + "\n".join(result["targets"]) + "\n")
    sys.stdout.write(f"matmul ceiling: {ceilings['float32']:.0f} GFLOP/s fp32, "
                     f"{ceilings['bfloat16']:.0f} GFLOP/s bf16; results in "
                     f"{args.work_dir / 'results.json'}\n")


if __name__ == "__main__":
    main()
