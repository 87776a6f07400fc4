#!/usr/bin/env bash
# Run realrl's gpu-marked tests on a CUDA host from the source tree, and keep their output.
#
#   bash benchmarks/run_gpu_tests.sh [OUTPUT_DIR (benchmarks/results)]
#
# From the checkout's root or anywhere: installs the wheels of `.whl/` (made elsewhere by
# `bash benchmarks/gpu_wheelhouse.sh`: megatron-core 0.17.1, omegaconf, ...) into
# /tmp/realrl-site when the folder holds any, records the environment (GPU, Python, torch,
# megatron-core, and whether megatron-core imported without Transformer Engine, Apex or
# triton), then runs `pytest -m gpu -s` over tests/ (the megatron DDP/DistributedOptimizer,
# tensor-parallel-layer and activation-checkpointing tests of tests/backends/test_megatron_gpu.py
# print the peak memory they measure) and writes everything to OUTPUT_DIR/gpu_tests.txt.
# Exits with pytest's status.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
log="$out/gpu_tests.txt"
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/realrl-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/realrl-site:$PWD"
fi
export PYTHONUNBUFFERED=1
{
  echo "\$ bash benchmarks/run_gpu_tests.sh  ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib
import sys
import time

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
before = set(sys.modules)
started = time.perf_counter()
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.tensor_parallel  # noqa: E402,F401

seconds = time.perf_counter() - started
loaded = {name.split(".")[0] for name in set(sys.modules) - before}
print(f"megatron-core {megatron.core.__version__} imported in {seconds:.1f} s; "
      f"it imported: transformer_engine {'transformer_engine' in loaded}, "
      f"apex {'apex' in loaded}, triton {'triton' in loaded}")
for name in ("transformers", "triton", "transformer_engine", "apex"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        print(f"{name}: not installed")
EOF
  python3 -m pytest -m gpu -s -q -p no:cacheprovider tests/
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
