"""megatron-core tensor-parallel layers against realrl's own (deleted) ones, t2 on 2 gloo ranks.

The same model (the `bench_setup.py` "small" shape, Qwen2, tied embeddings, at each
`--vocab-sizes`), the same weights and the same packed batch (8 prompts x 4 samples x 40
tokens, the RL step's training batch: each prompt's samples share its first 8 tokens) run as
t2 under two implementations:

- `own`: realrl at `--baseline-rev` (default 25a1ffb, the last commit with realrl's own
  column/row-parallel layers), extracted with `git archive` into `<work-dir>/realrl-<rev>`.
  Its LM head gathers [tokens, vocab] logits; log-probs and entropies are taken from them;
- `megatron`: this checkout. megatron-core's layers; log-probs and entropies are read off the
  hidden states by the fused LM head (`realrl.models.lm_head`, each rank's vocabulary slice,
  chunk by chunk) and reduced over the tp group.

Timed per iteration (after a barrier; the slower rank counts): `train`, the PPO actor's work:
forward, log-probs and entropies, backward; `inference`, a reference model's work: no-grad
forward and log-probs. Each (implementation, repeat) runs in fresh processes, alternating, so
background load affects both alike; the ratio megatron / own of the medians is printed at the
end. Both implementations build the shard with `realrl.workers.model_loading.shard_module`,
whose signature is the same at both revisions. The first iteration's log-probs of both are
compared (they must agree to float rounding).

Two more sections (`--sections`): `import`, the seconds a fresh process spends importing a
model worker's modules, with and without `realrl.models.megatron_layers` (megatron-core);
`ppo-math`, the default 2-worker `ppo-math` run (no tensor parallelism) at both revisions,
`--ppo-math-steps` steps, alternating: the median `timing/step_s` (first step dropped) and the
run's wall time.

    .venv/bin/python benchmarks/bench_tensor_parallel.py --repeats 3      # ~15 min
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE_REV = "25a1ffb"
IMPLEMENTATIONS = ("own", "megatron")
SMALL_SHAPE = dict(  # bench_setup.MODEL_SIZES["small"]
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench-tp")
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE_REV)
    parser.add_argument("--vocab-sizes", default="512,32768")
    parser.add_argument("--repeats", type=int, default=3, help="Fresh process pairs per side.")
    parser.add_argument("--iterations", type=int, default=8, help="Timed iterations per run.")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--sections", default="layers,import,ppo-math")
    parser.add_argument("--import-repeats", type=int, default=5)
    parser.add_argument("--ppo-math-steps", type=int, default=100)
    # One run of one implementation (internal: the parent starts these).
    parser.add_argument("--run", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- one run (2 ranks)


def packed_batch(args, vocab_size: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    sequences = []
    for _ in range(args.num_prompts):
        prompt = torch.randint(0, vocab_size, (args.prompt_len,), generator=generator)
        for _ in range(args.samples_per_prompt):
            response = torch.randint(
                0, vocab_size, (args.seq_len - args.prompt_len,), generator=generator
            )
            sequences.append(torch.cat([prompt, response]))
    cu_seqlens = torch.arange(0, len(sequences) * args.seq_len + 1, args.seq_len)
    return torch.cat(sequences), cu_seqlens.int()  # [total_tokens], [num_seqs + 1]


def model_output(model, packed_input_ids, cu_seqlens):
    """The forward the interfaces run at either revision: hidden states here (the engine's
    `apply_lm_head=False`), gathered logits at the baseline."""
    if hasattr(model, "shifted_logprobs_and_entropy"):
        return model(packed_input_ids, cu_seqlens, apply_lm_head=False)
    return model(packed_input_ids, cu_seqlens)


def log_probs_and_entropy(model, output, packed_input_ids, cu_seqlens, with_entropy: bool):
    """The interfaces' read-out at either revision: the fused head of
    `Transformer.shifted_logprobs(_and_entropy)` here, the `realrl.algo.layout` functions on
    gathered logits at the baseline."""
    if hasattr(model, "shifted_logprobs_and_entropy"):
        if with_entropy:
            return model.shifted_logprobs_and_entropy(output, packed_input_ids, cu_seqlens)
        return model.shifted_logprobs(output, packed_input_ids, cu_seqlens), None
    from realrl.algo.layout import packed_entropy, packed_shifted_logprobs

    logprobs = packed_shifted_logprobs(output, packed_input_ids, cu_seqlens)
    entropy = packed_entropy(output, cu_seqlens) if with_entropy else None
    return logprobs, entropy


def rank_main(rank: int, args, init_file: str) -> None:
    import torch
    import torch.distributed as dist

    from realrl.backends.torch_engine import ParallelContext
    from realrl.models.config import ModelConfig
    from realrl.models.transformer import Transformer
    from realrl.workers.model_loading import shard_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    config = ModelConfig(
        vocab_size=args.vocab_size,
        tie_word_embeddings=True,
        model_type="qwen2",
        qkv_bias=True,
        **SMALL_SHAPE,
    )
    torch.manual_seed(0)
    full = Transformer(config)
    with torch.no_grad():
        for parameter in full.parameters():
            parameter.normal_(0.0, 0.02)
    model = shard_module(full, ParallelContext(tp_rank=rank, tp_size=2, tp_group=group))
    del full
    packed_input_ids, cu_seqlens = packed_batch(args, args.vocab_size)

    def train():
        model.zero_grad(set_to_none=True)
        output = model_output(model, packed_input_ids, cu_seqlens)
        logprobs, entropy = log_probs_and_entropy(model, output, packed_input_ids, cu_seqlens, True)
        (-logprobs.mean() - 0.01 * entropy.mean()).backward()
        return logprobs

    def inference():
        with torch.no_grad():
            output = model_output(model, packed_input_ids, cu_seqlens)
            return log_probs_and_entropy(model, output, packed_input_ids, cu_seqlens, False)[0]

    times: dict[str, list[float]] = {"train": [], "inference": []}
    first_logprobs = inference()
    for iteration in range(args.warmup + args.iterations):
        for name, work in (("train", train), ("inference", inference)):
            dist.barrier(group)
            started = time.perf_counter()
            work()
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if iteration >= args.warmup:
                times[name].append(float(elapsed))
    peak_rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        result = {
            "times_s": times,
            "peak_rss_mib": float(peak_rss),
            "logprobs": first_logprobs.tolist(),
        }
        Path(args.result_file).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_one(args) -> None:
    import torch.multiprocessing as mp

    init_file = args.result_file + ".init"
    if os.path.exists(init_file):
        os.remove(init_file)
    mp.start_processes(rank_main, args=(args, init_file), nprocs=2, start_method="spawn")


# ---------------------------------------------------------------- the comparison


def baseline_tree(work_dir: Path, rev: str) -> Path:
    """realrl at `rev`, extracted once into `work_dir`."""
    target = work_dir / f"realrl-{rev}"
    if not (target / "realrl").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "realrl"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def launch(args, implementation: str, vocab_size: int, tree: Path, result_file: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run",
        implementation,
        "--vocab-size",
        str(vocab_size),
        "--result-file",
        str(result_file),
        "--iterations",
        str(args.iterations),
        "--warmup",
        str(args.warmup),
        "--num-prompts",
        str(args.num_prompts),
        "--samples-per-prompt",
        str(args.samples_per_prompt),
        "--seq-len",
        str(args.seq_len),
        "--prompt-len",
        str(args.prompt_len),
    ]
    # cwd outside both trees: `sys.path` must find realrl only through PYTHONPATH.
    subprocess.run(command, env=env, cwd=tree.parent, check=True)
    return json.loads(result_file.read_text())


def compare_layers(args, trees: dict[str, Path]) -> dict:
    work_dir = Path(args.work_dir)
    report: dict = {}
    for vocab_size in [int(v) for v in args.vocab_sizes.split(",")]:
        runs: dict[str, list[dict]] = {name: [] for name in IMPLEMENTATIONS}
        for repeat in range(args.repeats):
            for name in IMPLEMENTATIONS:
                result_file = work_dir / f"{name}-v{vocab_size}-r{repeat}.json"
                runs[name].append(launch(args, name, vocab_size, trees[name], result_file))
                print(f"vocab {vocab_size} repeat {repeat} {name}: done", flush=True)
        report[vocab_size] = summarise(runs)
    return report


def summarise(runs: dict[str, list[dict]]) -> dict:
    summary: dict = {}
    for name, results in runs.items():
        summary[name] = {
            work: statistics.median(t for r in results for t in r["times_s"][work])
            for work in ("train", "inference")
        }
        summary[name]["peak_rss_mib"] = max(r["peak_rss_mib"] for r in results)
    summary["ratio"] = {
        work: summary["megatron"][work] / summary["own"][work] for work in ("train", "inference")
    }
    own, new = runs["own"][0]["logprobs"], runs["megatron"][0]["logprobs"]
    summary["max_logprob_difference"] = max(abs(a - b) for a, b in zip(own, new, strict=True))
    return summary


IMPORTS = {
    "model worker": "import realrl.workers.model_worker",
    "model worker + megatron-core": "import realrl.workers.model_worker, "
    "realrl.models.megatron_layers",
}


def compare_imports(args) -> dict:
    """Median wall seconds of each import line in a fresh process (after `import torch`)."""
    times: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(args.import_repeats):
        for name, line in IMPORTS.items():
            code = (
                "import time, torch; started = time.perf_counter(); "
                f"{line}; print(time.perf_counter() - started)"
            )
            output = subprocess.run(
                [sys.executable, "-W", "ignore", "-c", code],
                env={**os.environ, "PYTHONPATH": str(REPO)},
                cwd=REPO.parent,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            times[name].append(float(output.split()[-1]))
    return {name: statistics.median(values) for name, values in times.items()}


def compare_ppo_math(args, trees: dict[str, Path]) -> dict:
    """The default 2-worker ppo-math run at both revisions, alternating in ABBA order (a run
    that follows another may inherit its exit's load). `cpu_s`: user + system seconds of the
    whole process tree, which background load changes less than wall time."""
    runs: dict[str, list[dict]] = {name: [] for name in IMPLEMENTATIONS}
    for repeat in range(args.repeats):
        for name in IMPLEMENTATIONS[:: 1 if repeat % 2 == 0 else -1]:
            output_root = Path(args.work_dir) / f"ppo-math-{name}-r{repeat}"
            command = [
                sys.executable,
                "-m",
                "realrl.apps.quickstart",
                "ppo-math",
                f"total_train_steps={args.ppo_math_steps}",
                f"output_root={output_root}",
                "wandb.mode=disabled",
                "tensorboard=false",
            ]
            env = {**os.environ, "PYTHONPATH": str(trees[name])}
            started, cpu_before = time.perf_counter(), children_cpu_s()
            subprocess.run(
                command, env=env, cwd=trees[name].parent, check=True, capture_output=True
            )
            wall_s, cpu_s = time.perf_counter() - started, children_cpu_s() - cpu_before
            metrics = output_root / "ppo-math" / "trial0" / "metrics.jsonl"
            steps = [json.loads(line)["timing/step_s"] for line in metrics.read_text().splitlines()]
            runs[name].append(
                {"step_s": statistics.median(steps[1:]), "wall_s": wall_s, "cpu_s": cpu_s}
            )
            print(f"ppo-math repeat {repeat} {name}: {runs[name][-1]}", flush=True)
    summary = {
        name: {
            key: statistics.median(r[key] for r in results) for key in ("step_s", "wall_s", "cpu_s")
        }
        | {"per_run": results}
        for name, results in runs.items()
    }
    # Runs next to each other share the machine's background load: compare them pairwise.
    summary["paired_step_ratio"] = statistics.median(
        new["step_s"] / own["step_s"] for own, new in zip(runs["own"], runs["megatron"])
    )
    return summary


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compare(args) -> dict:
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    trees = {"own": baseline_tree(work_dir, args.baseline_rev), "megatron": REPO}
    sections = args.sections.split(",")
    report: dict = {"baseline_rev": args.baseline_rev}
    if "layers" in sections:
        report["layers"] = compare_layers(args, trees)
    if "import" in sections:
        report["import_s"] = compare_imports(args)
    if "ppo-math" in sections:
        report["ppo_math"] = compare_ppo_math(args, trees)
    return report


def print_table(report: dict) -> None:
    print(f"\nbaseline (own layers): {report['baseline_rev']}")
    if "layers" in report:
        print_layers(report["layers"])
    for name, seconds in report.get("import_s", {}).items():
        print(f"import, {name}: {seconds:.2f} s (median, fresh process, after torch)")
    ppo_math = report.get("ppo_math", {})
    for name in IMPLEMENTATIONS if ppo_math else ():
        print(
            f"ppo-math, {name}: median step {1e3 * ppo_math[name]['step_s']:.0f} ms, "
            f"median run wall {ppo_math[name]['wall_s']:.1f} s, "
            f"CPU {ppo_math[name]['cpu_s']:.1f} s"
        )
    if ppo_math:
        print(f"ppo-math, median of paired step ratios: {ppo_math['paired_step_ratio']:.2f}")


def print_layers(layers: dict) -> None:
    print("t2 on 2 gloo ranks, 1 thread each")
    print(f"{'vocab':>6} {'work':>10} {'own ms':>8} {'megatron ms':>12} {'ratio':>6}")
    for vocab_size, summary in layers.items():
        for work in ("train", "inference"):
            print(
                f"{vocab_size:>6} {work:>10} {1e3 * summary['own'][work]:>8.1f} "
                f"{1e3 * summary['megatron'][work]:>12.1f} {summary['ratio'][work]:>6.2f}"
            )
        print(
            f"{vocab_size:>6} {'peak RSS':>10} {summary['own']['peak_rss_mib']:>7.0f}M "
            f"{summary['megatron']['peak_rss_mib']:>11.0f}M   max |dlogprob| "
            f"{summary['max_logprob_difference']:.1e}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        run_one(args)
        return
    report = compare(args)
    (Path(args.work_dir) / "results.json").write_text(json.dumps(report, indent=2))
    print_table(report)


if __name__ == "__main__":
    main()
