"""The ``dptrain bench`` options, torch-free so that ``dptrain bench --help`` answers at once."""
from __future__ import annotations

import argparse
from pathlib import Path

from dptrain.core.algorithms import CLIPPING_MODES

NON_PRIVATE = "non-private"
OPACUS_ARMS = ("opacus-hooks", "opacus-ghost")
ALL_ARMS = (NON_PRIVATE, *CLIPPING_MODES, *OPACUS_ARMS)
FASTDP_ARM = "fastdp-mixopt"  # issue 43's GPU table only (benchmarks/dptrain_bench/gpu_table.py): needs FASTDP_DIR
SCALES = ("cpu", "full")
PRESET_NAMES = ("gpu-quick",)  # presets.PRESETS holds them


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dptrain bench",
        description="Time and memory of dptrain's clipping modes against non-private training and Opacus.")
    p.add_argument("--preset", choices=PRESET_NAMES, default=None,
                   help="a fixed plan within a time budget: gpu-quick = the GPU table (5 rows, largest batches) "
                        "in under 6 minutes on one GPU; see --dry-run")
    p.add_argument("--dry-run", action="store_true", help="with --preset: print its plan and time budget, run nothing")
    p.add_argument("--scale", choices=SCALES, default=None,
                   help="model sizes: 'full' (the papers' sizes, for a GPU) or 'cpu' (scaled down); "
                        "default: full with CUDA, cpu without")
    p.add_argument("--configs", nargs="+", metavar="NAME",
                   help="configurations to run, in order (default: all of the scale; see --list)")
    p.add_argument("--arms", nargs="+", metavar="ARM", default=None,
                   help=f"what to compare (default: all): {', '.join(ALL_ARMS)}")
    p.add_argument("--no-opacus", action="store_true", help="leave out the Opacus arms")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: the CPU cores available to this process)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (default: per configuration)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm (default: per configuration)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed to each worker process")
    p.add_argument("--mem-limit-gb", type=float, default=None,
                   help="CPU: address-space cap per worker, so an arm that needs more fails cleanly "
                        "(default: half the available memory)")
    p.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE", "default"), default="PASSIVE",
                   help="CPU workers' OpenMP wait policy (default PASSIVE: spinning threads starve each other "
                        "when other processes share the cores)")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each configuration, wait until the 1-minute load average is at most this")
    p.add_argument("--max-wait", type=float, default=1800, help="longest wait for --max-load, in seconds")
    p.add_argument("--max-batch-cap", type=int, default=4096, help="GPU: largest batch tried by the bisection")
    p.add_argument("--no-max-batch", action="store_true", help="GPU: skip the largest-batch search")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: a new folder ./dptrain-bench-<UTC date and time>)")
    p.add_argument("--publish", action="store_true",
                   help="write into the checkout's benchmarks/results/, replacing the committed <tag>.* files")
    p.add_argument("--tag", default=None, help="output file name stem (default: cpu or gpu)")
    p.add_argument("--resume", action="store_true",
                   help="keep configurations already in <out>/<tag>.json (needs --out or --publish)")
    p.add_argument("--notes", type=Path, default=None, help="a Markdown file appended to the report as notes")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the reports from <out>/<tag>.json (needs --out or --publish)")
    p.add_argument("--list", action="store_true", help="list the configurations of the scale and exit")
    return p
