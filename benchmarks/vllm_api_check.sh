#!/usr/bin/env bash
# Check realrl's vLLM backend against the real vLLM package on a machine without a GPU.
#
#   bash benchmarks/vllm_api_check.sh [SITE_DIR (/tmp/realrl-vllm-site)] [OUTPUT_FILE]
#
# `make test` skips every vLLM test: vllm is the `gpu` extra and pins a CUDA torch. This
# downloads vllm 0.33.0 (the release `realrl/models/vllm_generation.py` is written against) and
# the modules its entry points import at module level into SITE_DIR with `--no-deps`, so that
# .venv and its CPU torch stay as they are (vllm's compiled ops, `vllm._C`, then fail to load,
# which importing its Python classes does not need), and runs
# tests/models/test_vllm_generation.py with SITE_DIR on PYTHONPATH: every vLLM call and keyword
# realrl makes against the installed signatures, and vLLM's own SamplingParams, TokensPrompt,
# EngineArgs/ModelConfig and IPC update-info classes built from what realrl passes. The GPU
# test stays skipped. Needs the package index (~0.4 GB of wheels; a minute here), no model hub.
# Exits with pytest's status; with OUTPUT_FILE, the output is kept there too.
set -uo pipefail
cd "$(dirname "$0")/.."
site=${1:-/tmp/realrl-vllm-site}
out=${2:-/dev/null}
python=${PYTHON:-.venv/bin/python}
# The versions that imported together with vllm 0.33.0 on Python 3.11 (2026-12-03).
packages=(
  vllm==0.33.0 cloudpickle==3.1.3 cbor2==6.3.0 msgspec==0.23.0 py-cpuinfo==9.0.0
  prometheus-client==0.26.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1
  fastapi==0.165.0 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2
  openai==3.57.0 openai-harmony==0.0.8 pybase64==1.5.1 cachetools==8.0.2 uvloop==0.23.0
  aiohttp==3.14.5 aiosignal==1.4.0 aiohappyeyeballs==2.7.1 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 yarl==1.25.1 propcache==0.5.4
)
if ! PYTHONPATH="$site" "$python" -c "import vllm; assert vllm.__version__ == '0.33.0'" \
    2> /dev/null; then
  "$python" -m pip install -q --no-deps --upgrade --target "$site" "${packages[@]}" || exit 1
fi
PYTHONPATH="$site" "$python" -m pytest -q -p no:randomly -p no:cacheprovider -rs \
  tests/models/test_vllm_generation.py 2>&1 | tee "$out"
exit "${PIPESTATUS[0]}"
