"""Decode speed on one CUDA GPU: realrl's generation engine against transformers' `generate`.

Engines (`--engines`, any subset, comma-separated):
- `realrl_graphs`: the default on CUDA, decode steps captured as CUDA graphs and replayed
  (`realrl.models.cuda_graphs`); its first call includes the captures.
- `realrl_compiled`: `gen.compile=true` on CUDA: the same steps compiled by inductor, then
  captured; its first call includes the compile.
- `realrl_eager`: `gen.cuda_graphs=false`, eager steps (the path before graphs).
- `realrl_compiled_eager`: `gen.compile=true` without graphs (a compiled step with a dynamic
  column count, launched from Python every step).
- `transformers`: `model.generate` with sampling.
The default runs `realrl_compiled` last: its compile takes a minute or more on the first call.

The model is shaped like Qwen2.5-0.5B (random weights, bf16, `bench_setup.MODEL_SIZES`). For
each batch size: prompts of 8-24 tokens, `--new-tokens` sampled tokens each (min = max, so every
engine decodes the same number of steps), temperature 1. Reported per engine: wall seconds of
the whole call (median of `--repeats` after one warm-up), generated tokens/s, milliseconds per
decode step, and that step's floor: the larger of the bytes it must read (bf16 weights once,
plus the KV cache at its mean length) over memory bandwidth and its FLOPs over the bf16 matrix
rate (both measured on the machine at start). A torch.profiler table of realrl's eager decode
of `--profile-engine` at the first batch size says where its time goes. Writes JSON to
`--output` after every measured row, so a run cut short keeps what it measured.

    python3 benchmarks/bench_gpu_generation.py --output gpu_generation.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time

import torch
from bench_setup import MODEL_SIZES, write_benchmark_model

from realrl.models.checkpoint import load_pretrained
from realrl.models.generation import GenerationConfig, generate


def measured_ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and a large bf16 matmul rate."""
    source = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    target = torch.empty_like(source)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    copy_s, matmul_s = [], []
    for _ in range(10):
        copy_s.append(timed(lambda: target.copy_(source)))
        matmul_s.append(timed(lambda: a @ b))
    bandwidth = 2 * source.numel() * 2 / statistics.median(copy_s[2:])
    flops = 2 * 8192**3 / statistics.median(matmul_s[2:])
    return {"bandwidth_bytes_per_s": bandwidth, "bf16_flops_per_s": flops}


def timed(function) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def make_prompts(batch: int, vocab: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (batch,), generator=generator)
    return [torch.randint(2, vocab, (int(n),), generator=generator) for n in lengths]


# realrl engine -> (gen.compile, gen.cuda_graphs)
REALRL_ENGINES = {
    "realrl_graphs": (False, True),
    "realrl_compiled": (True, True),
    "realrl_eager": (False, False),
    "realrl_compiled_eager": (True, False),
}
ENGINES = (*REALRL_ENGINES, "transformers")


def realrl_runner(model, prompts, new_tokens: int, engine: str):
    packed = torch.cat(prompts).cuda()
    cu_seqlens = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor([len(p) for p in prompts]).cumsum(0)
    compile_decode, cuda_graphs = REALRL_ENGINES[engine]
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              compile=compile_decode, cuda_graphs=cuda_graphs)

    def run(seed: int):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return generate(model, packed, cu_seqlens.cuda(), config, generator)

    return run


def transformers_runner(model, prompts, new_tokens: int):
    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding, as transformers expects
        input_ids[row, max_len - len(prompt):] = prompt
        attention_mask[row, max_len - len(prompt):] = 1
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()

    def run(seed: int):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(input_ids, attention_mask=attention_mask, do_sample=True,
                                  top_k=0, top_p=1.0, temperature=1.0,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0)

    return run


def decode_floor_s(config: dict, params: int, batch: int, mean_context: float,
                   ceilings: dict) -> float:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] \
        * head_dim * 2
    bytes_moved = 2 * params + kv_bytes_per_token * batch * mean_context
    flops = 2 * params * batch
    return max(bytes_moved / ceilings["bandwidth_bytes_per_s"],
               flops / ceilings["bf16_flops_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="qwen2.5-0.5b", choices=sorted(MODEL_SIZES))
    parser.add_argument("--batches", default="64,512")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines",
                        default="realrl_eager,realrl_graphs,transformers,realrl_compiled",
                        help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--profile-engine", default="realrl_graphs",
                        help="the realrl engine profiled at the first batch size ('' for none)")
    parser.add_argument("--output", default="gpu_generation.json")
    args = parser.parse_args()
    engines = args.engines.split(",")
    unknown = [e for e in engines + [args.profile_engine] if e and e not in ENGINES]
    if unknown or args.profile_engine == "transformers":
        parser.error(f"unknown or unprofilable engine(s) {unknown or ['transformers']}; "
                     f"--engines takes {', '.join(ENGINES)} and --profile-engine the realrl ones")
    from transformers import AutoModelForCausalLM

    ceilings = measured_ceilings()
    with tempfile.TemporaryDirectory() as directory:
        write_benchmark_model(directory, args.size)
        config = json.loads(open(f"{directory}/config.json").read())
        model = load_pretrained(directory, dtype=torch.bfloat16, device="cuda").eval()
        hf_model = None
        if "transformers" in engines:
            hf_model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.bfloat16).cuda().eval()
    params = sum(p.numel() for p in model.parameters())
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "size": args.size, "parameters": params,
              "new_tokens": args.new_tokens, "ceilings": ceilings, "rows": []}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.size} "
          f"({params / 1e9:.2f}B parameters, bf16); copy "
          f"{ceilings['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = make_prompts(batch, config["vocab_size"], seed=batch)
        mean_prompt = sum(len(p) for p in prompts) / batch
        floor = decode_floor_s(config, params, batch, mean_prompt + args.new_tokens / 2,
                               ceilings)
        runners = {}
        for engine in engines:
            if engine == "transformers":
                runners[engine] = transformers_runner(hf_model, prompts, args.new_tokens)
            else:
                runners[engine] = realrl_runner(model, prompts, args.new_tokens, engine)
        for engine, run in runners.items():
            try:
                first_s = timed(functools.partial(run, 0))
                seconds = statistics.median(timed(functools.partial(run, seed))
                                            for seed in range(1, args.repeats + 1))
            except Exception as error:  # noqa: BLE001 - a failing engine is a result too
                report["rows"].append({"batch": batch, "engine": engine,
                                       "error": f"{type(error).__name__}: {error}"[:2000]})
                print(f"batch {batch:4d} {engine:<21} failed: {type(error).__name__}: {error}",
                      flush=True)
                write_report(report, args.output)
                continue
            step_ms = seconds / args.new_tokens * 1e3
            row = {"batch": batch, "engine": engine, "first_call_s": first_s,
                   "seconds": seconds, "tokens_per_s": batch * args.new_tokens / seconds,
                   "ms_per_step": step_ms, "floor_ms_per_step": floor * 1e3,
                   "x_floor": step_ms / (floor * 1e3),
                   "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30}
            graphs = getattr(model, "decode_graphs", None)
            row["graph_captures_so_far"] = graphs.captures if graphs is not None else 0
            report["rows"].append(row)
            print(f"batch {batch:4d} {engine:<21} {seconds:7.2f} s  "
                  f"{row['tokens_per_s']:9.0f} tok/s  {step_ms:7.2f} ms/step  "
                  f"(floor {floor * 1e3:.2f} ms: {row['x_floor']:.1f}x)  first call "
                  f"{first_s:.1f} s", flush=True)
            write_report(report, args.output)
    if args.profile_engine:
        profile_engine(model, config, args, report)
    write_report(report, args.output)


def profile_engine(model, config: dict, args, report: dict) -> None:
    """A torch.profiler table of one call of `--profile-engine` at the first batch size."""
    batch = int(args.batches.split(",")[0])
    run = realrl_runner(model, make_prompts(batch, config["vocab_size"], batch),
                        args.new_tokens, args.profile_engine)
    run(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profile:
        run(1)
        torch.cuda.synchronize()
    table = profile.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    report[f"profile_{args.profile_engine}"] = table
    print(table)


def write_report(report: dict, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
