#!/usr/bin/env bash
# Issue 36's open questions in one device call (about 5 minutes; timeout_s 420), from the checkout's root on the GPU
# machine, results under OUT_DIR: the CUDA tests with their tracebacks, then benchmarks/gpu_diag.py on what the
# 2026-11-27 runs left open (benchmarks/results/gpu-notes.md), then the steady steps of the preset's rows, each arm in
# its own process, for the table before and after.
# The two-pass failures and the bf16 re-reading were torch 2.11's short-lived node objects (found on the CPU with torch
# 2.11 installed, fixed: rows.proof.call_edge): the CUDA tests and the diagnostics below confirm it on the device.
#   bash benchmarks/gpu_next.sh OUT_DIR
# Wheels for what the machine lacks (dp-accounting, dm-tree, pytest and its dependencies) travel in .whl/.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_next.sh OUT_DIR}
mkdir -p "$out"
if ! python3 -c "import pytest, dp_accounting, tree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dptrain-site .whl/*.whl
  export PYTHONPATH=/tmp/dptrain-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
python3 -m pytest -o addopts= -m cuda -q -p no:cacheprovider --tb=short tests/test_cuda.py tests/test_precision.py \
  > "$out/cuda-tests.txt" 2>&1
echo "CUDA tests: exit $? in $(( $(date +%s) - start )) s" | tee -a "$out/cuda-tests.txt"
tail -14 "$out/cuda-tests.txt"
diag() { timeout 90 python3 benchmarks/gpu_diag.py "$@" 2>&1 | grep -v "^USDT\|SyncActivity\|Warning\|warn" >> "$out/diag.txt"; }
for mode in ghost mix-ghost fast-grad-clip bk-mixopt; do diag case transformer "$mode" --rowmaps --repeat 3; done
diag case transformer ghost --deterministic --repeat 2  # (a nondeterministic kernel, or the engine?)
CUDA_LAUNCH_BLOCKING=1 diag case transformer ghost --repeat 2  # (a race between streams or with the host?)
diag oom bk-mixopt
diag steps resnet18-gn-224-b128 --amp bf16
diag steps gpt2-t100 --profiled
echo "diagnostics done at $(( $(date +%s) - start )) s" | tee -a "$out/diag.txt"
# the host time of a 12-layer GPT-2's training forward: the watch's logic, the hooks and dispatch, the model alone
# (2026-11-27, CPU, results/gpu-notes.md: the watch's logic 5.5 -> 4.0-4.5 ms of a 22-23 ms forward, the model
# alone 8.9-9.4 ms)
timeout 60 python3 benchmarks/host_cost.py --device cuda --rounds 20 2>/dev/null | grep '^{' | tee -a "$out/timings.jsonl"
t() { timeout 90 python3 benchmarks/gpu_profile.py "$@" --profile-steps 0 --out "$out/timings.txt" 2>/dev/null \
        | grep '^{' | tee -a "$out/timings.jsonl"; }
for config in resnet18-gn-224-b128 vgg11-gn-224 gpt2-t100 vit-224; do
  t "$config" non-private
  t "$config" bk-mixopt
done
t resnet18-gn-224-b128 bk-mixopt --amp bf16 --steps 4
t resnet18-gn-224-b128 non-private --amp bf16 --steps 4
# last (a timeout cuts only this): GPT-2's kernels per step after the step's foreach noise and the factors' stacked
# sums (2026-11-27, CPU: 3,161 -> 2,426 operations a step; the GPU profile before: 3,263 kernels, 1,184 of them noise)
timeout 120 python3 benchmarks/gpu_profile.py gpt2-t100 bk-mixopt --steps 3 --profile-steps 2 \
  --out "$out/profile-gpt2.txt" 2>/dev/null | grep '^{' | tee -a "$out/timings.jsonl"
echo "all done at $(( $(date +%s) - start )) s"
