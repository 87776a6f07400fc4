#!/usr/bin/env bash
# Wheels of the realrl dependencies that an offline CUDA host lacks, for `run_gpu_tests.sh`.
#
#   bash benchmarks/gpu_wheelhouse.sh [OUTDIR (.whl)] [PYTHON_VERSION (3.12)]
#
# Run it where pip reaches a package index. The host is assumed to hold a CUDA PyTorch image
# (torch, triton, transformers, safetensors, tokenizers, numpy, pyyaml, matplotlib, tqdm,
# tensorboard, pytest): this fetches the rest for PYTHON_VERSION, manylinux x86_64:
# megatron-core 0.17.1 (the newest release pyproject.toml allows; every release after 0.16.1
# needs Python >= 3.12, and 0.17.1 imports without Transformer Engine, Apex or triton),
# omegaconf, hydra-core, pyzmq, math-verify and latex2sympy2_extended, TRL 1.16.0 for the
# benchmark's baseline (`bench_rl_step.py --device cuda`) with the datasets, dill and
# multiprocess it needs (datasets 4.8.5: 5.x needs pyarrow >= 24; accelerate, pandas, pyarrow,
# xxhash and fsspec are in such images), and builds the one sdist-only dependency
# (antlr4-python3-runtime 4.9.3, for omegaconf) into a wheel. ~5 MB.
# `.whl/` is git-ignored; the device tool carries it with `carry: [".whl"]`.
set -euo pipefail
out=${1:-.whl}
py=${2:-3.12}
mkdir -p "$out"
specs=(megatron-core==0.17.1 omegaconf==2.3.1 hydra-core==1.3.8 pyzmq==27.3.0
       math-verify==0.9.0 latex2sympy2_extended==1.11.0
       trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
           manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
for spec in "${specs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp "${platforms[@]}" -d "$out" "$spec"
done
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$out"
ls -1 "$out"
du -sh "$out"
