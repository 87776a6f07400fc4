"""TRL's `PPOTrainer` on the benchmark model, prompts and batch, for `bench_rl_step.py`.

TRL removed its PPO trainer after 1.12.0 (`trl.experimental.ppo`, gone in 1.13), so this script
runs against a copy of that release installed beside the benchmark environment's TRL:

    .venv/bin/pip install --no-deps --target /tmp/realrl-bench/trl-1.12 trl==1.12.0

`bench_rl_step.py --systems realrl-ppo,trl-ppo` puts that folder first on `PYTHONPATH`
(`--trl-ppo-path`). Its other requirements (transformers, accelerate, datasets) are the
environment's.

Settings are pinned so that TRL does the work of `realrl-ppo` (actor, critic, reference,
rule reward; GAE with gamma = lambda = 1; KL 0.1 in the reward; one epoch of one mini-batch):
`per_device_train_batch_size = batch_size * group_size` rollouts per optimizer step (each
prompt `group_size` times in a row, as realrl samples a group), a value model built from the
same checkpoint, temperature 1, `use_cpu`, and `bf16` and `gradient_checkpointing` set
explicitly. TRL's PPO scores a rollout with a reward *model*; here that model is
`RuleReward`, which returns the benchmark's arithmetic reward without a forward pass, as
realrl's rule reward does. Fixed-length mode sets no stop token, so every response runs to
`max_new_tokens` (TRL's PPO has no `min_new_tokens`).

Each update's wall time (generation, reference, value and reward passes, forward, backward
and optimizer) is the time between TRL's consecutive `on_step_end` callbacks (the first from
`on_train_begin`), written to `--output` as JSON lines with the update's generated tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import arithmetic_reward, baseline_arguments, read_prompts  # noqa: E402


class RuleReward(torch.nn.Module):
    """A reward "model" for TRL's `get_reward`: its backbone decodes each response and puts
    the arithmetic reward at every position (TRL reads the one at the response's last token);
    `score` passes it through. Also counts the response tokens it saw (up to and including
    the first EOS), which TRL's PPO does not log."""

    base_model_prefix = "rule"

    def __init__(self, tokenizer, answers: dict[str, str], prompt_len: int) -> None:
        super().__init__()
        self.tokenizer, self.answers, self.prompt_len = tokenizer, answers, prompt_len
        self.response_tokens = 0
        self.rule = self._backbone

    def _backbone(self, input_ids, attention_mask, **unused) -> SimpleNamespace:
        rewards = []
        for ids, mask in zip(input_ids, attention_mask):
            kept = ids[mask].tolist()
            prompt = self.tokenizer.decode(kept[: self.prompt_len], skip_special_tokens=True)
            response = kept[self.prompt_len :]
            self.response_tokens += len(response)
            text = self.tokenizer.decode(response, skip_special_tokens=False)
            rewards.append(arithmetic_reward(text, self.answers[prompt]))
        scores = torch.tensor(rewards)[:, None, None].expand(-1, input_ids.shape[1], 1)
        return SimpleNamespace(hidden_states=[scores])

    def score(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def run(args: argparse.Namespace) -> None:
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    records = read_prompts(args.prompts)[: args.steps * args.batch_size]
    encoded = [tokenizer(r["prompt"])["input_ids"] for r in records]
    prompt_len = len(encoded[0])
    if any(len(ids) != prompt_len for ids in encoded):
        raise ValueError("the benchmark's prompts must all have the same length")
    rows = [{"input_ids": ids} for ids in encoded for _ in range(args.group_size)]
    answers = {r["prompt"]: r["answer"] for r in records}
    reward = RuleReward(tokenizer, answers, prompt_len)
    output = open(args.output, "w")

    class StepTimer(TrainerCallback):
        def on_train_begin(self, train_args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, train_args, state, control, **kwargs):
            now = time.perf_counter()
            output.write(json.dumps({"step": state.global_step, "step_s": now - self.last,
                                     "generated_tokens": reward.response_tokens}) + "\n")
            output.flush()
            reward.response_tokens, self.last = 0, now

    num_seqs = args.batch_size * args.group_size
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-ppo-"), total_episodes=args.steps * num_seqs,
        per_device_train_batch_size=num_seqs, gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=num_seqs, num_mini_batches=1, num_ppo_epochs=1,
        response_length=args.max_new_tokens, stop_token=None if args.fixed_length else "eos",
        temperature=1.0, missing_eos_penalty=None, kl_coef=0.1, kl_estimator="k1",
        gamma=1.0, lam=1.0, whiten_rewards=False, learning_rate=args.lr,
        num_sample_generations=0, use_cpu=True, bf16=args.dtype == "bfloat16",
        gradient_checkpointing=False, save_strategy="no", report_to="none", logging_steps=1,
        seed=args.seed, dataloader_num_workers=0,
    )
    dtype = getattr(torch, args.dtype)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    value = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1,
                                                               dtype=dtype)
    value.config.pad_token_id = tokenizer.pad_token_id
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=reference,
        reward_model=reward, value_model=value, train_dataset=Dataset.from_list(rows),
        callbacks=[StepTimer()],
    )
    trainer.train()
    output.close()


if __name__ == "__main__":
    run(baseline_arguments(__doc__.split("\n\n")[0]))
