"""realrl's generation engine vs transformers' `generate` on the same tiny Qwen2 model.

One run measures both engines in fp32 and bf16: batch of 32 prompts (8-24 tokens), 32 new
tokens each (min_new_tokens=32 so both decode exactly 32 steps), sampling at temperature 1.
realrl runs twice, eager and with its compiled decode step (`GenerationConfig.compile`;
the one-off compile time is printed). Reports the median over repeats of tokens/s and the
realrl/transformers ratios; the engines alternate within each repeat so that background
load affects them alike.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_generation.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from realrl.models.checkpoint import load_pretrained
from realrl.models.generation import GenerationConfig, generate

BATCH, NEW_TOKENS, VOCAB = 32, 32, 8192


def build_models(directory: str):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    hf_model.save_pretrained(directory)
    return hf_model, load_pretrained(directory)


def make_prompts(generator: torch.Generator):
    lengths = torch.randint(8, 25, (BATCH,), generator=generator)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=generator) for n in lengths]
    return prompts


def realrl_runner(model, prompts, compile_decode: bool = False):
    packed = torch.cat(prompts)
    cu_seqlens = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor([len(p) for p in prompts]).cumsum(0)
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, compile=compile_decode
    )

    def run(seed: int) -> torch.Tensor:
        return generate(
            model, packed, cu_seqlens, config, torch.Generator().manual_seed(seed)
        ).packed_input_ids

    return run


def transformers_runner(model, prompts):
    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding, as transformers expects
        input_ids[row, max_len - len(prompt) :] = prompt
        attention_mask[row, max_len - len(prompt) :] = 1

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )

    return run


def interleaved_medians(runners, repeats: int) -> list[tuple[float, float]]:
    """(median wall s, median process CPU s) per runner; engines alternate every repeat.

    Alternating spreads background load over both engines alike; process CPU time is also
    reported because on a shared machine it is far steadier than wall time.
    """
    times = [[] for _ in runners]
    for repeat in range(repeats + 1):  # repeat 0 warms up
        for index, run in enumerate(runners):
            wall, cpu = time.perf_counter(), time.process_time()
            run(repeat)
            if repeat > 0:
                times[index].append((time.perf_counter() - wall, time.process_time() - cpu))
    return [tuple(statistics.median(column) for column in zip(*t)) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        hf_model, realrl_model = build_models(directory)
    prompts = make_prompts(generator)
    num_params = sum(p.numel() for p in realrl_model.parameters())
    print(
        f"Qwen2 tiny model, {num_params / 1e6:.2f}M params; batch {BATCH}, {NEW_TOKENS} new "
        f"tokens; torch threads {torch.get_num_threads()}; median of {args.repeats} repeats"
    )
    print(
        f"{'dtype':<10}{'clock':<6}{'realrl tok/s':>14}{'compiled tok/s':>16}"
        f"{'transformers tok/s':>20}{'ratio':>8}{'compiled ratio':>16}"
    )
    tokens = BATCH * NEW_TOKENS
    for dtype in (torch.float32, torch.bfloat16):
        realrl_model.to(dtype)
        compiled = realrl_runner(realrl_model, prompts, compile_decode=True)
        started = time.perf_counter()
        compiled(0)  # compiles (the warm-up repeat below then runs the compiled step)
        compile_s = time.perf_counter() - started
        runners = [
            realrl_runner(realrl_model, prompts),
            compiled,
            transformers_runner(hf_model.to(dtype), prompts),
        ]
        (ours, ours_compiled, theirs) = interleaved_medians(runners, args.repeats)
        name = str(dtype).removeprefix("torch.")
        for index, clock in enumerate(("wall", "cpu")):
            print(
                f"{name:<10}{clock:<6}{tokens / ours[index]:>14.0f}"
                f"{tokens / ours_compiled[index]:>16.0f}{tokens / theirs[index]:>20.0f}"
                f"{theirs[index] / ours[index]:>7.2f}x"
                f"{theirs[index] / ours_compiled[index]:>15.2f}x"
            )
        print(f"{name:<10}first compiled call (compile included): {compile_s:.1f} s")


if __name__ == "__main__":
    main()
