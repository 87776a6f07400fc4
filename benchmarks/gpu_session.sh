#!/usr/bin/env bash
# Every GPU check of issues 22-23 in one call, most important first, inside a time budget.
#
#   bash benchmarks/gpu_session.sh OUTPUT_DIR [BUDGET_S (540)] [STEP ...]
#
# For a CUDA host lent for minutes (the device tool: one call of at most 10 minutes, 15 minutes
# of device time a session, machine start included). Installs `.whl/` (made beforehand with
# `bash benchmarks/gpu_wheelhouse.sh .whl`) once, then runs the steps in the order below; a step
# starts only while the budget holds its minimum, and runs under `timeout` of what is left. Each
# step writes OUTPUT_DIR/<step>.txt (its command, output, exit code and seconds; the benchmarks
# also their JSON) and a line to OUTPUT_DIR/session.txt, so a call cut short still returns what
# finished. STEP names run a subset, in the order given (a second call for what the first left):
#
#   env          GPU, driver, Python, torch, CUDA, transformers, trl, megatron-core versions
#   tests        the gpu-marked tests (run_gpu_tests.sh)
#   rl_step      issue 23's benchmark: GRPO and PPO steps against TRL's GRPOTrainer, 0.5B
#                shape, 64 prompts x 8 samples x 512 forced tokens, bf16 (bench_rl_step.py)
#   decode512    decode at 512 rows, captured + compiled (the row the first H100 run lost)
#   lm_head      peak memory of the LM head's log-probs, whole logits vs fused, 0.5B shape
#   ppo          ppo-math GRPO and PPO, 20 steps, 0.5B shape, every role on the GPU
#   plan         profile_plan: the plan search's GPU profile of this device
#
# The budget default leaves a 10-minute call a minute of slack for the wheel install and the
# copy back. Exits 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_session.sh OUTPUT_DIR [BUDGET_S] [STEP ...]}
budget=${2:-540}
shift $(( $# >= 2 ? 2 : 1 ))
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests rl_step decode512 lm_head ppo plan)
mkdir -p "$out"
out=$(cd "$out" && pwd)
started=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/realrl-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/realrl-site:$PWD"
fi
runs=/tmp/realrl-gpu-runs

command_of() {  # the command of one step, as words
  case $1 in
    env) echo "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader" ;;
    tests) echo "bash benchmarks/run_gpu_tests.sh $out" ;;
    rl_step) echo "python3 benchmarks/bench_rl_step.py --device cuda --model-size qwen2.5-0.5b" \
                  "--batch-size 64 --group-size 8 --max-new-tokens 512 --precisions bfloat16" \
                  "--max-tokens-per-microbatch 16384 --systems realrl-grpo,realrl-ppo,trl" \
                  "--modes fixed --repeats 1 --steps 3 --warmup 1 --work-dir $runs/rl_step" ;;
    decode512) echo "python3 benchmarks/bench_gpu_generation.py --batches 512 --new-tokens 128" \
                    "--repeats 2 --engines realrl_graphs,realrl_compiled --profile-engine ''" \
                    "--output $out/decode512.json" ;;
    lm_head) echo "python3 benchmarks/bench_lm_head_memory.py --device cuda --dtype bfloat16" \
                  "--preset qwen2.5-0.5b --num-seqs 64 --seq-len 140 --output $out/lm_head.json" ;;
    ppo) echo "bash benchmarks/run_gpu_ppo.sh $out/ppo 20 qwen2.5-0.5b" ;;
    plan) echo "python3 -m realrl.apps.profile_plan ppo-math n_devices_per_node=1" \
               "actor.dtype=bfloat16 --steps 4" ;;
    *) return 1 ;;
  esac
}

minimum_of() {  # seconds a step needs to be worth starting
  case $1 in
    env) echo 5 ;; tests) echo 60 ;; rl_step) echo 240 ;; decode512) echo 60 ;;
    lm_head) echo 30 ;; ppo) echo 120 ;; plan) echo 30 ;;
  esac
}

for step in "${steps[@]}"; do
  if ! command_of "$step" > /dev/null; then
    echo "unknown step '$step'; the steps are env tests rl_step decode512 lm_head ppo plan" >&2
    exit 2
  fi
done
status=0
for step in "${steps[@]}"; do
  cmd=$(command_of "$step")
  left=$(( budget - (SECONDS - started) ))
  if (( left < $(minimum_of "$step") )); then
    echo "$step: skipped, ${left} s of the budget left (it needs $(minimum_of "$step") s)" \
      | tee -a "$out/session.txt"
    continue
  fi
  step_started=$SECONDS
  {
    echo "\$ $cmd  ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    if [ "$step" = env ]; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 - <<'EOF'
import importlib
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{torch.cuda.get_device_name()}")
for name in ("transformers", "trl", "datasets", "accelerate", "megatron.core", "vllm",
             "flash_attn", "triton"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except Exception as error:  # an import that fails is the fact to record
        print(f"{name}: {type(error).__name__}: {error}")
EOF
    else
      # shellcheck disable=SC2086  # the command is words; '' is the empty argument
      eval timeout "$left" $cmd
    fi
    echo "exit code $?"
    echo "seconds $(( SECONDS - step_started ))"
  } > "$out/$step.txt" 2>&1
  code=$(sed -n 's/^exit code //p' "$out/$step.txt" | tail -1)
  [ "$code" = 0 ] || status=1
  [ "$step" = rl_step ] && cp "$runs/rl_step/results.json" "$out/rl_step.json" 2>/dev/null
  echo "$step: exit code $code in $(( SECONDS - step_started )) s" | tee -a "$out/session.txt"
done
exit $status
