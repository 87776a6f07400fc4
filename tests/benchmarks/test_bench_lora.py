"""`benchmarks/bench_lora.py`'s accounting: measured on live tensors after real steps, and
counted on the meta device for the full-size model, they must agree where both apply."""

import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from bench_lora import measure, meta_accounting, parse_args  # noqa: E402
from bench_setup import MODEL_SIZES  # noqa: E402


def test_lora_holds_the_adapters_state_only_and_no_reference_copy(tmp_path):
    common = ["--work-dir", str(tmp_path), "--size", "small", "--layers", "1", "--rank", "4",
              "--num-seqs", "2", "--seq-len", "16", "--steps", "1"]
    full = measure(parse_args([*common, "--mode", "full"]))
    lora = measure(parse_args([*common, "--mode", "lora"]))
    # Full fine-tuning: weights + reference copy + fp32 gradients + AdamW's two moments.
    assert full["total_bytes"] == 5 * full["weights_bytes"]
    assert lora["reference_bytes"] == 0
    assert lora["gradient_bytes"] == 4 * lora["trainable"]
    assert lora["optimizer_bytes"] == 8 * lora["trainable"]
    assert lora["trainable"] < 0.2 * full["trainable"]
    counted = meta_accounting({**MODEL_SIZES["small"], "num_hidden_layers": 1},
                              full["vocab_size"], torch.float32, 4)
    for mode, measured in (("full", full), ("lora", lora)):
        for key in ("parameters", "trainable", "weights_bytes", "reference_bytes",
                    "gradient_bytes", "optimizer_bytes", "total_bytes"):
            assert counted[mode][key] == measured[key], (mode, key)
