#!/usr/bin/env python
"""Correlated noise against DP-SGD at the same epsilon: test accuracy on digits, held-out loss of the LM example.

    nice -n 10 python benchmarks/correlated_noise.py            # the committed grid (~40 min on a busy 2-core CPU)
    python benchmarks/correlated_noise.py --seeds 1 --only digits-256

Each arm is one configuration, run over seeds; DP-SGD (noise "gaussian") and BandMF ("bandmf", b bands, cyclic
Poisson sampling over b groups) share everything else: the hyperparameters of `dptrain train` (tuned for DP-SGD,
docs/cli.md) and of examples/user_level_lm.py, the target epsilon, delta and number of steps. Every finished run is
appended to benchmarks/results/correlated-noise.jsonl (a rerun skips what is there); the summary table goes to
correlated-noise.md and the plot to correlated-noise.png.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
JSONL = RESULTS / "correlated-noise.jsonl"

# (task, setting, arm label, arguments)
DIGITS_256 = ["--epsilon", "3"]  # the defaults: batch 256, 15 epochs of 6 steps (84 steps)
DIGITS_64 = ["--epsilon", "3", "--batch-size", "64"]  # 15 epochs of 22 steps (330 steps)
# plain SGD, the workload the strategies are optimized for; lr 0.5 is DP-SGD's best of 0.25, 0.5, 1, 2 (seed 0)
DIGITS_64_SGD = [*DIGITS_64, "--optimizer", "sgd", "--lr", "0.5"]
ARMS = [
    ("digits", "digits-256", "DP-SGD", DIGITS_256),
    ("digits", "digits-256", "BandMF auto", [*DIGITS_256, "--noise", "bandmf", "--bands", "auto"]),
    ("digits", "digits-256", "BandMF b=4", [*DIGITS_256, "--noise", "bandmf", "--bands", "4"]),
    ("digits", "digits-64", "DP-SGD", DIGITS_64),
    ("digits", "digits-64", "BandMF auto", [*DIGITS_64, "--noise", "bandmf", "--bands", "auto"]),
    ("digits", "digits-64", "BandMF b=8", [*DIGITS_64, "--noise", "bandmf", "--bands", "8"]),
    ("digits", "digits-64-sgd", "DP-SGD", DIGITS_64_SGD),
    ("digits", "digits-64-sgd", "BandMF auto", [*DIGITS_64_SGD, "--noise", "bandmf", "--bands", "auto"]),
    ("lm", "lm", "DP-SGD", []),
    ("lm", "lm", "BandMF auto", ["--noise", "bandmf", "--bands", "auto"]),
    ("lm", "lm", "BandMF b=4", ["--noise", "bandmf", "--bands", "4"]),
]
SEEDS = {"digits-256": 5, "digits-64": 3, "digits-64-sgd": 3, "lm": 3}


def run_digits(args: list[str], seed: int) -> dict:
    from dptrain.cli import main

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        status = main(["train", *args, "--seed", str(seed), "--output", folder])
        if status != 0:
            raise RuntimeError(f"dptrain train {args} --seed {seed} failed with status {status}")
        report = json.loads((Path(folder) / "report.json").read_text())
    return {"metric": "test_accuracy", "value": report["test_accuracy"], "epsilon": report["epsilon"],
            "noise_multiplier": report["noise_multiplier"], "steps": report["steps"], "bands": report["bands"],
            "wall_time_s": report["wall_time_s"]}


def run_lm(args: list[str], seed: int) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    import user_level_lm

    out = user_level_lm.main([*args, "--seed", str(seed), "--quiet"])
    return {"metric": "held_out_loss", "value": out["held_out_loss"], "epsilon": out["epsilon"],
            "noise_multiplier": out["noise_multiplier"], "steps": out["steps"], "bands": out["bands"],
            "wall_time_s": out["seconds"]}


def load() -> list[dict]:
    return [json.loads(line) for line in JSONL.read_text().splitlines()] if JSONL.exists() else []


def summarize(rows: list[dict]) -> str:
    lines = ["| setting | arm | bands | metric | mean | sd | seeds | vs DP-SGD, same seed | epsilon | noise multiplier "
             "| steps |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["setting"], r["seed"]): r["value"] for r in rows if r["arm"] == "DP-SGD"}
    for _, setting, label, _ in ARMS:
        runs = [r for r in rows if r["setting"] == setting and r["arm"] == label]
        if not runs:
            continue
        values = [r["value"] for r in runs]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        args = runs[0]["args"]
        bands = runs[0].get("bands") or (int(args[args.index("--bands") + 1]) if "--bands" in args else 1)
        paired = [r["value"] - base[(setting, r["seed"])] for r in runs if (setting, r["seed"]) in base]
        difference = "" if label == "DP-SGD" or not paired else (
            f"{statistics.mean(paired):+.4f} ({', '.join(f'{d:+.3f}' for d in paired)})")
        lines.append(f"| {setting} | {label} | {bands} | {runs[0]['metric']} | {statistics.mean(values):.4f} | "
                     f"{sd:.4f} | {len(runs)} | {difference} | {max(r['epsilon'] for r in runs):.3f} | "
                     f"{runs[0]['noise_multiplier']:.3f} | {runs[0]['steps']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    settings = [s for s in dict.fromkeys(a[1] for a in ARMS) if any(r["setting"] == s for r in rows)]
    fig = Figure(figsize=(4 * len(settings), 3.6), layout="constrained")
    axes = fig.subplots(1, len(settings), squeeze=False)[0]
    for ax, setting in zip(axes, settings):
        labels = [a[2] for a in ARMS if a[1] == setting]
        for i, label in enumerate(labels):
            values = [r["value"] for r in rows if r["setting"] == setting and r["arm"] == label]
            if not values:
                continue
            ax.scatter([i] * len(values), values, color="tab:blue" if i == 0 else "tab:orange", alpha=0.6)
            ax.set_xticks(range(len(labels)), labels, fontsize=8)
            ax.errorbar(i + 0.15, statistics.mean(values), yerr=statistics.stdev(values) if len(values) > 1 else 0,
                        fmt="s", color="black", capsize=4)
        metric = next(r["metric"] for r in rows if r["setting"] == setting)
        epsilon = max(r["epsilon"] for r in rows if r["setting"] == setting)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_ylabel(metric.replace("_", " ") + (" (higher is better)" if metric == "test_accuracy"
                                                  else " (lower is better)"))
        ax.set_title(f"{setting}, epsilon {epsilon:.2g}")
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, help="seeds per arm (default: the committed counts)")
    parser.add_argument("--only", help="one setting: digits-256, digits-64, digits-64-sgd or lm")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    done = {(r["setting"], r["arm"], r["seed"]) for r in load()}
    for task, setting, label, arm_args in ARMS:
        if args.only and setting != args.only:
            continue
        for seed in range(args.seeds or SEEDS[setting]):
            if (setting, label, seed) in done:
                continue
            started = time.perf_counter()
            result = (run_digits if task == "digits" else run_lm)(arm_args, seed)
            row = {"task": task, "setting": setting, "arm": label, "seed": seed, "args": arm_args, **result,
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), 1 thread",
                   "torch": torch.__version__}
            with JSONL.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{setting:11s} {label:12s} seed {seed}: {result['metric']} {result['value']:.4f} "
                  f"(epsilon {result['epsilon']:.3f}, {time.perf_counter() - started:.0f} s)", flush=True)
    rows = load()
    (RESULTS / "correlated-noise.md").write_text(
        "# Correlated noise (BandMF) against DP-SGD at the same epsilon\n\n"
        "Written by `benchmarks/correlated_noise.py`; every run in `correlated-noise.jsonl`, the plot in "
        "`correlated-noise.png`. Same hyperparameters for both arms of a setting (tuned for DP-SGD); machine: a 2-core "
        "CPU shared with other jobs, one thread.\n\n"
        + summarize(rows) + "\n")
    plot(rows, RESULTS / "correlated-noise.png")


if __name__ == "__main__":
    main()
