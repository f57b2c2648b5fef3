"""The specification every clipping mode is tested against: one sample at a time through autograd.

Public so that users can check their own layer rules. ``assert_rule_exact`` runs the engine in every
clipping mode against the oracle::

    dptrain.testing.assert_rule_exact(Scale(6), torch.randn(5, 3, 6, dtype=torch.float64))

and ``reference_clipped_gradient`` is the oracle itself::

    ref = dptrain.testing.reference_clipped_gradient(
        model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), (x, y), max_grad_norm=1.0)

The oracle shares no code with the engine: per-sample gradients come from autograd on
each sample alone, and the clipping functions and groups are written out again here.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from . import checks
from .data import batch_len


def _slice_batch(batch, i: int):
    if isinstance(batch, torch.Tensor):
        return batch[i : i + 1]
    if isinstance(batch, dict):
        return {k: _slice_batch(v, i) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_batch(v, i) for v in batch)
    return batch


def trainable_named_parameters(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """{full name: (owning module name, parameter)} for every trainable parameter, in model order.

    A parameter shared by several modules (tied weights) appears once, under its first owner.
    """
    out, seen = {}, set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out[f"{mname}.{pname}" if mname else pname] = (mname, p)
    return out


def per_sample_gradients(model: nn.Module, losses_fn: Callable, batch) -> dict[str, torch.Tensor]:
    """{name: [B, *shape]} gradients of each sample's loss, from one autograd call per sample."""
    named = trainable_named_parameters(model)
    params = [p for _, p in named.values()]
    rows: list[list[torch.Tensor]] = []
    for i in range(batch_len(batch)):
        sample = _slice_batch(batch, i)
        loss = losses_fn(model, *sample) if isinstance(sample, (tuple, list)) else losses_fn(model, sample)
        grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
    return {
        name: torch.stack([r[k] for r in rows]) if rows else params[k].new_zeros(0, *params[k].shape)
        for k, name in enumerate(named)
    }


def reference_clipped_gradient(
    model: nn.Module,
    losses_fn: Callable,
    batch,
    *,
    max_grad_norm: float,
    clipping_fn: str = "abadi",
    clipping_style: str | Sequence[Sequence[str]] = "all-layer",
    clipping_gamma: float = 0.01,
) -> dict[str, torch.Tensor]:
    """{name: sum_i C_i g_i} with C_i from each clipping group's per-sample norm.

    ``losses_fn(model, *sample)`` returns the loss of a one-sample batch; ``batch`` is a tensor,
    tuple or dict of tensors with the batch first. Groups follow ``clipping_style``
    (all-layer, layer-wise, param-wise, or lists of module names), each clipped to R/sqrt(K).
    """
    return _clipped_sum(model, per_sample_gradients(model, losses_fn, batch), max_grad_norm=max_grad_norm,
                        clipping_fn=clipping_fn, clipping_style=clipping_style, clipping_gamma=clipping_gamma)


def reference_user_clipped_gradient(
    model: nn.Module,
    losses_fn: Callable,
    batch,
    users: torch.Tensor,
    *,
    max_grad_norm: float,
    clipping_fn: str = "abadi",
    clipping_style: str | Sequence[Sequence[str]] = "all-layer",
    clipping_gamma: float = 0.01,
) -> dict[str, torch.Tensor]:
    """{name: sum_u C_u (sum_{i in u} g_i)} with C_u from the norm of each user's summed gradient
    (``privacy_unit="user"``): the per-sample oracle's gradients, summed per user, then clipped."""
    grads = per_sample_gradients(model, losses_fn, batch)
    _, owner = torch.unique(users, return_inverse=True)
    count = int(owner.max()) + 1 if owner.numel() else 0
    per_user = {n: g.new_zeros(count, *g.shape[1:]).index_add_(0, owner.to(g.device), g) for n, g in grads.items()}
    return _clipped_sum(model, per_user, max_grad_norm=max_grad_norm, clipping_fn=clipping_fn,
                        clipping_style=clipping_style, clipping_gamma=clipping_gamma)


def _groups(model: nn.Module, clipping_style) -> list[list[str]]:
    """The clipping groups, as lists of full parameter names."""
    named = trainable_named_parameters(model)
    if clipping_style == "all-layer":
        groups = [list(named)]
    elif clipping_style == "param-wise":
        groups = [[n] for n in named]
    else:
        by_module: dict[str, list[str]] = {}
        for name, (mname, _) in named.items():
            by_module.setdefault(mname, []).append(name)
        if clipping_style == "layer-wise":
            groups = list(by_module.values())
        else:  # a module whose only parameter is tied to an earlier one adds nothing to its group
            groups = [g for g in ([n for m in group for n in by_module.get(m, [])] for group in clipping_style) if g]
    return groups


def _clipped_sum(model, grads, *, max_grad_norm, clipping_fn, clipping_style, clipping_gamma):
    """{name: sum_i C_i g_i} from the per-sample gradients ``grads``."""
    groups = _groups(model, clipping_style)
    threshold = max_grad_norm / math.sqrt(len(groups))
    out = {}
    for group in groups:
        norm = torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in group))
        if clipping_fn == "abadi":
            factor = torch.clamp(threshold / norm, max=1.0)
            factor = torch.where(norm == 0, torch.ones_like(norm), factor)
        elif clipping_fn == "automatic":
            factor = threshold / (norm + clipping_gamma)
        elif clipping_fn == "global":
            factor = (norm <= threshold).to(norm.dtype)
        else:
            raise ValueError(f"unknown clipping_fn {clipping_fn!r}")
        for n in group:
            out[n] = torch.einsum("b,b...->...", factor, grads[n])
    return out


# --------------------------------------------------------------------------- checking a rule in every mode
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
    from .algorithms import CLIPPING_MODES, RECIPES
    from .engine import PrivacyEngine
    from .layers import find_rule, registry
    from .layers.protocol import LayerRule

    if not isinstance(module, nn.Module):
        raise TypeError(f"assert_rule_exact checks a module (the layer the rule is for, or a model), got "
                        f"{type(module).__name__}; give the rule as rule=")
    modes = tuple(CLIPPING_MODES if modes is None else modes)
    for mode in modes:
        checks.choice("clipping_mode", mode, CLIPPING_MODES)
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
    call = (lambda: losses_fn(model, *batch)) if isinstance(batch, (tuple, list)) else (lambda: losses_fn(model, batch))

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
        options = dict(max_grad_norm=R, clipping_fn=clipping_fn, clipping_style=clipping_style,
                       clipping_gamma=clipping_gamma)
        expected = _clipped_sum(model, grads, **options)
        failures: list[str] = []
        for mode in modes:
            paths = ["engine.backward"]
            if plain_backward and not RECIPES[mode].two_pass:
                paths.append("loss.backward")
            for path in paths:
                optimizer = torch.optim.SGD([p for _, p in named.values()], lr=0.0)
                engine = None
                try:
                    with warnings.catch_warnings():  # several groups cost the two-pass modes extra passes
                        warnings.filterwarnings("ignore", message=".*extra backward passes")
                        engine = PrivacyEngine(model, batch_size=1, sample_size=100, noise_multiplier=0.0,
                                               clipping_mode=mode, allow_fallback=allow_fallback, **options)
                        engine.attach(optimizer)
                        losses = call()
                        losses = losses.reshape(losses.shape[0], -1).sum(1)
                        if path == "engine.backward":
                            engine.backward(losses)
                        else:
                            losses.mean().backward()
                        optimizer.step()
                    got = {name: p.grad for name, (_, p) in named.items()}
                except Exception as err:
                    raise AssertionError(f"{type(module).__name__}, {mode} through {path}: the engine raised "
                                         f"{type(err).__name__}: {err}") from err
                finally:
                    if engine is not None:
                        engine.detach()
                    optimizer.zero_grad(set_to_none=True)
                failures += _mismatches(got, expected, atol, rtol, f"{mode} through {path}")
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


def _threshold_between(model, grads, clipping_style) -> float:
    """A clipping threshold between two samples' (group) norms, as near the median as a clear gap allows,
    so that some samples are clipped and others not, and no norm lies within rounding of it."""
    groups = _groups(model, clipping_style)
    scale = math.sqrt(len(groups))  # each group is clipped to R / sqrt(K)
    values = sorted(v for group in groups
                    for v in (scale * torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in group))).tolist()
                    if v > 0)
    gaps = [(values[j + 1] / values[j], j) for j in range(len(values) - 1) if values[j + 1] > values[j] * (1 + 1e-6)]
    if not gaps:
        raise ValueError(
            "the example input gives every sample the same gradient norm (or a single sample): use at least two "
            "samples with different inputs, or give max_grad_norm")
    _, j = min(gaps, key=lambda gap: abs(gap[1] + 0.5 - len(values) / 2))
    return math.sqrt(values[j] * values[j + 1])


def _mismatches(got, expected, atol, rtol, what) -> list[str]:
    out = []
    for name, ref in expected.items():
        value = got.get(name)
        if value is None:
            out.append(f"{what}: {name!r} got no gradient")
            continue
        if value.shape != ref.shape:
            out.append(f"{what}: {name!r} has shape {tuple(value.shape)}, the oracle's {tuple(ref.shape)}")
            continue
        value = value.to(ref.dtype)
        error, bound = (value - ref).abs(), atol + rtol * ref.abs()
        bad = ~(error <= bound)  # NaN counts as a mismatch
        if bool(bad.any()):
            k = int(torch.where(bad.flatten(), error.flatten().nan_to_num(float("inf")), -1.0).argmax())
            out.append(f"{what}: {name!r} differs by {error.flatten()[k].item():.3g} at entry {k} (allowed "
                       f"{bound.flatten()[k].item():.3g}; largest entry of the oracle's {ref.abs().max().item():.3g})")
    return out
