"""What the framework integration tests share: the logical batches the specification draws, the float64 oracle
over them (one step's gradient, or a few SGD steps), and the tolerance that bf16 / fp16 explain.

The specification of a step's batch is the single-process draw, ``dptrain.data.PoissonSampler`` with the same
seed and K; the integrations share it out to micro-batches and processes, and the union must be it.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.data import PoissonSampler
from dptrain.testing import per_sample_gradients, reference_clipped_gradient, trainable_named_parameters

FEATURES, CLASSES = 5, 3


class Classifier(nn.Module):
    """The small model of the Accelerate and Lightning tests: linear, LayerNorm, linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.ln(self.fc1(x))))


def build_classifier(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return Classifier().to(dtype)


def classifier_columns(n: int = 16, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of ``n`` examples; the same values in every dtype."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randint(0, CLASSES, (n,), generator=g)


def classifier_losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def logical_batches(num_samples: int, batch_size: int, K: int | None, seed: int, steps: int,
                    steps_per_epoch: int | None = None) -> list[list[int]]:
    """The indices of the first ``steps`` logical batches a seeded integration loader draws."""
    sampler = PoissonSampler(num_samples, batch_size / num_samples, steps=steps_per_epoch,
                             generator=torch.Generator().manual_seed(seed), max_batch_size=K)
    out: list[list[int]] = []
    while len(out) < steps:
        out.extend(sampler)
    return out[:steps]


def take(columns: tuple, indices: list[int]) -> tuple:
    index = torch.tensor(indices, dtype=torch.long)
    return tuple(c[index] for c in columns)


def oracle_step(model: nn.Module, losses_fn, columns: tuple, indices: list[int], R: float,
                batch_size: int) -> dict[str, torch.Tensor]:
    """The private gradient at noise 0: the oracle's clipped sum over the batch, divided by the expected size."""
    if not indices:
        return {n: torch.zeros_like(p) for n, (_, p) in trainable_named_parameters(model).items()}
    ref = reference_clipped_gradient(model, losses_fn, take(columns, indices), max_grad_norm=R)
    return {n: g / batch_size for n, g in ref.items()}


def oracle_sgd(model: nn.Module, losses_fn, columns: tuple, batches: list[list[int]], R: float, batch_size: int,
               lr: float) -> dict[str, torch.Tensor]:
    """The parameters after plain SGD at ``lr`` on the oracle's private gradients (noise 0), batch by batch."""
    model = copy.deepcopy(model)
    named = dict(model.named_parameters())
    for indices in batches:
        grads = oracle_step(model, losses_fn, columns, indices, R, batch_size)
        with torch.no_grad():
            for name, g in grads.items():
                named[name].sub_(lr * g)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def precision_bounds(model: nn.Module, losses_fn, batch: tuple, R: float, dtype: torch.dtype) -> dict[str, float]:
    """Per parameter, what the precision explains (tests/test_precision.py's bound): the error, relative to the
    parameter's largest float64 oracle entry, of plain PyTorch under ``torch.autocast("cpu", dtype)`` forming the
    same clipped sum (A: one sample at a time, clipped with the oracle's factors; B: one backward of
    ``sum_i C_i L_i``), as ``2 * max(A, B) + 2^-9``. ``model`` is the float64 model; the copy runs in float32."""
    grads64 = per_sample_gradients(model, losses_fn, batch)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads64.values()))
    factors = torch.clamp(R / norms, max=1.0)
    ref = {n: (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) for n, g in grads64.items()}
    low = copy.deepcopy(model).float()
    batch32 = tuple(t.float() if t.is_floating_point() else t for t in batch)
    named = trainable_named_parameters(low)
    params = [p for _, p in named.values()]
    plain_a = {n: torch.zeros_like(ref[n]) for n in ref}
    for i in range(len(factors)):
        with torch.autocast("cpu", dtype=dtype):
            loss = losses_fn(low, *(t[i:i + 1] for t in batch32)).sum()
        for n, g in zip(named, torch.autograd.grad(loss, params, allow_unused=True)):
            if g is not None:
                plain_a[n] += factors[i] * g.double()
    with torch.autocast("cpu", dtype=dtype):
        losses = losses_fn(low, *batch32)
    total = (losses.float() * factors.float()).sum()
    plain_b = dict(zip(named, torch.autograd.grad(total, params, allow_unused=True)))
    bounds = {}
    for n, r in ref.items():
        scale = float(r.abs().max()) or 1.0
        err_a = float((plain_a[n] - r).abs().max()) / scale
        gb = plain_b[n]
        err_b = float((gb.double() - r).abs().max()) / scale if gb is not None else 0.0
        bounds[n] = 2 * max(err_a, err_b) + 2.0**-9
    return bounds


def assert_within(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], bounds: dict[str, float],
                  what: str = "") -> None:
    """Every parameter's error relative to its largest reference entry within its bound."""
    failures = []
    for n, r in ref.items():
        scale = float(r.abs().max()) or 1.0
        err = float((got[n].double() - r.double()).abs().max()) / scale
        if not err <= bounds[n]:
            failures.append(f"{what} {n}: relative error {err:.3g} > bound {bounds[n]:.3g}")
        if not torch.isfinite(got[n]).all():
            failures.append(f"{what} {n}: not finite")
    assert not failures, "\n".join(failures)


def grad_norm_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).square().sum()) for n in a))
