"""What evaluating a model costs with a PrivacyEngine attached, against the same model without one (issue 31).

Forward passes only (no backward), as in a training loop's evaluation: after two private training steps, under
``torch.no_grad()``, and in ``eval()`` mode with gradients enabled. The two models are identical copies; the figures
are the minimum over rounds of the mean forward time, the rounds alternating between the two so that load from other
processes hits both alike. One torch thread.

    python benchmarks/eval_cost.py [--model tiny|resnet18] [--rounds 5]

``tiny``: 6 Linear(64, 64) + LayerNorm, batch 32 (the engine's hooks dominate: its per-layer cost shows);
``resnet18``: torchvision's ResNet-18 with GroupNorm at 64x64, batch 16.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
import warnings

import torch
from torch import nn


def _build(name: str):
    if name == "tiny":
        layers = []
        for _ in range(6):
            layers += [nn.Linear(64, 64), nn.LayerNorm(64)]
        return nn.Sequential(*layers), torch.randn(32, 64)
    import torchvision

    model = torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))
    return model, torch.randn(16, 3, 64, 64)


def _mean_forward(model, x, context, n: int) -> float:
    for _ in range(max(2, n // 10)):
        with context():
            model(x)
    start = time.perf_counter()
    for _ in range(n):
        with context():
            model(x)
    return (time.perf_counter() - start) / n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "resnet18"), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import dptrain

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    plain, x = _build(args.model)
    private = copy.deepcopy(plain)
    engine = dptrain.PrivacyEngine(private, batch_size=len(x), sample_size=1000, noise_multiplier=1.0,
                                   max_grad_norm=1.0)
    optimizer = torch.optim.SGD(private.parameters(), lr=0.0)
    engine.attach(optimizer)
    for _ in range(2):  # (training steps first: the forward's trace is verified, as in a training loop)
        out = private(x)
        engine.backward(out.reshape(len(x), -1).square().mean(1))
        optimizer.step()
        optimizer.zero_grad()
    n = 300 if args.model == "tiny" else 10
    out = {"model": args.model, "torch": torch.__version__}
    for label, context in (("no_grad", torch.no_grad), ("eval with gradients", contextlib.nullcontext)):
        plain.eval(), private.eval()
        rounds = [(_mean_forward(plain, x, context, n), _mean_forward(private, x, context, n))
                  for _ in range(args.rounds)]
        without, with_engine = min(r[0] for r in rounds), min(r[1] for r in rounds)
        out[label] = {"without_ms": round(without * 1e3, 3), "with_engine_ms": round(with_engine * 1e3, 3),
                      "ratio": round(with_engine / without, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
