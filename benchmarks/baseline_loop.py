"""The baseline a user would write by hand: one process, transformers `generate`, one forward,
one backward, a GRPO loss, AdamW.

It is the reference point of `bench_rl_step.py`, run on the same weights, prompts, sampling
settings and batch as realrl. Each step:

1. generate `group_size` samples for each of `batch_size` prompts (`model.generate`, KV cache,
   multinomial sampling with temperature 1, no top-k/top-p, same as realrl's defaults);
2. score them with `arithmetic_reward` and compute GRPO advantages
   `A_i = (r_i - mean(r_group)) / (std(r_group) + eps)` (Shao et al. 2024, eq. 3 outcome
   supervision);
3. one forward pass with gradients over prompt + response, the clipped surrogate of PPO
   (Schulman et al. 2017, eq. 7) with the detached current log-probabilities as the old ones
   (one optimizer step per batch, so the ratio is 1 and the loss is `-A * ratio`), averaged
   over response tokens, one backward, gradient clipping at 1.0, one AdamW step.

`--dtype bfloat16` runs both generation and training under `torch.autocast(bfloat16)` with
float32 master weights, the way TRL's `bf16=True` does.

Run `python benchmarks/baseline_loop.py --help`; each step's timings go to `--output` as one
JSON object per line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import arithmetic_reward, baseline_arguments, read_prompts  # noqa: E402


def precision(dtype: str):
    if dtype == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def generate(model, tokenizer, prompts: list[str], args) -> tuple[torch.Tensor, int]:
    """[batch * group, prompt_len + response_len] token ids, and the prompt length."""
    encoded = tokenizer(prompts, return_tensors="pt")  # equal-length prompts: no padding
    model.eval()
    with torch.no_grad(), precision(args.dtype):
        sequences = model.generate(
            **encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens if args.fixed_length else 0,
            num_return_sequences=args.group_size, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return sequences, encoded["input_ids"].shape[1]


def response_mask(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for response tokens up to and including the first EOS. # [num_seqs, response_len]"""
    is_eos = (responses == eos_token_id).int()
    after_eos = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    return (~after_eos).float()


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    grouped = rewards.view(-1, group_size)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def train_step(model, optimizer, sequences, prompt_len, mask, advantages, args) -> float:
    model.train()
    attention_mask = torch.cat(
        [torch.ones(sequences.shape[0], prompt_len), mask], dim=1).long()
    with precision(args.dtype):
        logits = model(input_ids=sequences, attention_mask=attention_mask).logits
    logits = logits[:, prompt_len - 1:-1].float()  # predicts response tokens
    logprobs = torch.log_softmax(logits, dim=-1).gather(
        -1, sequences[:, prompt_len:].unsqueeze(-1)).squeeze(-1)  # [num_seqs, response_len]
    ratio = torch.exp(logprobs - logprobs.detach())
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    records = read_prompts(args.prompts)
    with open(args.output, "w") as output:
        for step in range(args.steps):
            batch = records[step * args.batch_size:(step + 1) * args.batch_size]
            started = time.perf_counter()
            sequences, prompt_len = generate(model, tokenizer, [r["prompt"] for r in batch], args)
            generated = time.perf_counter()
            responses = sequences[:, prompt_len:]
            mask = response_mask(responses, tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(responses)
            answers = [r["answer"] for r in batch for _ in range(args.group_size)]
            rewards = torch.tensor([arithmetic_reward(t, a) for t, a in zip(texts, answers)])
            advantages = group_advantages(rewards, args.group_size)
            scored = time.perf_counter()
            loss = train_step(model, optimizer, sequences, prompt_len, mask, advantages, args)
            finished = time.perf_counter()
            output.write(json.dumps({
                "step": step + 1, "step_s": finished - started,
                "generate_s": generated - started, "inference_s": scored - generated,
                "train_s": finished - scored, "generated_tokens": float(mask.sum()),
                "num_seqs": sequences.shape[0], "prompt_len": prompt_len,
                "reward": float(rewards.mean()), "loss": loss,
            }) + "\n")
            output.flush()


if __name__ == "__main__":
    run(baseline_arguments(__doc__.split("\n\n")[0]))
