"""The neighbour test: differential privacy's own definition, checked on one's own training step.

With the noise at 0, the private step's clipped sum for a batch ``D`` and for ``D`` without one sample (or one user)
must differ by at most ``max_grad_norm`` (R): that is the sensitivity the accountant's epsilon relies on. The test needs
no model of what the engine does, so it catches what a per-sample oracle built on the same assumptions would miss: a
loss that couples samples (also through a detached weight or selection, which no gradient shows), a forward that mixes
them, a sampler or a resume that changes what a step sees. A step the engine refuses releases nothing, so it passes
(and the report says why it was refused)::

    report = dptrain.testing.neighbour_test(model, lambda m, x, y: my_loss(m(x), y), (x, y))
    assert report.worst <= 1 + 1e-6, report

Which R it runs at matters. A coupling hides at the R one trains with: where every sample is clipped, each
contributes a vector of length R whatever weight the batch gave it (a detached softmax re-weighting reads exactly
1 R); where none is, removing a sample moves the sum by that sample's own norm, below R, and what it changes in the
others' terms may still fit (0.98 R). So by default the test runs at three R, chosen from the per-sample gradient
norms of the batch as the losses define them: one that clips every sample, one that clips some and not others
(removing a clipped sample moves the sum by R, and the others' re-weighted terms add to that), and one just above the
largest norm, that clips none. It removes every sample (or user) in turn: (B + 1) steps at each R, so give it a small
batch (16 samples or so). The report names each R and what it clips.

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

from ..core.algorithms import DEFAULT_CLIPPING_MODE
from ..rows import RowsMixSamples
from .engine_step import attached_engine
from .oracle import _groups, _threshold_between, gradients, trainable_named_parameters

# How far the default R sit from the nearest per-sample norm: far beyond the rounding of the engine's norms (float32),
# close enough that the norm-sized differences of a coupled loss are not divided away by a much larger R.
_MARGIN = 1e-3
CLIPS_EVERY = "clips every sample"
CLIPS_SOME = "clips some samples, not others"
CLIPS_NONE = "clips none"


@dataclass
class NeighbourReport:
    """What ``neighbour_test`` found. ``distances``: ``{R: {removed sample (or user): ||G(D) - G(D without it)|| /
    R}}``; ``thresholds``: ``{R: what it clips}`` for every R tested (``"clips every sample"``, ``"clips some
    samples, not others"``, ``"clips none"``, or ``"given"``); ``refused``: the engine's refusal of a step (nothing
    released), if it refused one."""

    distances: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    refused: str | None = None

    @property
    def worst(self) -> float:
        """The largest distance over every R (NaN if any is; 0 where every step was refused): at most 1 for a private
        step."""
        case = self.worst_case
        return 0.0 if case is None else case[2]

    @property
    def worst_case(self) -> tuple | None:
        """(R, the removed sample or user, its distance) of the largest distance, or ``None`` where none was read.
        NaN, which no bound holds, counts as the largest."""
        cases = [(R, k, d) for R, by_unit in self.distances.items() for k, d in by_unit.items()]
        return max(cases, key=lambda c: math.inf if math.isnan(c[2]) else c[2], default=None)

    def __str__(self) -> str:
        if self.refused is not None and not any(self.distances.values()):
            return f"refused by the engine (nothing released): {self.refused}"
        parts = []
        for R, by_unit in self.distances.items():
            if by_unit:
                k, d = max(by_unit.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1])
                parts.append(f"at R={R:.4g} ({self.thresholds.get(R, 'given')}): worst {d:.4g} R, without {k!r}, "
                             f"{len(by_unit)} removed")
        return f"worst {self.worst:.4g} R; " + "; ".join(parts) + (
            f"; refused: {self.refused}" if self.refused else "")


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


def neighbour_test(model: nn.Module, losses_fn: Callable, batch, *,
                   max_grad_norm: float | Sequence[float] | None = None, mode: str = DEFAULT_CLIPPING_MODE,
                   remove: Sequence[int] | None = None, users=None, warm_up: Sequence = (),
                   warm_up_losses: Callable | None = None, path: str = "engine", seed: int = 0,
                   allow_random_draws: bool = False, **options) -> NeighbourReport:
    """The neighbour test of one private step (see the module docstring).

    ``losses_fn(model, *batch)`` gives the per-sample losses ``[B]``; ``batch`` is a tensor or a tuple, list or dict
    of tensors with the samples along dim 0. ``max_grad_norm``: the R (one, or several) to test at; by default three,
    chosen from the batch's per-sample gradient norms: one that clips every sample, one that clips some, one that
    clips none (a coupled loss can hide at any single R). ``remove``: the samples to leave out one at a time
    (default: every one); with ``users`` (each sample's user id, ``[B]``) the engine clips per user
    (``privacy_unit="user"``) and ``remove`` names users (default: every user).
    ``path``: ``"engine"`` (``engine.backward(losses)``), or ``"mean"`` / ``"sum"`` (a plain ``loss.backward()``).
    ``seed``: every run starts from it. A forward or loss that draws random numbers (dropout in training mode, a
    random augmentation) is refused (``ValueError``): removing a sample shifts the draws of the samples after it, so
    the distance would measure the draws, not a coupling (a network with dropout 0.1 reads about 1.3 R, 0.5 about
    2.8 R). ``allow_random_draws=True`` runs it anyway (for draws made per sample, independently of the batch).
    ``options``: the engine's other arguments. The model is never changed.
    """
    if path not in ("engine", "mean", "sum"):
        raise ValueError(f"path must be 'engine', 'mean' or 'sum', got {path!r}")
    if not allow_random_draws:
        _refuse_random_draws(model, losses_fn, batch, seed)
    size = len(users) if users is not None else _length(batch)
    ids = torch.as_tensor(users) if users is not None else torch.arange(size)
    units = sorted(set(ids.tolist()))
    remove = units if remove is None else remove
    if users is not None:
        options["privacy_unit"] = "user"
    options.setdefault("loss_reduction", "sum" if path == "sum" else "mean")
    if max_grad_norm is None:
        thresholds = default_thresholds(model, losses_fn, batch, ids, seed=seed,
                                        clipping_style=options.get("clipping_style", "all-layer"))
    else:
        given = list(max_grad_norm) if isinstance(max_grad_norm, Sequence) else [max_grad_norm]
        thresholds = {float(R): "given" for R in given}
    report = NeighbourReport(thresholds=thresholds)

    def step(data, unit_ids, R: float) -> dict | None:
        trained = copy.deepcopy(model)
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(seed)
            engine, opt = attached_engine(trained, mode=mode, max_grad_norm=R, **options)
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

    for R in thresholds:
        report.distances[R] = {}
        full = step(batch, ids, R)
        if full is None:
            continue
        for unit in remove:
            keep = ids != unit
            if bool(keep.all()):
                raise ValueError(f"remove names {unit!r}, which is no sample or user of the batch")
            smaller = step(_without(batch, keep), ids[keep], R)
            if smaller is not None:
                report.distances[R][unit] = _distance(full, smaller) / R
    return report


def _refuse_random_draws(model: nn.Module, losses_fn: Callable, batch, seed: int) -> None:
    """Refuses losses that differ between two evaluations of the batch at two seeds (see ``neighbour_test``)."""
    probe = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):  # (gradients enabled: a loss may differentiate inside, as in the steps)
        torch.manual_seed(seed)
        first = _call(losses_fn, probe, batch)
        torch.manual_seed(seed + 1)
        second = _call(losses_fn, probe, batch)
    if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
        return  # (no losses to compare: the steps say what is wrong with them)
    if first.shape == second.shape and bool(torch.isclose(first.detach(), second.detach(), rtol=0.0, atol=0.0,
                                                          equal_nan=True).all()):
        return
    raise ValueError(
        "neighbour_test: losses_fn gave other losses for the same batch at another seed, so the forward or the loss "
        "draws random numbers (dropout in training mode, a random augmentation or mask). Removing a sample shifts the "
        "draws of the samples after it, so the test would measure the draws, not a coupling (dropout 0.1 reads about "
        "1.3 R on an honest model). Test with the draws off: set the dropout probabilities to 0 (each nn.Dropout's p; "
        "for a Hugging Face model the config's dropout fields, such as hidden_dropout_prob, attn_pdrop, "
        "attention_dropout, lora_dropout), or pass allow_random_draws=True where each sample's draws do not depend "
        "on the others")


def default_thresholds(model: nn.Module, losses_fn: Callable, batch, ids: torch.Tensor, *, seed: int = 0,
                       clipping_style="all-layer") -> dict[float, str]:
    """``{R: what it clips}``: the R that ``neighbour_test`` runs at by default, from each sample's (or user's,
    ``ids``) gradient norm in its clipping groups, read with plain autograd on the whole batch, so that a weight
    computed from the batch counts as the engine will see it: just below the smallest nonzero norm (clips every
    sample), between two norms near the median (clips some; left out where every norm is the same), and just above
    the largest (clips none)."""
    grads = _unit_gradients(copy.deepcopy(model), losses_fn, batch, ids, seed)
    groups = _groups(model, clipping_style)
    scale = math.sqrt(len(groups))  # each of K groups is clipped to R / sqrt(K)
    norms = [v for group in groups
             for v in (scale * torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in group))).tolist() if v > 0]
    if not norms:
        raise ValueError("every sample's gradient is zero in this batch, so no R can be chosen from the norms: give "
                         "max_grad_norm, or a batch whose losses depend on the model")
    out = {min(norms) * (1 - _MARGIN): CLIPS_EVERY}
    try:
        out[_threshold_between(model, grads, clipping_style)] = CLIPS_SOME
    except ValueError:  # every norm the same (or one sample): no R lies between two
        pass
    out[max(norms) * (1 + _MARGIN)] = CLIPS_NONE
    return out


def _unit_gradients(model: nn.Module, losses_fn: Callable, batch, ids: torch.Tensor, seed: int) -> dict:
    """{name: [U, *shape]}: the gradient of each unit's losses, summed, computed on the whole batch."""
    named = trainable_named_parameters(model)
    params = [p for _, p in named.values()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # (the draws of the steps under test: dropout, a permutation in the loss)
        losses = _call(losses_fn, model, batch)
    if losses.dim() == 0 or losses.shape[0] != len(ids):
        raise ValueError(f"losses_fn must give one loss per sample, [{len(ids)}], got shape {tuple(losses.shape)}")
    losses = losses.reshape(len(ids), -1).sum(1)
    rows = []
    for unit in sorted(set(ids.tolist())):
        grads = gradients(losses[ids.to(losses.device) == unit].sum(), params, retain_graph=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
    return {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(named)}


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


def assert_neighbours_bounded(model: nn.Module, losses_fn: Callable, batch, *,
                              max_grad_norm: float | Sequence[float] | None = None, rtol: float = 1e-6,
                              **kwargs) -> NeighbourReport:
    """``neighbour_test`` that raises an ``AssertionError`` naming the sample (or user) whose removal moves the step
    by more than R (times ``1 + rtol``, for rounding), and the R. Returns the report."""
    report = neighbour_test(model, losses_fn, batch, max_grad_norm=max_grad_norm, **kwargs)
    worst = report.worst_case
    if worst is not None and not worst[2] <= 1 + rtol:
        R, k, d = worst
        raise AssertionError(
            f"removing sample {k} moves the private step by {d:.4g} x max_grad_norm (more than 1) at R={R:.4g} "
            f"({report.thresholds[R]}): one sample's influence is not bounded by the clipping, so the reported epsilon "
            f"does not hold ({report})")
    return report
