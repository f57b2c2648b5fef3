#!/usr/bin/env python
"""The measured figures of docs/audit.md: the one-run audit on honest and broken runs.

    python benchmarks/audit_sweep.py                      # everything, ~10 minutes on 2 CPU cores
    python benchmarks/audit_sweep.py --sections design    # the simulated design sweep only (seconds)

Sections (each a table in benchmarks/results/audit.md, raw numbers in audit.json):

- ``design``: the audit's statistics on the *simulated* mechanism (Poisson-subsampled
  Gaussian on each canary's coordinate, no training): how often the ideal mechanism audits
  above its own epsilon (validity, 200 seeds), and, to choose the defaults, the bound at
  epsilon = 2 against the number of canaries and against (sample rate, steps).
- ``honest``: `dptrain audit` at its defaults (digits CNN, epsilon 2, 10,000 canaries,
  10 steps at q = 0.5, bk-mixopt), over seeds: the bound must stay <= epsilon.
- ``modes``: the same in all seven clipping modes.
- ``broken``: ``--noise-scale`` 0.3 (and 0.5, 0.7): the bound must exceed epsilon at 0.3;
  and runs with clipping switched off (run_audit's clipping_off: every clipping factor 1).
- ``curve``: bound against the claimed epsilon (0.5 ... 8) for noise scales 1, 0.5 and
  0.3; plotted to docs/audit.png.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import dptrain  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402  (after the path fallback above)
import torch  # noqa: E402

from dptrain import CLIPPING_MODES, accounting  # noqa: E402
from dptrain.audit import (  # noqa: E402
    AUDIT_DEFAULTS,
    epsilon_lower_bound,
    run_audit,
    subsampled_gaussian_scores,
)

SECTIONS = ("design", "honest", "modes", "broken", "curve")
RESULTS = ROOT / "benchmarks" / "results"


def simulated_bounds(canaries: int, sample_rate: float, steps: int, epsilon: float, seeds: int) -> list[float]:
    """The audit's bound on the ideal mechanism: each canary's coordinate is N(0, s^2) plus R
    in each step that samples it (if it is in), with s calibrated to ``epsilon``."""
    delta = AUDIT_DEFAULTS["delta"]
    sigma = accounting.calibrate_noise_multiplier(epsilon, delta, sample_rate, steps)
    out = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        included = rng.random(canaries) < 0.5
        sampled = (rng.random((steps, canaries)) < sample_rate) & included
        observed = sampled + sigma * rng.standard_normal((steps, canaries))
        scores = subsampled_gaussian_scores(observed, contribution=1.0, noise_std=sigma, sample_rate=sample_rate)
        out.append(epsilon_lower_bound(scores, included, delta=delta).epsilon)
    return out


def design(seeds: int) -> dict:
    rows = []
    d = AUDIT_DEFAULTS
    for canaries in (1000, 3000, 10_000, 30_000):
        rows.append(("canaries", canaries, d["sample_rate"], d["steps"]))
    for q, steps in ((1.0, 2), (0.5, 4), (0.5, 20), (0.25, 20), (0.1, 50), (0.05, 100), (0.02, 250)):
        rows.append(("sampling", d["canaries"], q, steps))
    out = []
    for epsilon in (1.0, 2.0, 4.0):  # validity: how often does the ideal mechanism audit above its epsilon?
        bounds = simulated_bounds(d["canaries"], d["sample_rate"], d["steps"], epsilon, 10 * seeds)
        out.append({"vary": f"validity at epsilon {epsilon:g}", "canaries": d["canaries"],
                    "sample_rate": d["sample_rate"], "steps": d["steps"], "epsilon": epsilon,
                    "mean": statistics.mean(bounds), "min": min(bounds), "max": max(bounds), "seeds": 10 * seeds,
                    "above_epsilon": sum(b > epsilon for b in bounds)})
        print(f"validity at epsilon {epsilon:g}: {out[-1]['above_epsilon']} of {10 * seeds} above, max "
              f"{out[-1]['max']:.3f}", flush=True)
    for what, canaries, q, steps in rows:
        bounds = simulated_bounds(canaries, q, steps, d["epsilon"], seeds)
        out.append({"vary": what, "canaries": canaries, "sample_rate": q, "steps": steps,
                    "mean": statistics.mean(bounds), "min": min(bounds), "max": max(bounds), "seeds": seeds})
        print(f"design: m={canaries} q={q} T={steps}: mean {out[-1]['mean']:.3f} min {out[-1]['min']:.3f}",
              flush=True)
    return {"rows": out}


def real(seed: int, clipping_off: bool = False, **options) -> dict:
    """One audit; ``clipping_off``: the engine clips at a threshold no gradient reaches (a broken run)."""
    row = run_audit(seed=seed, clipping_off=clipping_off, **options).to_dict()
    row["clipping_off"] = clipping_off
    print(f"{options}{' clipping off' if clipping_off else ''}: seed {seed}: epsilon {row['epsilon']:.3f}, "
          f"lower bound {row['epsilon_lower_bound']:.3f} ({row['wall_time_s']:.1f} s)", flush=True)
    return row


def write_markdown(results: dict, path: Path) -> None:
    commits = ", ".join(f"{name} {commit}" for name, commit in results.get("commits", {}).items())
    lines = [f"# Audit sweep\n\nHardware: {results['hardware']}; torch {results['torch']}; "
             f"commits: {commits}. Produced by `python benchmarks/audit_sweep.py`.\n"]
    if "design" in results:
        lines += ["## design (simulated mechanism, epsilon = 2 unless stated)\n",
                  "| varied | canaries | sample rate | steps | seeds | mean bound | min | max | above epsilon |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in results["design"]["rows"]:
            lines.append(f"| {r['vary']} | {r['canaries']} | {r['sample_rate']} | {r['steps']} | {r['seeds']} | "
                         f"{r['mean']:.3f} | {r['min']:.3f} | {r['max']:.3f} | {r.get('above_epsilon', '')} |")
        lines.append("")
    for name in ("honest", "modes", "broken", "curve"):
        if name not in results:
            continue
        lines += [f"## {name}\n", "| clipping mode | noise scale | seed | epsilon | lower bound | right / guesses | "
                  "wall time (s) |", "|---|---|---|---|---|---|---|"]
        for r in results[name]:
            mode = r["clipping_mode"] + (" (clipping off)" if r.get("clipping_off") else "")
            lines.append(f"| {mode} | {r['noise_scale']:g} | {r['seed']} | {r['epsilon']:.3f} | "
                         f"{r['epsilon_lower_bound']:.3f} | {r['correct_guesses']} / "
                         f"{r['guesses_in'] + r['guesses_out']} | {r['wall_time_s']:.1f} |")
        honest = [r for r in results[name] if r["noise_scale"] == 1 and not r.get("clipping_off")]
        bounds = [r["epsilon_lower_bound"] for r in honest]
        if bounds and name in ("honest", "modes"):  # runs at one epsilon
            lines.append(f"\nhonest runs: bound mean {statistics.mean(bounds):.3f}, min {min(bounds):.3f}, "
                         f"max {max(bounds):.3f}; above epsilon: "
                         f"{sum(r['epsilon_lower_bound'] > r['epsilon'] for r in honest)}"
                         f" of {len(bounds)}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    top = max(r["epsilon"] for r in curve)
    ax.plot([0, top], [0, top], color="gray", ls="--", lw=1, label="lower bound = claimed epsilon")
    styles = {1.0: ("tab:blue", "o", "honest (noise scale 1)"), 0.5: ("tab:orange", "s", "noise scale 0.5"),
              0.3: ("tab:red", "^", "noise scale 0.3")}
    for scale, (color, marker, label) in styles.items():
        rows = [r for r in curve if r["noise_scale"] == scale]
        if not rows:
            continue
        eps = sorted({r["epsilon"] for r in rows})
        means = [statistics.mean(r["epsilon_lower_bound"] for r in rows if r["epsilon"] == e) for e in eps]
        ax.plot(eps, means, color=color, marker=marker, label=label)
        ax.scatter([r["epsilon"] for r in rows], [r["epsilon_lower_bound"] for r in rows], color=color, s=12,
                   alpha=0.5)
    ax.set_xlabel("claimed epsilon (accountant, delta = 1e-5)")
    ax.set_ylabel("audited lower bound on epsilon (95 %)")
    ax.set_title("dptrain audit: digits CNN, 10,000 canaries, 10 steps at q = 0.5", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the honest section (default 10)")
    parser.add_argument("--design-seeds", type=int, default=20)
    parser.add_argument("--hardware", default=f"{platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} threads available", help="named in the results")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rewrite audit.md and the plot from benchmarks/results/audit.json")
    parser.add_argument("--commit", help="the code's commit, named in the results (default: git rev-parse HEAD)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as dptrain audit runs the digits CNN
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "audit.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.report_only:
        write_markdown(results, RESULTS / "audit.md")
        if "curve" in results:
            plot(results["curve"], ROOT / "docs" / "audit.png")
        return 0
    results.update({"hardware": args.hardware, "torch": torch.__version__})
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    results.setdefault("commits", {}).update({name: commit for name in args.sections})  # the code of each section
    started = time.perf_counter()
    if "design" in args.sections:
        results["design"] = design(args.design_seeds)
    if "honest" in args.sections:
        results["honest"] = [real(seed) for seed in range(args.seeds)]
    if "modes" in args.sections:
        results["modes"] = [real(seed, clipping_mode=mode) for mode in CLIPPING_MODES for seed in range(2)]
    if "broken" in args.sections:
        results["broken"] = [real(seed, noise_scale=scale) for scale in (0.3, 0.5, 0.7) for seed in range(3)]
        results["broken"] += [real(seed, clipping_off=True) for seed in range(3)]
    if "curve" in args.sections:
        results["curve"] = [real(seed, epsilon=eps, noise_scale=scale) for scale in (1.0, 0.5, 0.3)
                            for eps in (0.5, 1.0, 2.0, 4.0, 8.0) for seed in range(2)]
        plot(results["curve"], ROOT / "docs" / "audit.png")
    path.write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, RESULTS / "audit.md")
    print(f"done in {time.perf_counter() - started:.0f} s: {path}, {RESULTS / 'audit.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
