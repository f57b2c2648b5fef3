"""The neighbour test: differential privacy's own definition, checked on one's own training step.

With the noise at 0, the private step's clipped sum for a batch ``D`` and for ``D`` without one sample (or one user)
must differ by at most ``max_grad_norm``: that is the sensitivity the accountant's epsilon relies on. The test needs no
model of what the engine does, so it catches what a per-sample oracle built on the same assumptions would miss: a
loss that couples samples, a forward that mixes them, a sampler or a resume that changes what a step sees. A step the
engine refuses releases nothing, so it passes (and the report says why it was refused)::

    report = dptrain.testing.neighbour_test(
        model, lambda m, x, y: my_loss(m(x), y), (x, y), max_grad_norm=1.0)
    assert report.worst <= 1 + 1e-6, report

``warm_up`` runs ordinary steps first (a check that runs once and is then trusted must be tested warm), with the loss
``warm_up_losses`` (default: the same); the step under test comes last. Everything runs on copies of ``model``.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .algorithms import DEFAULT_CLIPPING_MODE


@dataclass
class NeighbourReport:
    """What ``neighbour_test`` found: for each removed sample (or user), ``||G(D) - G(D without it)|| /
    max_grad_norm``; ``refused``: the engine's refusal of the step (nothing released), if it refused one."""

    distances: dict = field(default_factory=dict)
    refused: str | None = None

    @property
    def worst(self) -> float:
        """The largest distance (0 where every step was refused): at most 1 for a private step."""
        return max(self.distances.values(), default=0.0)

    def __str__(self) -> str:
        if self.refused is not None and not self.distances:
            return f"refused by the engine (nothing released): {self.refused}"
        parts = ", ".join(f"without {k}: {d:.4g} R" for k, d in self.distances.items())
        return f"worst {self.worst:.4g} R ({parts})" + (f"; refused: {self.refused}" if self.refused else "")


def _without(batch, keep: torch.Tensor):
    if isinstance(batch, torch.Tensor):
        return batch[keep.to(batch.device)] if batch.dim() else batch
    if isinstance(batch, dict):
        return {k: _without(v, keep) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_without(v, keep) for v in batch)
    return batch


def _call(losses_fn, model, batch):
    return losses_fn(model, *batch) if isinstance(batch, (tuple, list)) else losses_fn(model, batch)


def neighbour_test(model: nn.Module, losses_fn: Callable, batch, *, max_grad_norm: float,
                   mode: str = DEFAULT_CLIPPING_MODE, remove: Sequence[int] | None = None, users=None,
                   warm_up: Sequence = (), warm_up_losses: Callable | None = None, path: str = "engine",
                   seed: int = 0, **options) -> NeighbourReport:
    """The neighbour test of one private step (see the module docstring).

    ``losses_fn(model, *batch)`` gives the per-sample losses ``[B]``; ``batch`` is a tensor or a tuple, list or dict
    of tensors with the samples along dim 0. ``remove``: the samples to leave out one at a time (default: every
    sample up to 8, else the first, a middle and the last); with ``users`` (each sample's user id, ``[B]``) the
    engine clips per user (``privacy_unit="user"``) and ``remove`` names users (default: every user up to 8).
    ``path``: ``"engine"`` (``engine.backward(losses)``), or ``"mean"`` / ``"sum"`` (a plain ``loss.backward()``).
    ``seed``: both runs of a pair draw the same random numbers (dropout, a permutation in the loss). ``options``: the
    engine's other arguments. The model is never changed.
    """
    from .rows import RowsMixSamples
    from .testing import attached_engine

    if path not in ("engine", "mean", "sum"):
        raise ValueError(f"path must be 'engine', 'mean' or 'sum', got {path!r}")
    size = len(users) if users is not None else _length(batch)
    ids = torch.as_tensor(users) if users is not None else torch.arange(size)
    units = sorted(set(ids.tolist()))
    if remove is None:
        remove = units if len(units) <= 8 else [units[0], units[len(units) // 2], units[-1]]
    if users is not None:
        options["privacy_unit"] = "user"
    options.setdefault("loss_reduction", "sum" if path == "sum" else "mean")
    report = NeighbourReport()

    def step(data, unit_ids) -> dict | None:
        trained = copy.deepcopy(model)
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(seed)
            engine, opt = attached_engine(trained, mode=mode, max_grad_norm=max_grad_norm, **options)
            try:
                for warm in [*warm_up, None]:
                    opt.zero_grad(set_to_none=True)
                    this = data if warm is None else warm
                    fn = losses_fn if warm is None else (warm_up_losses or losses_fn)
                    losses = _call(fn, trained, this if warm is None or users is None else this[0])
                    if path == "engine":
                        engine.backward(losses, **({"users": unit_ids if warm is None else this[1]}
                                                   if users is not None else {}))
                    else:
                        (losses.mean() if path == "mean" else losses.sum()).backward()
                    opt.step()
                return {n: p.grad.detach().clone() for n, p in trained.named_parameters() if p.grad is not None}
            except RowsMixSamples as refusal:
                report.refused = str(refusal)
                return None
            finally:
                engine.detach()

    full = step(batch, ids)
    if full is None:
        return report
    for unit in remove:
        keep = ids != unit
        if bool(keep.all()):
            raise ValueError(f"remove names {unit!r}, which is no sample or user of the batch")
        smaller = step(_without(batch, keep), ids[keep])
        if smaller is None:
            continue
        report.distances[unit] = _distance(full, smaller) / max_grad_norm
    return report


def _distance(a: dict, b: dict) -> float:
    """The norm of the difference of two {name: gradient} (a parameter without a gradient counts as zero)."""
    total = 0.0
    for name in set(a) | set(b):
        if name in a and name in b:
            total += float((a[name] - b[name]).double().square().sum())
        else:
            total += float((a[name] if name in a else b[name]).double().square().sum())
    return math.sqrt(total)


def _length(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim():
            return v.shape[0]
    raise ValueError("the batch holds no tensor with a batch dimension")


def assert_neighbours_bounded(model: nn.Module, losses_fn: Callable, batch, *, max_grad_norm: float,
                              rtol: float = 1e-6, **kwargs) -> NeighbourReport:
    """``neighbour_test`` that raises an ``AssertionError`` naming the sample (or user) whose removal moves the step
    by more than ``max_grad_norm`` (times ``1 + rtol``, for rounding). Returns the report."""
    report = neighbour_test(model, losses_fn, batch, max_grad_norm=max_grad_norm, **kwargs)
    bad = {k: d for k, d in report.distances.items() if not d <= 1 + rtol}
    if bad:
        k, d = max(bad.items(), key=lambda kv: kv[1])
        raise AssertionError(
            f"removing sample {k} moves the private step by {d:.4g} x max_grad_norm (more than 1): one sample's "
            f"influence is not bounded by the clipping, so the reported epsilon does not hold ({report})")
    return report
