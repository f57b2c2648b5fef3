"""dptrain's own test kit, public so that users can check their own layer rules: the specification every
clipping mode is tested against, the engine run the same way, and the comparison of the two.

``assert_rule_exact`` runs the engine in every clipping mode and on both backward paths against the oracle::

    dptrain.testing.assert_rule_exact(Scale(6), torch.randn(5, 3, 6, dtype=torch.float64))

It is built from four parts, each usable alone:

- the oracle, ``reference_clipped_gradient`` (``reference_user_clipped_gradient`` for ``privacy_unit="user"``)::

    ref = dptrain.testing.reference_clipped_gradient(
        model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), (x, y), max_grad_norm=R)

- the engine, ``clipped_gradient`` (the same arguments, and the mode): ``p.grad`` after one private step at
  noise 0 and batch size 1, which is the clipped sum (``attached_engine`` sets up the same engine for a loop
  of one's own);
- ``threshold_between``, a ``max_grad_norm`` that clips some samples and not others;
- ``mismatches``, every parameter where the two differ beyond a tolerance (``max_relative_error`` for reports).

And DP's own definition, which needs no oracle: ``neighbour_test`` (``assert_neighbours_bounded``) runs one private
step of a user's own loss and forward on a batch and on the batch without one sample, and reports how far apart they
are in units of ``max_grad_norm`` (at most 1 for a private step): ``dptrain.neighbours``.

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
from .layers.registry import layer_params
from .neighbours import NeighbourReport, assert_neighbours_bounded, neighbour_test  # noqa: F401 (the public kit)


def _take(batch, start: int, stop: int):
    """Samples ``start:stop`` of a batch (a tensor, or a tuple, list or dict of them; anything else as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _take(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(v, start, stop) for v in batch)
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
    from .attached import is_attached

    if is_attached(model):
        raise RuntimeError(
            "the oracle differentiates the model one sample at a time with plain autograd, but a PrivacyEngine is "
            "attached to it: its layers' parameters do not require gradients during their own calls (ghost "
            "differentiation), so the oracle would see none. Run it on a copy taken before attach "
            "(copy.deepcopy(model)), or after engine.detach()")
    named = trainable_named_parameters(model)
    params = [p for _, p in named.values()]
    rows: list[list[torch.Tensor]] = []
    for i in range(batch_len(batch)):
        loss = _call(losses_fn, model, _take(batch, i, i + 1))
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
        # A layer is a module with parameters of its own and those it claims: the descendants' parameters it reads
        # itself (layers.registry.reads_child_params), weight norm's magnitude and direction, its parameter
        # containers (the definition the engine's groups and the module names of explicit groups follow).
        layer_of: dict[int, str] = {}
        names = {id(m): n for n, m in model.named_modules()}
        for module, params in layer_params(model).items():
            for p in params.values():
                layer_of.setdefault(id(p), names[id(module)])
        by_module: dict[str, list[str]] = {}
        for name, (mname, p) in named.items():
            by_module.setdefault(layer_of.get(id(p), mname), []).append(name)
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


# --------------------------------------------------------------------------- a threshold that splits the samples
def threshold_between(model: nn.Module, losses_fn: Callable, batch, *,
                      clipping_style: str | Sequence[Sequence[str]] = "all-layer") -> float:
    """A ``max_grad_norm`` that clips some samples and leaves others unclipped, so that a comparison with the
    oracle tests the clipping factors and not only the sum (with ``clipping_fn="global"``: that some samples
    are dropped and others kept).

    It lies between two adjacent distinct per-sample norms of the clipping groups (times sqrt(K): each of K
    groups is clipped to R/sqrt(K)), the closest such pair to the median with a clear gap, at their geometric
    mean: no norm lies within rounding of it. Raises ``ValueError`` where no such pair exists (one sample, or
    every sample with the same gradient norm).
    """
    return _threshold_between(model, per_sample_gradients(model, losses_fn, batch), clipping_style)


def _threshold_between(model, grads, clipping_style) -> float:
    groups = _groups(model, clipping_style)
    scale = math.sqrt(len(groups))  # each group is clipped to R / sqrt(K)
    norms = [scale * torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in group)) for group in groups]
    values = sorted(v for norm in norms for v in norm.tolist() if v > 0)
    gaps = [j for j in range(len(values) - 1) if values[j + 1] > values[j] * (1 + 1e-6)]
    if not gaps:
        raise ValueError(
            "the example input gives every sample the same gradient norm (or a single sample): use at least two "
            "samples with different inputs, or give max_grad_norm")
    middle = len(values) // 2
    j = min(gaps, key=lambda j: abs(j - middle + 0.5))  # the first of two equally near
    threshold = math.sqrt(values[j] * values[j + 1])
    if not (any(bool((n > threshold).any()) for n in norms) and any(bool((n < threshold).any()) for n in norms)):
        raise ValueError(f"max_grad_norm {threshold:.6g} clips every sample or none")  # (cannot happen: a guard)
    return threshold


# --------------------------------------------------------------------------- running the engine
PATHS = ("engine", "mean", "sum")


def attached_engine(model: nn.Module, *, mode: str, max_grad_norm: float,
                    optimizer: torch.optim.Optimizer | None = None, lr: float = 0.0, grad_scaler=None, **options):
    """(engine, optimizer): a ``PrivacyEngine`` on ``model`` set up for checking, attached to ``optimizer``
    (default: SGD at ``lr`` over the model's parameters).

    Noise 0 and ``batch_size`` 1 unless ``options`` say otherwise (``sample_size`` 100, or the batch size if
    larger): then ``p.grad`` at the step is the clipped sum itself. ``options`` are the engine's other
    arguments (``clipping_fn``, ``clipping_style``, ``loss_reduction``, ``allow_fallback``, ...); ``grad_scaler``
    is given to ``attach``. Detach the engine when done.
    """
    from .engine import PrivacyEngine

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


def _call(losses_fn, model, batch):
    return losses_fn(model, *batch) if isinstance(batch, (tuple, list)) else losses_fn(model, batch)


def _per_sample(losses: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B], summing each sample's other dims (what ``engine.backward`` does)."""
    return losses.reshape(losses.shape[0], math.prod(losses.shape[1:])).sum(1)


# --------------------------------------------------------------------------- comparing with the oracle
def mismatches(got: dict, expected: dict, *, rtol: float, atol: float = 0.0, relative_to: str = "entry",
               what: str = "") -> list[str]:
    """Every way in which ``got`` ({name: tensor}, the engine's) differs from ``expected`` (the oracle's), one
    line each; empty where they agree. Names must be the same; each entry must satisfy
    ``|got - expected| <= atol + rtol * scale`` (NaN never does), with ``scale`` the entry's own ``|expected|``
    (``relative_to="entry"``) or the largest ``|expected|`` of all parameters (``"largest"``), which suits
    gradients whose small entries are sums that cancel. ``what`` starts each line.
    """
    if relative_to not in ("entry", "largest"):
        raise ValueError(f"relative_to must be 'entry' or 'largest', got {relative_to!r}")
    prefix = f"{what}: " if what else ""
    out = [f"{prefix}{name!r} is not a parameter of the oracle's" for name in got if name not in expected]
    largest = max((r.abs().max().item() for r in expected.values() if r.numel()), default=0.0)
    for name, ref in expected.items():
        value = got.get(name)
        if value is None:
            out.append(f"{prefix}{name!r} got no gradient")
            continue
        if value.shape != ref.shape:
            out.append(f"{prefix}{name!r} has shape {tuple(value.shape)}, the oracle's {tuple(ref.shape)}")
            continue
        dtype = torch.promote_types(value.dtype, ref.dtype)
        value, ref = value.to(device=ref.device, dtype=dtype), ref.to(dtype)
        error = (value - ref).abs()
        bound = atol + rtol * (ref.abs() if relative_to == "entry" else largest)
        bad = ~(error <= bound)  # NaN counts as a mismatch
        if bool(bad.any()):
            bound = torch.broadcast_to(torch.as_tensor(bound, dtype=dtype, device=ref.device), error.shape)
            k = int(torch.where(bad.flatten(), error.flatten().nan_to_num(float("inf")), -1.0).argmax())
            out.append(f"{prefix}{name!r} differs by {error.flatten()[k].item():.3g} at entry {k} (allowed "
                       f"{bound.flatten()[k].item():.3g}; largest entry of the oracle's {largest:.3g})")
    return out


def max_relative_error(got: dict, expected: dict) -> tuple[float, str]:
    """(max |got - expected| / the largest |expected| of all parameters (the absolute error where that is 0), the
    worst parameter's name): the measure that ``mismatches(..., relative_to="largest")`` bounds, for reports.
    Names and shapes must match."""
    assert set(got) == set(expected), f"parameter names differ: {sorted(set(got) ^ set(expected))}"
    largest = max((r.abs().max().item() for r in expected.values() if r.numel()), default=0.0) or 1.0
    worst, worst_name = 0.0, ""
    for name, ref in expected.items():
        assert got[name].shape == ref.shape, f"{name}: shape {tuple(got[name].shape)} != {tuple(ref.shape)}"
        error = (got[name].to(ref.device) - ref).abs().max().item() if ref.numel() else 0.0
        if not error / largest <= worst:  # also catches NaN, which no later parameter replaces
            worst, worst_name = error / largest, name
            if math.isnan(worst):
                break
    return worst, worst_name


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
