"""The engine run the way the oracle is: one private step at noise 0 and batch size 1, whose ``p.grad`` is the
clipped sum (``clipped_gradient``), through ``engine.backward`` or a plain ``loss.backward()`` (``PATHS``), and the
engine set up for a loop of one's own (``attached_engine``)."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..data.batches import batch_len
from .oracle import _call, _per_sample, _take, trainable_named_parameters

PATHS = ("engine", "mean", "sum")
"""The backward paths ``clipped_gradient`` runs: ``engine.backward(losses)``, or ``loss.backward()`` on the losses' mean
or sum."""


def attached_engine(model: nn.Module, *, mode: str, max_grad_norm: float,
                    optimizer: torch.optim.Optimizer | None = None, lr: float = 0.0, grad_scaler=None, **options):
    """(engine, optimizer): a ``PrivacyEngine`` on ``model`` set up for checking, attached to ``optimizer``
    (default: SGD at ``lr`` over the model's parameters).

    Noise 0 and ``batch_size`` 1 unless ``options`` say otherwise (``sample_size`` 100, or the batch size if
    larger): then ``p.grad`` at the step is the clipped sum itself. ``options`` are the engine's other
    arguments (``clipping_fn``, ``clipping_style``, ``loss_reduction``, ``allow_fallback``, ...); ``grad_scaler``
    is given to ``attach``. Detach the engine when done.
    """
    from ..engine import PrivacyEngine

    options.setdefault("batch_size", 1)
    options.setdefault("noise_multiplier", 0.0)
    options.setdefault("sample_size", max(100, options["batch_size"]))
    engine = PrivacyEngine(model, max_grad_norm=max_grad_norm, clipping_mode=mode, **options)
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine.attach(optimizer, grad_scaler=grad_scaler)
    return engine, optimizer


def clipped_gradient(
    model: nn.Module,
    losses_fn: Callable,
    *batches,
    mode: str,
    max_grad_norm: float,
    path: str = "engine",
    micro_batches: int = 1,
    lr: float = 0.0,
    grad_scaler=None,
    **options,
) -> dict[str, torch.Tensor | None]:
    """What the engine gives: ``p.grad`` after one private step of ``model`` over ``batches``, as
    {full parameter name: tensor} for every trainable parameter (``None`` where it got no gradient), the
    engine's counterpart of ``reference_clipped_gradient``.

    The engine is ``attached_engine(model, mode=mode, max_grad_norm=max_grad_norm, **options)``: with its
    defaults (noise 0, batch_size 1) the result is the clipped sum ``sum_i C_i g_i`` itself; with noise or a
    larger ``batch_size`` it is the private gradient the optimizer applies. ``batches`` (each as
    ``reference_clipped_gradient`` takes it) are back-propagated in turn before the one step, each in
    ``micro_batches`` consecutive chunks. ``path``: ``"engine"`` calls ``engine.backward(losses)``; ``"mean"`` and
    ``"sum"`` call ``loss.backward()`` on the per-sample losses reduced that way (``loss_reduction`` set to
    match). ``lr`` > 0 moves the model by the step (SGD); ``grad_scaler`` scales each loss and steps through
    the scaler. Warnings that several clipping groups cost a two-pass mode extra backward passes are not
    shown. The engine is detached after, and the model's ``p.grad`` cleared; the model is changed in nothing
    else (at ``lr`` 0).
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if not batches:
        raise TypeError("clipped_gradient needs at least one batch")
    options.setdefault("loss_reduction", "sum" if path == "sum" else "mean")
    scale = grad_scaler.scale if grad_scaler is not None else (lambda loss: loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*extra backward passes")
        engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=max_grad_norm, lr=lr,
                                            grad_scaler=grad_scaler, **options)
        try:
            for batch in batches:
                for chunk in split_batch(batch, micro_batches):
                    losses = _call(losses_fn, model, chunk)
                    if path == "engine":
                        engine.backward(scale(losses))
                    elif path == "mean":
                        scale(_per_sample(losses).mean()).backward()
                    else:
                        scale(_per_sample(losses).sum()).backward()
            if grad_scaler is not None:
                grad_scaler.step(optimizer)
                grad_scaler.update()
            else:
                optimizer.step()
            if engine.steps_taken != 1:
                raise AssertionError(f"the engine took {engine.steps_taken} steps, not one")
            return {name: None if p.grad is None else p.grad.detach().clone()
                    for name, (_, p) in trainable_named_parameters(model).items()}
        finally:
            engine.detach()
            optimizer.zero_grad(set_to_none=True)


def split_batch(batch, k: int) -> list:
    """``batch`` in ``k`` consecutive chunks along the batch axis (the micro-batches of ``clipped_gradient``);
    ``[batch]`` itself when ``k`` is 1."""
    if k == 1:
        return [batch]
    size = batch_len(batch) or 0
    bounds = [round(i * size / k) for i in range(k + 1)]
    return [_take(batch, bounds[i], bounds[i + 1]) for i in range(k)]
