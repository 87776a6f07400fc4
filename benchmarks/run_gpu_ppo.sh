#!/usr/bin/env bash
# ppo-math on one CUDA GPU from the source tree: GRPO and PPO (actor, critic, reference, rule
# reward, every role colocated on the GPU) on the built-in tiny model and on a
# Qwen2.5-0.5B-shaped model (random weights, written by benchmarks/bench_setup.py), keeping
# each run's console output and metrics.
#
#   bash benchmarks/run_gpu_ppo.sh [OUTPUT_DIR (benchmarks/results)] [STEPS (20)] [SIZES] [ALGOS]
#
# SIZES defaults to "tiny qwen2.5-0.5b", ALGOS to "grpo ppo". Installs `.whl/` like run_gpu_tests.sh. Each run
# writes OUTPUT_DIR/gpu_ppo_<size>_<algo>.txt (console, then the worker's log tail) and
# OUTPUT_DIR/gpu_ppo_<size>_<algo>.jsonl (metrics); runs go under /tmp/realrl-gpu-runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
steps=${2:-20}
sizes=${3:-"tiny qwen2.5-0.5b"}
algos=${4:-"grpo ppo"}
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/realrl-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/realrl-site:$PWD"
fi
runs=/tmp/realrl-gpu-runs
status=0
for size in $sizes; do
  model=()
  scale=(dataset.batch_size=8 group_size=8)
  if [ "$size" != tiny ]; then
    python3 benchmarks/bench_setup.py "/tmp/realrl-gpu-models/$size" --size "$size" || exit 1
    model=(actor.path="/tmp/realrl-gpu-models/$size" dtype=bfloat16 gen.max_new_tokens=128
           ppo.entropy_coef=0.01)  # random weights earn no reward: no advantage without it
  fi
  for algo in $algos; do
    extra=()
    [ "$algo" = grpo ] && extra=(ppo.disable_value=true ppo.adv_estimator=grpo)
    name="gpu_ppo_${size}_${algo}"
    {
      echo "\$ python3 -m realrl.apps.quickstart ppo-math ${model[*]} ${scale[*]} ${extra[*]}" \
        "total_train_steps=$steps n_devices_per_node=1  ($(date -u +%Y-%m-%dT%H:%M:%SZ)," \
        "$(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
      timeout 280 python3 -m realrl.apps.quickstart ppo-math "${model[@]}" "${scale[@]}" \
        "${extra[@]}" total_train_steps="$steps" n_devices_per_node=1 wandb.mode=disabled \
        output_root="$runs" trial_name="${size}_${algo}" save_freq_steps=0
      code=$?
      echo "exit code $code"
      echo "--- worker0.log, last 40 lines"
      tail -40 "$runs/ppo-math/${size}_${algo}/logs/worker0.log"
    } > "$out/$name.txt" 2>&1
    grep -q "^exit code 0$" "$out/$name.txt" || status=1
    cp "$runs/ppo-math/${size}_${algo}/metrics.jsonl" "$out/$name.jsonl" 2>/dev/null
    echo "$name: $(grep '^exit code' "$out/$name.txt")"
  done
done
exit $status
