"""TRL's `GRPOTrainer` on the benchmark model, prompts and batch, for `bench_rl_step.py`.

Settings are pinned so that TRL does the same work as realrl and the hand-written loop:
`per_device_train_batch_size = batch_size * group_size` completions with
`num_generations = group_size` (one optimizer step per generation batch), `beta=0` (no
reference model, as realrl's `ppo.kl_ctl=0`), temperature 1 with no top-k/top-p, `use_cpu`
unless `--device cuda`, and `bf16` and `gradient_checkpointing` set explicitly (TRL's own
defaults are bf16 where supported and gradient checkpointing on). Fixed-length mode passes
`min_new_tokens`. `--micro-batch N` trains on N completions per forward/backward with the
gradients of the whole batch accumulated (`gradient_accumulation_steps`; TRL then generates the
whole batch once per optimizer step, `steps_per_generation`), for batches whose activations do
not fit at once.

Each optimizer step's wall time (generation, reward, forward, backward and optimizer inside
it) is taken by a `TrainerCallback` and written to `--output` as JSON lines, with the step's
peak of allocated CUDA memory on a GPU (`peak_memory_gb`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import arithmetic_reward, baseline_arguments, read_prompts  # noqa: E402


def reward_function(completions: list[str], answer: list[str], **unused) -> list[float]:
    return [arithmetic_reward(text, expected) for text, expected in zip(completions, answer)]


def run(args: argparse.Namespace) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    records = read_prompts(args.prompts)[: args.steps * args.batch_size]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    output = open(args.output, "w")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, train_args, state, control, **kwargs):
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.started = time.perf_counter()

        def on_step_end(self, train_args, state, control, **kwargs):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.step_s = time.perf_counter() - self.started
            self.peak_gb = (torch.cuda.max_memory_allocated() / 2**30
                            if args.device == "cuda" else None)

        def on_log(self, train_args, state, control, logs=None, **kwargs):
            # Called after on_step_end with the step's metrics (logging_steps=1).
            if logs and "completions/mean_length" in logs:
                tokens = float(logs["completions/mean_length"]) * args.batch_size * args.group_size
                output.write(json.dumps({"step": state.global_step, "step_s": self.step_s,
                                         "generated_tokens": tokens,
                                         "peak_memory_gb": self.peak_gb}) + "\n")
                output.flush()

    generation_kwargs = {"min_new_tokens": args.max_new_tokens} if args.fixed_length else {}
    completions = args.batch_size * args.group_size
    micro_batch = args.micro_batch or completions
    if completions % micro_batch:
        raise SystemExit(f"--micro-batch {micro_batch} must divide the {completions} completions "
                         "of a batch (batch size x group size)")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=args.steps,
        per_device_train_batch_size=micro_batch,
        num_generations=args.group_size, gradient_accumulation_steps=completions // micro_batch,
        max_completion_length=args.max_new_tokens, generation_kwargs=generation_kwargs,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, learning_rate=args.lr,
        use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", gradient_checkpointing=False,
        shuffle_dataset=False, save_strategy="no", report_to="none", logging_steps=1,
        seed=args.seed, dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_function, args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[StepTimer()])
    trainer.train()
    output.close()


if __name__ == "__main__":
    run(baseline_arguments(__doc__.split("\n\n")[0], gpu=True))
