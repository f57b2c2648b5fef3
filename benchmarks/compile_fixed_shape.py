"""Fixed-shape Poisson batches and torch.compile: first-step and steady-state time, compiled vs eager.

One arm per process (``--arm {eager,compiled} --batches {poisson,fixed}``); prints one JSON line with the
time of each step and the number of compilations. With Poisson batches every new batch size recompiles;
with ``poisson_loader(..., max_batch_size=K)`` the shapes are fixed and the step compiles once.

    PYTHONPATH=src python benchmarks/compile_fixed_shape.py --arm compiled --batches fixed
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dptrain
from dptrain.data import FixedShapeBatch, poisson_loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", choices=["eager", "compiled"], required=True)
    parser.add_argument("--batches", choices=["poisson", "fixed"], required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, q_batch, k = 4096, 64, 96
    data = TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,)))
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    fixed = args.batches == "fixed"
    engine = dptrain.PrivacyEngine(model, batch_size=q_batch, sample_size=n, noise_multiplier=1.0, seed=0,
                                   max_batch_size=k if fixed else None)
    loader = poisson_loader(data, batch_size=q_batch, steps=args.steps, generator=torch.Generator().manual_seed(1),
                            max_batch_size=k if fixed else None)
    engine.attach(optimizer, data_loader=loader)
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return torch._dynamo.lookup_backend(args.backend)(gm, example_inputs)

    def losses_of(x, y, mask):
        return F.cross_entropy(model(x), y, reduction="none")

    step_losses = torch.compile(losses_of, backend=counting, dynamic=False) if args.arm == "compiled" else losses_of
    times = []
    for batch in loader:
        (x, y), mask = batch if isinstance(batch, FixedShapeBatch) else (batch, torch.ones(len(batch[0]), dtype=torch.bool))
        start = time.perf_counter()
        engine.backward(step_losses(x, y, mask), mask=mask)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    print(json.dumps({"arm": args.arm, "batches": args.batches, "first_s": round(times[0], 4),
                      "steady_median_s": round(statistics.median(times[4:]), 5), "compilations": len(compiles),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
