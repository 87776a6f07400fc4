"""How much of a realrl step is spent outside model compute, and what reallocation costs.

Issue 4's runtime benchmark. For each model size and allocation it runs full-PPO `ppo-math`
(actor, critic, reference, rule reward) for `--steps` steps through the real CLI on
`--workers` model workers and reads `metrics.jsonl`:

- `perf/overhead_fraction` = 1 - (sum over MFCs of the slowest worker's compute seconds) /
  step seconds: the share of the step spent in transport, splitting, merging, reallocation and
  master bookkeeping;
- `timing/realloc/<mfc>`: seconds of the parameter-reallocation pre-hook before `<mfc>`
  (e.g. moving the actor's newest weights from `actor_train`'s d1 layout to `actor_gen`'s d2).

Layouts: `d2` (every MFC on both workers: nothing to reallocate) and
`actor_gen:d2,actor_train:d1@0,*:d2` (generation and training on different layouts, so the
actor's weights move every step). Sizes: `tiny` (realrl's built-in default model, 0.8M parameters,
fresh weights), `small` (3.95M) and `medium` (15.8M), from `bench_setup.py`. Step 1 is
warm-up (first-touch allocations, the reward verifier starting), so the report uses later steps.

    .venv/bin/python benchmarks/bench_overhead.py --steps 3
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import (  # noqa: E402
    ModelShape,
    run_quickstart,
    write_benchmark_model,
    write_prompt_file,
)

logger = logging.getLogger("bench_overhead")
LAYOUTS = {"d2": "d2", "split": "actor_gen:d2,actor_train:d1@0,*:d2"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench-overhead")
    parser.add_argument("--sizes", default="tiny,small,medium")
    parser.add_argument("--layouts", default="d2,split")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    return parser.parse_args(argv)


def model_dir(work_dir: Path, size: str) -> Path:
    if size == "tiny":
        from realrl.launcher.defaults import fresh_default_model

        return fresh_default_model(work_dir / "model-tiny")
    return write_benchmark_model(work_dir / f"model-{size}", size)


def run_one(args, size: str, layout: str) -> list[dict]:
    trial = f"{size}-{layout}"
    overrides = [
        f"actor.path={model_dir(args.work_dir, size)}", f"dataset.path={args.prompt_file}",
        "dataset.batch_size=8", "group_size=4", f"gen.max_new_tokens={args.max_new_tokens}",
        f"n_devices_per_node={args.workers}", f"allocation_mode={LAYOUTS[layout]}",
        f"total_train_steps={args.steps}", "wandb.mode=disabled", "tensorboard=false",
        f"output_root={args.work_dir / 'runs'}", "experiment_name=overhead",
        f"trial_name={trial}",
    ]
    return run_quickstart("ppo-math", overrides, args.work_dir / "runs" / "overhead" / trial,
                          args.work_dir / "logs" / f"{trial}.log", args.timeout_s)


def summarise(size: str, layout: str, steps: list[dict], num_params: int) -> dict:
    measured = steps[1:] or steps
    realloc = [sum(v for k, v in s.items() if k.startswith("timing/realloc/")) for s in measured]
    step_s = [s["timing/step_s"] for s in measured]
    other_s = [s["timing/step_s"] - s["perf/compute_s"] for s in measured]
    return {
        "size": size, "layout": layout, "matmul_params": num_params,
        "step_s": statistics.median(step_s), "other_s": statistics.median(other_s),
        "overhead_fraction": statistics.median(s["perf/overhead_fraction"] for s in measured),
        "first_step_overhead_fraction": steps[0]["perf/overhead_fraction"],
        "realloc_s": statistics.median(realloc),
        "realloc_keys": sorted({k for s in measured for k in s if k.startswith("timing/realloc/")}),
    }


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    args.work_dir = Path(args.work_dir).resolve()
    args.prompt_file = write_prompt_file(args.work_dir / "prompts.jsonl")
    results = []
    for size in args.sizes.split(","):
        num_params = ModelShape.from_config_dir(model_dir(args.work_dir, size)).matmul_params
        for layout in args.layouts.split(","):
            summary = summarise(size, layout, run_one(args, size, layout), num_params)
            logger.info("%s", summary)
            results.append(summary)
    (args.work_dir / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| size | matmul params | layout | s/step | other s | overhead % | realloc s |",
             "|" + "---|" * 7]
    for r in results:
        lines.append(f"| {r['size']} | {r['matmul_params'] / 1e6:.2f}M | {LAYOUTS[r['layout']]} "
                     f"| {r['step_s']:.2f} | {r['other_s']:.3f} | "
                     f"{100 * r['overhead_fraction']:.1f} | {r['realloc_s']:.3f} |")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
