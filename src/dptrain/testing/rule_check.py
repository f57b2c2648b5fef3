"""``assert_rule_exact``: a layer rule (or a whole model) checked in every clipping mode and on both backward
paths against the oracle, built from the kit's other parts."""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _checks
from ..data.batches import batch_len
from .comparison import mismatches
from .engine_step import clipped_gradient
from .oracle import _clipped_sum, _per_sample, _threshold_between, per_sample_gradients, trainable_named_parameters


def assert_rule_exact(
    module: nn.Module,
    example_input,
    *,
    rule=None,
    losses_fn: Callable | None = None,
    modes: Sequence[str] | None = None,
    plain_backward: bool = True,
    max_grad_norm: float | None = None,
    clipping_fn: str = "abadi",
    clipping_style: str | Sequence[Sequence[str]] = "all-layer",
    clipping_gamma: float = 0.01,
    allow_fallback: bool = False,
    dtype: torch.dtype | None = torch.float64,
    atol: float = 1e-10,
    rtol: float = 1e-10,
) -> None:
    """Check that private training of ``module`` gives the oracle's clipped gradient in every clipping mode.

    ``module`` is the layer a rule was written for (or a whole model); ``example_input`` its input with
    the batch first (a tuple for several arguments), at least two samples whose gradients differ. The
    check runs on a copy in ``dtype`` (float64: the tolerances are for that; ``None`` keeps the dtype),
    never on ``module`` itself:

    - the loss of each sample is ``0.5 * ||out_i - y_i||^2`` with ``out`` the module's output (the first
      tensor of a tuple) and ``y`` a fixed random target; or ``losses_fn(model, *example_input)``, the
      per-sample losses ``[B, ...]`` (summed per sample), with ``example_input`` then the whole batch;
    - ``max_grad_norm`` (default: between two samples' norms, so that some are clipped and some not);
    - every mode in ``modes`` (default: all seven) through ``engine.backward(losses)`` and, for the
      single-backward modes when ``plain_backward``, through a plain ``losses.mean().backward()``;
    - ``rule``: a ``LayerRule`` class or instance, registered for the check (and removed after, unless
      it was registered before), which must cover some module of ``module``. Without the per-sample
      fallback (``allow_fallback=False``, the default), a module that no rule covers is refused: the
      check never passes because the fallback, rather than a rule, did the work.

    Each parameter must satisfy ``|engine - oracle| <= atol + rtol * |oracle|`` entry by entry. Raises
    an ``AssertionError`` that lists every mode, backward path and parameter that does not, or that
    names the mode and path in which the engine raised.
    """
    from ..core.algorithms import CLIPPING_MODES, RECIPES
    from ..layers import find_rule, registry
    from ..layers.protocol import LayerRule

    if not isinstance(module, nn.Module):
        raise TypeError(f"assert_rule_exact checks a module (the layer the rule is for, or a model), got "
                        f"{type(module).__name__}; give the rule as rule=")
    modes = tuple(CLIPPING_MODES if modes is None else modes)
    for mode in modes:
        _checks.choice("clipping_mode", mode, CLIPPING_MODES)
    model = copy.deepcopy(module)
    for p in model.parameters():
        p.grad = None
    batch = example_input
    if dtype is not None:
        model = model.to(dtype)
        batch = _cast_floats(batch, dtype)
    if losses_fn is None:
        inputs = batch if isinstance(batch, tuple) else (batch,)
        with torch.no_grad():
            out = _output_tensor(model(*inputs), model)
        if out.dim() == 0 or out.shape[0] != batch_len(inputs):
            raise ValueError(f"the output of {type(module).__name__} has shape {tuple(out.shape)}, not the batch "
                             f"({batch_len(inputs)}) first: give losses_fn")
        target = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0)).to(out.device)
        batch, losses_fn = (*inputs, target), _squared_error

    before = list(registry._REGISTRY)
    try:
        if rule is not None:
            rule_cls = rule if isinstance(rule, type) else type(rule)
            if not issubclass(rule_cls, LayerRule):
                raise TypeError(f"rule must be a LayerRule subclass or instance, got {rule!r}")
            registry.register_layer(rule)
            if not any(isinstance(find_rule(m), rule_cls) for m in model.modules()):
                raise AssertionError(
                    f"{rule_cls.__name__} covers no module of {type(module).__name__}: check its module_types, and "
                    "that the module's class does not override forward (a subclass that does needs its own rule)")
        named = trainable_named_parameters(model)
        if not named:
            raise ValueError(f"{type(module).__name__} has no trainable parameters: nothing to check")
        grads = per_sample_gradients(model, losses_fn, batch)
        R = max_grad_norm if max_grad_norm is not None else _threshold_between(model, grads, clipping_style)
        options: dict[str, Any] = dict(max_grad_norm=R, clipping_fn=clipping_fn, clipping_style=clipping_style,
                       clipping_gamma=clipping_gamma)
        expected = _clipped_sum(model, grads, **options)

        def summed_losses(model, *batch):
            return _per_sample(losses_fn(model, *batch))

        failures: list[str] = []
        for mode in modes:
            paths = [("engine.backward", "engine")]
            if plain_backward and not RECIPES[mode].two_pass:
                paths.append(("loss.backward", "mean"))
            for label, path in paths:
                try:
                    got = clipped_gradient(model, summed_losses, batch, mode=mode, path=path,
                                           allow_fallback=allow_fallback, **options)
                except Exception as err:
                    raise AssertionError(f"{type(module).__name__}, {mode} through {label}: the engine raised "
                                         f"{type(err).__name__}: {err}") from err
                failures += mismatches(got, expected, atol=atol, rtol=rtol, what=f"{mode} through {label}")
        if failures:
            raise AssertionError(
                f"{type(module).__name__}: the engine's clipped gradient differs from the oracle's (max_grad_norm="
                f"{R:.6g}, {clipping_fn}, {clipping_style}) in\n  " + "\n  ".join(failures))
    finally:
        registry._REGISTRY[:] = before


def _squared_error(model, *inputs):
    *xs, target = inputs
    out = _output_tensor(model(*xs), model)
    return 0.5 * (out - target).square().reshape(out.shape[0], -1).sum(1)


def _output_tensor(out, model) -> torch.Tensor:
    """The output tensor of a call: the output itself, or the first tensor of a tuple (attention, LSTM)."""
    if isinstance(out, nn.utils.rnn.PackedSequence):
        raise TypeError(f"{type(model).__name__} returned a PackedSequence: give losses_fn")
    if isinstance(out, (tuple, list)):
        out = next((t for t in out if isinstance(t, torch.Tensor)), out)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(model).__name__} returned {type(out).__name__}, not a tensor: give losses_fn")
    return out


def _cast_floats(batch, dtype):
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_floats(v, dtype) for v in batch)
    return batch
