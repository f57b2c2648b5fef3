#!/usr/bin/env bash
# On the GPU machine, from the checkout's root: the CUDA tests, then benchmarks/gpu_profile.py over the GPU preset's
# rows (each arm in its own process; fp32, and bf16 autocast for the two CNNs), summaries appended to OUT/profile.txt,
# one JSON line per arm in OUT/profile.jsonl, Chrome traces of the CNNs' bk-mixopt step in OUT/trace-*.json.gz.
#   bash benchmarks/gpu_profile.sh OUT_DIR [SRC]        (SRC: the dptrain sources to profile, default ./src)
# Wheels for what the machine lacks (dp-accounting, dm-tree, pytest and its dependencies) travel in .whl/.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_profile.sh OUT_DIR [SRC]}
src=${2:-$PWD/src}
mkdir -p "$out"
if ! python3 -c "import pytest, dp_accounting, tree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dptrain-site .whl/*.whl
  export PYTHONPATH=/tmp/dptrain-site${PYTHONPATH:+:$PYTHONPATH}
fi
site=${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; } | tee "$out/profile.txt"
start=$(date +%s)
PYTHONPATH=$src${site:+:$site} python3 -m pytest -o addopts= -m cuda -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_precision.py 2>&1 | tail -15 | tee "$out/cuda-tests.txt"
tests=${PIPESTATUS[0]}
echo "CUDA tests: exit $tests in $(( $(date +%s) - start )) s" | tee -a "$out/cuda-tests.txt"
run() {  # CONFIG ARM AMP [--trace FILE]
  PYTHONPATH=$src:$PWD/benchmarks${site:+:$site} timeout 150 python3 benchmarks/gpu_profile.py "$1" "$2" --amp "$3" \
    --steps 8 --profile-steps 2 --out "$out/profile.txt" "${@:4}" 2>>"$out/profile-errors.txt" \
    | grep '^{' | tee -a "$out/profile.jsonl"
}
for config in resnet18-gn-224-b128 vgg11-gn-224; do
  run "$config" non-private none
  run "$config" bk-mixopt none --trace "$out/trace-$config.json.gz"
done
for config in gpt2-t100 vit-224; do
  run "$config" non-private none
  run "$config" bk-mixopt none
done
for config in resnet18-gn-224-b128 vgg11-gn-224; do
  run "$config" non-private bf16
  run "$config" bk-mixopt bf16
done
echo "all in $(( $(date +%s) - start )) s" | tee -a "$out/profile.txt"
exit "$tests"
