#!/usr/bin/env bash
# Everything that needs a GPU, in one call of under 10 minutes, from the checkout's root on the GPU machine:
# the CUDA tests (python -m pytest -m cuda), then the short GPU benchmark (benchmarks/gpu_quick.sh).
#   bash benchmarks/gpu_check.sh OUT_DIR [COMMIT]
# Wheels for what the machine lacks (dp-accounting, dm-tree, Opacus, pytest and its dependencies) travel in .whl/
# (benchmarks/README.md says how to download them).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [COMMIT]}
commit=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$out"
if ! python3 -c "import pytest, dp_accounting, tree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dptrain-site .whl/*.whl
  export PYTHONPATH=/tmp/dptrain-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
python3 -m pytest -o addopts= -m cuda -q -p no:cacheprovider tests/test_cuda.py tests/test_precision.py 2>&1 | tee "$out/cuda-tests.txt"
tests=${PIPESTATUS[0]}
echo "CUDA tests: exit $tests in $(( $(date +%s) - start )) s" | tee -a "$out/cuda-tests.txt"
bash benchmarks/gpu_quick.sh "$out" "$commit"
bench=$?
exit $(( tests != 0 ? tests : bench ))
