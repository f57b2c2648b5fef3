#!/usr/bin/env python
"""When BLT fits: a BLT run's expected error against DP-SGD's at the same epsilon, with and without cyclic groups.

    python benchmarks/blt_fit.py          # ~3 min on a busy 2-core CPU (the BLT optimizations; cached after)

For each setting the engine is built as a user builds it (``PrivacyEngine(..., noise="blt", cyclic_groups=g,
target_epsilon=3, steps=T)``, delta = 1 / (10 N)) and compared with DP-SGD at the epsilon it spends
(``dptrain.correlated.compare_with_dp_sgd``: the mean squared error of the trajectory per R^2). The table goes to
benchmarks/results/blt-fit.md; docs/correlated-noise.md ("When BLT fits") quotes it.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import dptrain  # noqa: E402
from dptrain import accounting  # noqa: E402
from dptrain.correlated import CorrelatedNoiseWarning, compare_with_dp_sgd  # noqa: E402

EPSILON = 3.0
# (sample size N, expected batch B, steps, cyclic groups): without groups, and with N / B groups (each unit once
# per epoch), over one to twenty epochs
SETTINGS = [
    (1000, 50, 12, 1), (1000, 50, 12, 20), (1000, 50, 100, 1), (1000, 50, 100, 20), (1000, 50, 400, 1),
    (1000, 50, 400, 20), (10000, 100, 100, 1), (10000, 100, 100, 100), (10000, 100, 300, 100),
    (100000, 100, 1000, 1), (100000, 100, 1000, 1000), (100000, 100, 3000, 1000),
]


def row(sample_size: int, batch_size: int, steps: int, groups: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CorrelatedNoiseWarning)  # the table says it
        engine = dptrain.PrivacyEngine(torch.nn.Linear(2, 2), batch_size=batch_size, sample_size=sample_size,
                                       noise="blt", cyclic_groups=groups, target_epsilon=EPSILON, steps=steps)
    q = batch_size / sample_size
    found = compare_with_dp_sgd(engine.config.mechanism, engine.noise_multiplier, inclusion_rate=q,
                                delta=engine.target_delta, accountant=engine.accountant.name)
    dp_sgd = accounting.calibrate_noise_multiplier(found.epsilon, engine.target_delta, q, steps)
    dp_sgd_error = found.expected_error * (dp_sgd / found.dp_sgd_noise_multiplier_at_same_error) ** 2
    epochs = steps * q
    participations = engine.config.mechanism.participations(steps)
    return (f"| {sample_size} | {batch_size} | {steps} ({epochs:g} epoch{'' if epochs == 1 else 's'}) | {groups} | "
            f"{participations} | "
            f"{engine.noise_multiplier:.3g} | {dp_sgd:.3g} | {found.expected_error / dp_sgd_error:.3g} |")


def main() -> None:
    lines = [f"# When BLT fits: epsilon {EPSILON:g}, delta 1/(10 N), pld accountant (benchmarks/blt_fit.py)", "",
             "| N | B | steps | cyclic groups | participations | BLT sigma | DP-SGD sigma | BLT error / DP-SGD's |",
             "|---|---|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        lines.append(row(*setting))
        print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "blt-fit.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
