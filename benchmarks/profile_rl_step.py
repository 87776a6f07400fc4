"""Profile realrl's actor MFCs in one process on the issue-8 workload (no CLI, no workers).

Builds the `bench_setup.py` model as a `TorchEngine` and calls the PPO actor and reference
interfaces directly, the way `tests/interfaces/conftest.py` does, so that cProfile or
torch.profiler see only the model work of ``actor_gen``, ``ref_inf`` and ``actor_train``:

    .venv/bin/python benchmarks/profile_rl_step.py --steps 4             # timings only
    .venv/bin/python benchmarks/profile_rl_step.py --profile cprofile     # + top functions
    .venv/bin/python benchmarks/profile_rl_step.py --profile torch        # + top torch ops
    .venv/bin/python benchmarks/profile_rl_step.py --compile              # actor.compile=true
                                                                          # and ref.compile=true

Rewards are random 0/1 per sequence (fixed seed): the reward MFC is not under test here.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import read_prompts, write_benchmark_model, write_prompt_file  # noqa: E402

from realrl.api.data import SequenceSample  # noqa: E402
from realrl.api.dfg import MicroBatchSpec  # noqa: E402
from realrl.api.experiment import OptimizerConfig  # noqa: E402
from realrl.api.rl_config import GenerationHyperparameters, PPOHyperparameters  # noqa: E402
from realrl.backends.torch_engine import ParallelContext, TorchEngine  # noqa: E402
from realrl.interfaces.configs import PPOActorConfig  # noqa: E402
from realrl.interfaces.ppo_actor import PPOActorInterface  # noqa: E402
from realrl.interfaces.reference import ReferenceInterface  # noqa: E402
from realrl.models.checkpoint import load_pretrained  # noqa: E402
from realrl.models.compiled import enable_compiled_blocks  # noqa: E402
from realrl.models.tokenizer import load_tokenizer  # noqa: E402

logger = logging.getLogger("profile_rl_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/realrl-bench")
    parser.add_argument("--steps", type=int, default=4, help="Measured steps (after 1 warm-up).")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--profile", choices=["none", "cprofile", "torch"], default="none")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Compiled blocks for the actor and reference (actor.compile=true, ref.compile=true); "
        "the compiles happen in the warm-up step.",
    )
    parser.add_argument(
        "--no-share-prefixes",
        action="store_true",
        help="Run every packed token through the model (actor.share_prefixes=false, "
        "ref.share_prefixes=false); by default the tokens a group's sequences share run once.",
    )
    return parser.parse_args(argv)


def prompt_sample(tokenizer, records: list[dict]) -> SequenceSample:
    encoded = [tokenizer.encode(r["prompt"], add_special_tokens=True) for r in records]
    return SequenceSample.from_default(
        ids=[f"q{i}" for i in range(len(records))],
        seqlens=[len(e) for e in encoded],
        data={"packed_prompts": torch.tensor([t for e in encoded for t in e], dtype=torch.long)},
    )


class ActorStep:
    """One GRPO step (actor_gen, ref_inf, actor_train) on in-process engines.

    ``--clock cpu`` (default) times process CPU seconds, which move far less with other users'
    load than wall seconds (compare changes with ``--threads 1``: with more threads CPU
    seconds include the OpenMP workers' spinning); ``--clock wall`` times wall seconds.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        work_dir = Path(args.work_dir)
        model_dir = write_benchmark_model(work_dir / "model-small", "small")
        self.records = read_prompts(write_prompt_file(work_dir / "prompts.jsonl"))
        dtype = getattr(torch, args.dtype)
        self.tokenizer = load_tokenizer(model_dir)
        optimizer = OptimizerConfig(lr=1e-4)
        self.actor = TorchEngine(
            load_pretrained(model_dir, dtype=dtype),
            self.tokenizer,
            ParallelContext(),
            optimizer,
            total_optimizer_steps=100,
        )
        self.reference = TorchEngine(
            load_pretrained(model_dir, dtype=dtype), self.tokenizer, ParallelContext()
        )
        for engine in (self.actor, self.reference):
            engine.module.share_prefixes = not args.no_share_prefixes
        if args.compile:
            enable_compiled_blocks(self.actor.module, "actor.compile")
            enable_compiled_blocks(self.reference.module, "ref.compile")
        generation = GenerationHyperparameters(
            max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens
        )
        ppo = PPOHyperparameters(disable_value=True, adv_estimator="grpo", kl_ctl=0.0)
        self.interface = PPOActorInterface(
            PPOActorConfig(
                ppo=ppo,
                generation=generation,
                group_size=args.group_size,
                generation_size=args.group_size,
            )
        )
        self.reference_interface = ReferenceInterface()
        self.args = args
        self.rewards = torch.Generator().manual_seed(0)

    def run(self, step: int) -> dict[str, float]:
        args, spec = self.args, MicroBatchSpec()
        batch = self.records[step * args.batch_size : (step + 1) * args.batch_size]
        timings = {}
        clock = time.process_time if self.args.clock == "cpu" else time.perf_counter
        started = clock()
        rollout = self.interface.generate(self.actor, prompt_sample(self.tokenizer, batch), spec)
        timings["actor_gen"] = clock() - started
        data = rollout.data
        num_seqs = args.batch_size * args.group_size
        rewards = torch.randint(0, 2, (num_seqs,), generator=self.rewards).float()
        data.update_(
            SequenceSample.from_tensors(
                ids=data.ids,
                seqlens={"rewards": [[1] * args.group_size] * len(data.ids)},
                data={"rewards": rewards},
            )
        )
        started = clock()
        self.reference_interface.inference(self.reference, data, spec)
        timings["ref_inf"] = clock() - started
        started = clock()
        self.interface.train_step(self.actor, data, spec)
        timings["actor_train"] = clock() - started
        return timings


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    step = ActorStep(args)
    started = time.perf_counter()
    step.run(0)  # warm-up (and, with --compile, the compiles)
    logger.info("warm-up step %.1f wall s", time.perf_counter() - started)
    profiler = None
    if args.profile == "cprofile":
        profiler = cProfile.Profile()
        profiler.enable()
    elif args.profile == "torch":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    timings = [step.run(i + 1) for i in range(args.steps)]
    if args.profile == "cprofile":
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    elif args.profile == "torch":
        profiler.__exit__(None, None, None)
        sys.stdout.write(
            profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top) + "\n"
        )
    for name in timings[0]:
        values = [t[name] for t in timings]
        logger.info(
            "%-12s median %.3f %s s  (min %.3f, max %.3f)",
            name,
            statistics.median(values),
            args.clock,
            min(values),
            max(values),
        )
    total = [sum(t.values()) for t in timings]
    logger.info("total        median %.3f %s s", statistics.median(total), args.clock)


if __name__ == "__main__":
    main()
