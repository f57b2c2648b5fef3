#!/usr/bin/env bash
# The GPU preset in one call (see benchmarks/README.md): installs the wheels carried in .whl/ where
# Opacus, dp-accounting or dm-tree are missing, then runs `dptrain bench --preset gpu-quick`.
#   bash benchmarks/gpu_quick.sh OUT_DIR [COMMIT] [more dptrain bench options, e.g. --configs vit-224]
set -euo pipefail
out=${1:?usage: bash benchmarks/gpu_quick.sh OUT_DIR [COMMIT] [options]}
commit=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
shift $(( $# >= 2 ? 2 : 1 ))
if ! python3 -c "import opacus, dp_accounting, tree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dptrain-site .whl/*.whl
  export PYTHONPATH=/tmp/dptrain-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DPTRAIN_BENCH_COMMIT=$commit
mkdir -p "$out"
python3 -m dptrain_bench --preset gpu-quick --out "$out" "$@" 2>&1 | tee "$out/log.txt"
