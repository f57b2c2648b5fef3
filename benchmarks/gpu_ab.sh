#!/usr/bin/env bash
# On the GPU machine, from the checkout's root: the CUDA tests, then an A/B of one engine step (bk-mixopt through
# engine.backward) between this checkout's src and another (BASE_SRC, e.g. an older commit's src carried along),
# each arm in its own process, alternating, plus the non-private step once.
#   bash benchmarks/gpu_ab.sh OUT_DIR BASE_SRC [CONFIG ...]      (default config: gpt2-t100)
# Wheels for what the machine lacks (dp-accounting, dm-tree, pytest and its dependencies) travel in .whl/.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_ab.sh OUT_DIR BASE_SRC [CONFIG ...]}
base=${2:?usage: bash benchmarks/gpu_ab.sh OUT_DIR BASE_SRC [CONFIG ...]}
shift 2
configs=("${@:-gpt2-t100}")
mkdir -p "$out"
if ! python3 -c "import pytest, dp_accounting, tree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dptrain-site .whl/*.whl
  export PYTHONPATH=/tmp/dptrain-site${PYTHONPATH:+:$PYTHONPATH}
fi
site=${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
start=$(date +%s)
PYTHONPATH=$PWD/src${site:+:$site} python3 -m pytest -o addopts= -m cuda -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_precision.py 2>&1 | tail -15 | tee "$out/cuda-tests.txt"
tests=${PIPESTATUS[0]}
echo "CUDA tests: exit $tests in $(( $(date +%s) - start )) s" | tee -a "$out/cuda-tests.txt"
for config in "${configs[@]}"; do
  for rep in 1 2; do
    for side in new base; do
      src=$PWD/src; [ "$side" = base ] && src=$base
      PYTHONPATH=$src:$PWD/benchmarks${site:+:$site} python3 benchmarks/ab_step.py "$config" bk-mixopt \
        --device cuda --steps 20 --warmup 3 2>>"$out/ab-errors.txt" \
        | sed "s/^/{\"side\": \"$side\", \"rep\": $rep, \"result\": /; s/\$/}/" | tee -a "$out/ab-gpu.jsonl"
    done
  done
  PYTHONPATH=$PWD/src:$PWD/benchmarks${site:+:$site} python3 benchmarks/ab_step.py "$config" non-private \
    --device cuda --steps 20 --warmup 3 2>>"$out/ab-errors.txt" \
    | sed "s/^/{\"side\": \"non-private\", \"rep\": 1, \"result\": /; s/\$/}/" | tee -a "$out/ab-gpu.jsonl"
done
exit "$tests"
