#!/usr/bin/env bash
# Issue 43's GPU table in one device call (benchmarks/README.md, "Issue 43's GPU table"): every row, each arm in its
# own process, within a 330 s budget counted from this script's start (give the call timeout_s 360). From the
# checkout's root on the GPU machine, results under OUT_DIR: gpu-table.json, gpu-table.md, log.txt, jobs-log.txt.
#   bash benchmarks/gpu_table.sh OUT_DIR [COMMIT] [options of python -m dptrain_bench.gpu_table: --only ..., --list]
#   bash benchmarks/gpu_table.sh OUT_DIR --dry-run     # the same on the CPU with tiny stand-ins (no GPU needed)
# Wheels for what the GPU machine lacks (opacus, dp-accounting, dm-tree) travel in .whl/; fastDP's source, where
# provided, in .fastdp/fastDP/ (or name its folder in FASTDP_DIR).
set -uo pipefail
GPU_TABLE_T0=$(date +%s.%N)
export GPU_TABLE_T0
out=${1:?usage: bash benchmarks/gpu_table.sh OUT_DIR [COMMIT] [options]}
shift
if [ $# -ge 1 ] && [[ $1 != -* ]]; then
  commit=$1
  shift
else
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
mkdir -p "$out"
if ! python3 -c "import opacus, dp_accounting, tree" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dptrain-site .whl/*.whl
  export PYTHONPATH=/tmp/dptrain-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "${FASTDP_DIR:-}" ] && [ -f .fastdp/fastDP/__init__.py ]; then
  export FASTDP_DIR=$PWD/.fastdp
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DPTRAIN_BENCH_COMMIT=$commit
if ! python3 -c "import dptrain" 2>"$out/log.txt"; then
  echo "gpu_table.sh: dptrain cannot be imported here (carry .whl with dp-accounting and dm-tree: benchmarks/README.md)"
  tail -3 "$out/log.txt"
  exit 2
fi
python3 -m dptrain_bench.gpu_table --out "$out" "$@" 2>&1 | tee "$out/log.txt"
