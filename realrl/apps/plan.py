"""Explore execution plans for a hypothetical cluster (no GPU, no model, no torch needed).

    python -m realrl.apps.plan --device h100 --n-nodes 2 --actor 7b --critic 7b
    python -m realrl.apps.plan --device h100 --table --sizes 7b,13b,34b,70b --gpus 16,32,64,128

The first prints the best plans for PPO on 2 nodes of 8 H100s, with each MFC's timeline and
memory and why the runner-up lost; the second the cluster-scale table of docs/plan_search.md
(searched plan against the symmetric layout). `allocation_mode=search` runs the same search
for a real run (`realrl.plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TextIO

from realrl.plan.costs import Cluster
from realrl.plan.devices import GIB, analytic_device, cpu_device
from realrl.plan.presets import MODEL_SHAPES, RLWorkload, rl_graph
from realrl.plan.report import describe
from realrl.plan.search import SearchProblem, SearchResult, search


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m realrl.apps.plan",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100", help="h100 | h200 | a100 | cpu (measured)")
    parser.add_argument("--n-nodes", type=int, default=2)
    parser.add_argument("--n-devices-per-node", type=int, default=8)
    parser.add_argument("--algorithm", default="ppo", help="ppo | grpo")
    sizes = ", ".join(MODEL_SHAPES)
    parser.add_argument("--actor", default="7b", help=f"actor (and reference) size: {sizes}")
    parser.add_argument("--critic", default="7b", help="critic and reward model size (PPO)")
    parser.add_argument("--prompts", type=int, default=512, help="prompts per step")
    parser.add_argument("--responses-per-prompt", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--generated-tokens", type=int, default=384)
    parser.add_argument("--ppo-minibatches", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32")
    parser.add_argument("--backend", default="megatron", choices=("megatron", "torch"),
                        help="megatron: pipeline parallelism and the distributed optimizer "
                        "allowed; torch: neither (realrl's torch backend)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="usable memory per device (default: the device's)")
    parser.add_argument("--time-budget-s", type=float, default=3.0)
    parser.add_argument("--show", type=int, default=3, help="plans to print")
    parser.add_argument("--table", action="store_true",
                        help="one line per size and cluster: searched vs symmetric")
    parser.add_argument("--sizes", default="7b,13b,34b,70b", help="--table: actor=critic sizes")
    parser.add_argument("--gpus", default="16,32,64,128", help="--table: device counts")
    return parser.parse_args(argv)


def build_problem(args: argparse.Namespace, actor: str, critic: str,
                  n_nodes: int) -> SearchProblem:
    if args.device == "cpu":
        device = cpu_device(1, (args.memory_gb or 4.0) * GIB)
    else:
        device = analytic_device(args.device)
    if args.memory_gb is not None:
        device = dataclasses.replace(device, memory_bytes=args.memory_gb * GIB)
    workload = RLWorkload(args.algorithm, actor, critic, args.prompts,
                          args.responses_per_prompt, args.prompt_tokens, args.generated_tokens,
                          args.ppo_minibatches, args.dtype)
    works, dependencies = rl_graph(workload)
    megatron = args.backend == "megatron"
    return SearchProblem(works, dependencies, Cluster(n_nodes, args.n_devices_per_node, device),
                         allow_pipeline=megatron, shard_optimizer=megatron)


def _tokens_per_s(args: argparse.Namespace, step_seconds: float) -> float:
    tokens = args.prompts * args.responses_per_prompt * (args.prompt_tokens
                                                         + args.generated_tokens)
    return tokens / step_seconds


def table_row(args: argparse.Namespace, size: str, gpus: int, result: SearchResult) -> str:
    best = result.plans[0]
    symmetric = result.symmetric
    layouts = ", ".join(f"{name} {layout.strategy}x{layout.mesh.size}"
                        for name, layout in best.layouts.items())
    if symmetric is None:
        sym_text, speedup = "does not fit", "-"
    else:
        sym_text = f"{symmetric.step_seconds:.2f}"
        speedup = f"{symmetric.step_seconds / best.step_seconds:.2f}x"
    return (f"| {size}+{size} | {gpus} | {sym_text} | {best.step_seconds:.2f} | {speedup} | "
            f"{_tokens_per_s(args, best.step_seconds):,.0f} | {layouts} |")


def print_table(args: argparse.Namespace, out: TextIO) -> None:
    out.write("| actor+critic | GPUs | symmetric s/step | searched s/step | speed-up | "
              "tokens/s | searched plan (layout x devices) |\n|---|---|---|---|---|---|---|\n")
    for size in args.sizes.split(","):
        for gpus in (int(text) for text in args.gpus.split(",")):
            n_nodes = max(1, gpus // args.n_devices_per_node)
            try:
                result = search(build_problem(args, size, size, n_nodes),
                                time_budget_s=args.time_budget_s)
            except ValueError:
                out.write(f"| {size}+{size} | {gpus} | does not fit | does not fit | - | - | - |\n")
                continue
            out.write(table_row(args, size, gpus, result) + "\n")
            out.flush()


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = parse_arguments(argv)
    try:
        if args.table:
            print_table(args, out)
            return 0
        problem = build_problem(args, args.actor, args.critic, args.n_nodes)
        result = search(problem, time_budget_s=args.time_budget_s)
    except (KeyError, ValueError) as error:
        sys.stderr.write(f"error: {error.args[0] if error.args else error}\n")
        return 2
    out.write(describe(problem, result, show=args.show) + "\n")
    out.write(f"predicted throughput: {_tokens_per_s(args, result.plans[0].step_seconds):,.0f} "
              "tokens/s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
