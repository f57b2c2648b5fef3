"""Affine normalisation layers: LayerNorm, GroupNorm, InstanceNorm1d/2d/3d, RMSNorm.

Their per-sample gradients are small (one value per channel), so they are always
instantiated: weight grad_i = sum_t xhat_i[t] * g_i[t], bias grad_i = sum_t g_i[t], with
xhat the normalised input recomputed from the saved input in the backward (Lee & Kifer
section 5.5). None of them mixes samples: the statistics are per sample.
"""
from __future__ import annotations

import contextvars
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .fallback import FallbackCall, FallbackOperands, replay, replaying
from .numerics import accumulation_dtype, autocast_state, close, float32_at_least
from .protocol import LayerDims, LayerRule, positional_inputs
from .registry import register_layer


class AffineNormRule(LayerRule):
    """The base of every normalisation rule: ``y = weight * xhat + bias`` with ``xhat`` the normalised
    input, one parameter element per normalised feature (or channel).

    A norm's rule is this class with two methods: ``normalized(module, x)``, ``xhat`` recomputed from
    the saved input as the forward computes it, and ``channels_last(module, t)``, a view of a tensor of
    the output's shape with the parameter's elements in the last dim (and ``dims``, the sizes for the
    planner). ``param_names = ("weight",)`` for a norm without a bias (an RMS norm).

    Operands are the per-sample sums over positions (sum_t xhat * g, sum_t g) as [B, 1, n], with
    n = the parameter's size: the per-sample gradients themselves, one row per call; the clipped
    gradients are their weighted sums (``LayerRule.clipped_grads``).

    They are formed in float32 (or wider) from low-precision activations and output gradients, as
    torch's own normalisation kernels accumulate them, and are tiny, so nothing of size T is kept.
    """

    def normalized(self, module, x: torch.Tensor) -> torch.Tensor:
        """``xhat``, the normalised input, recomputed from the saved input ``x`` as the module's forward computes it."""
        raise NotImplementedError

    def channels_last(self, module, t: torch.Tensor) -> torch.Tensor:
        """[B, ..., n] view with the parameter's elements in the last dim."""
        raise NotImplementedError

    def operands(self, module, activation, grad_output):
        """The per-sample sums over positions ``(sum_t xhat * g, sum_t g)``, each ``[B, 1, n]``."""
        x = activation
        xhat = self.normalized(module, x)
        acc = accumulation_dtype(xhat.dtype, grad_output.dtype)
        B = x.shape[0]

        def summed(t):
            t = self.channels_last(module, t)
            return t.reshape(B, math.prod(t.shape[1:-1]), t.shape[-1]).sum(1, keepdim=True, dtype=acc)

        return summed(xhat.to(acc) * grad_output.to(acc)), summed(grad_output)

    def per_sample_grads(self, module, ops, names):
        """The weight's and the bias's per-sample gradients: the operands, reshaped to ``[B, *param.shape]``."""
        scaled, g = ops
        out = {}
        if "weight" in names:
            out["weight"] = scaled.sum(1).reshape(scaled.shape[0], *module.weight.shape)
        if "bias" in names:
            out["bias"] = g.sum(1).reshape(g.shape[0], *module.bias.shape)
        return out


class _TrailingDimsNorm(AffineNormRule):
    """Norms whose parameter covers the trailing ``normalized_shape`` dims (LayerNorm, RMSNorm)."""
    rows_fold_into_tokens = True

    def dims(self, module, activation, output):
        n = math.prod(module.normalized_shape)
        return LayerDims(T=activation.numel() // max(1, activation.shape[0] * n), p=n, d=1, ghost_supported=False)

    def channels_last(self, module, t):
        k = len(module.normalized_shape)
        return t.reshape(*t.shape[: t.dim() - k], math.prod(module.normalized_shape))

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() <= len(module.normalized_shape):
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} with no batch dimension "
                f"before normalized_shape={tuple(module.normalized_shape)}"
            )
        return x.detach()


@register_layer
class LayerNormRule(_TrailingDimsNorm):
    module_types: tuple[type[nn.Module] | str, ...] = (nn.LayerNorm,)

    def normalized(self, module, x):  # statistics in float32 for bf16/fp16 inputs, as torch's kernel
        return F.layer_norm(float32_at_least(x), module.normalized_shape, eps=module.eps)


if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_layer
    class RMSNormRule(_TrailingDimsNorm):
        module_types = (nn.RMSNorm,)
        param_names = ("weight",)

        def normalized(self, module, x):
            # torch computes in float32 for bf16/fp16 inputs, and its default eps is that of the
            # computation dtype (float32), not finfo(bfloat16).eps = 2^-7 (which, on activations of
            # small scale, would change the normalised values far beyond rounding)
            x = float32_at_least(x)
            eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
            dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
            return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)


class _ChannelNorm(AffineNormRule):
    """Norms of [B, C, *spatial] inputs with one parameter per channel."""

    def dims(self, module, activation, output):
        return LayerDims(T=math.prod(activation.shape[2:]), p=activation.shape[1], d=1, ghost_supported=False)

    def channels_last(self, module, t):
        return t.reshape(t.shape[0], t.shape[1], math.prod(t.shape[2:])).transpose(1, 2)


@register_layer
class GroupNormRule(_ChannelNorm):
    module_types: tuple[type[nn.Module] | str, ...] = (nn.GroupNorm,)

    def capture(self, module, inputs, output):
        return inputs[0].detach()

    def normalized(self, module, x):
        return F.group_norm(float32_at_least(x), module.num_groups, eps=module.eps)


@register_layer
class InstanceNormRule(_ChannelNorm):
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() != module._get_no_batch_dim() + 1:
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} without a batch dimension; "
                "private training needs batched inputs [B, C, ...]"
            )
        return x.detach()

    def normalized(self, module, x):
        return F.instance_norm(float32_at_least(x), eps=module.eps)


# --------------------------------------------------------------------------- recognised RMS norms
#: attribute names under which RMS-norm classes keep their epsilon (torch, timm, Hugging Face)
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _eps_of(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def recognise_rms_norm(module: nn.Module, fallback: LayerRule | None = None) -> RecognisedRMSNormRule | None:
    """A rule for a module that looks like an RMS norm, or ``None``.

    Recognised by structure, not by class name (``transformers`` alone has about a hundred RMS
    norm classes): no submodules, one parameter ``weight`` of shape ``[d]``, and an epsilon
    attribute. Whether it really computes ``w * x / rms(x)`` (or Gemma's ``(1 + w) * ...``) over
    the last dim is checked numerically on its first call with each input shape; a module that
    fails the check is handed to ``fallback`` (the per-sample fallback, exact) or, without one,
    refused.
    """
    if next(module.children(), None) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1 or _eps_of(module) is None:
        return None
    return RecognisedRMSNormRule(fallback)


@dataclass
class NormCall:
    """A recognised norm's call: its input, the input's version counter, and the autocast it ran under."""

    x: torch.Tensor
    version: int
    autocast: tuple[str, bool, torch.dtype]


class NotAnRMSNorm(ValueError):
    """A module recognised as an RMS norm by its structure failed the numerical check."""


class RecognisedRMSNormRule(AffineNormRule):
    """An RMS norm found by :func:`recognise_rms_norm`: ``s(w) * xhat`` with ``s(w) = w`` or ``1 + w``.

    Both give the per-sample gradient ``sum_t xhat_i[t] * g_i[t]``. ``xhat`` is the module's own:
    its forward replayed with the weight that makes ``s(w) = 1``, so every rounding it does
    inside (statistics in float32, casts back) is reproduced exactly. One instance per module.

    A module that fails the check (a layer norm without bias, a gated norm taking two inputs) is
    never trusted to the formula: from then on every call goes to ``fallback``, or is refused.
    """

    param_names = ("weight",)

    def __init__(self, fallback: LayerRule | None = None):
        self.fallback = fallback
        self.failed: str | None = None  # why the check failed: the fallback has the module since
        self.one_plus: bool | None = None  # Gemma's (1 + w); decided by the first check
        self._checked: set[tuple] = set()

    # Calls recorded after a failed check belong to the fallback: every method follows the call's kind.
    def capture_call(self, module, args, kwargs, output):
        if self.failed is None:
            try:
                return self._capture_norm(module, args, kwargs, output)
            except NotAnRMSNorm as err:
                if self.fallback is None:
                    raise ValueError(f"{err}: register a rule for it with dptrain.register_layer, freeze its "
                                     "weight, or allow the per-sample fallback (allow_fallback=True)") from None
                self.failed = str(err)
                warnings.warn(f"{err}: it uses the per-sample fallback instead (exact, slower)", stacklevel=2)
        return self.fallback.capture_call(module, args, kwargs, output)

    def _capture_norm(self, module, args, kwargs, output):
        inputs = positional_inputs(module, args, kwargs)
        x = inputs[0] if inputs else None
        d = module.weight.shape[0]
        if len(inputs) != 1 or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != d:
            raise NotAnRMSNorm(
                f"{type(module).__name__} looks like an RMS norm over a last dim of {d}, but it was called with "
                f"{_describe_inputs(inputs)}"
            )
        autocast = autocast_state(x.device.type)
        key = (tuple(x.shape), x.dtype, autocast)
        if key not in self._checked and not x.is_meta:  # a meta tensor has shapes only (plan): nothing to check
            self._check(module, x, output)
            self._checked.add(key)
        return NormCall(x.detach(), x._version, autocast)

    def _check(self, module, x, output):
        """Numerical check of the structure: the module's output is s(w) * x / sqrt(mean(x^2) + eps)."""
        w = module.weight
        problems = []
        with torch.no_grad():
            try:
                at_zero = replay(module, (x,), {}, {"weight": torch.zeros_like(w)})
                at_one = replay(module, (x,), {}, {"weight": torch.ones_like(w)})
            except (RuntimeError, ValueError, TypeError) as err:
                raise NotAnRMSNorm(f"{type(module).__name__} looks like an RMS norm, but its forward could not be "
                                   f"replayed with another weight ({err})") from None
            one_plus = bool(at_zero.abs().max() > 0) if at_zero.numel() else bool(self.one_plus)
            xhat, expected = (at_zero, (1 + w) * at_zero) if one_plus else (at_one, w * at_one)
            xf = float32_at_least(x)
            formula = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _eps_of(module))
            tol = max(16 * torch.finfo(torch.float32).eps, 4 * torch.finfo(output.dtype).eps)
            if not close(xhat, formula, tol):
                problems.append("its normalised input is not x / sqrt(mean(x^2) + eps) over the last dim")
            if one_plus and not close(at_one, 2 * at_zero, tol):
                problems.append("its output is not affine in the weight")
            if not close(output, expected, tol):
                problems.append(f"its output is not {'(1 + weight)' if one_plus else 'weight'} * that")
            if self.one_plus is not None and one_plus != self.one_plus:
                problems.append("it scaled by weight on one call and by (1 + weight) on another")
        if problems:
            raise NotAnRMSNorm(
                f"{type(module).__name__} looks like an RMS norm (one weight of shape [{w.shape[0]}] and an epsilon), "
                f"but {'; '.join(problems)}, so the RMS-norm rule would give wrong per-sample gradients"
            )
        self.one_plus = one_plus

    def dims(self, module, activation, output):
        if isinstance(activation, FallbackCall):
            return self.fallback.dims(module, activation, output)
        n, x = module.weight.numel(), activation.x
        return LayerDims(T=x.numel() // max(1, x.shape[0] * n), p=n, d=1, ghost_supported=False)

    def expand_batch(self, module, activation, output, batch):
        if isinstance(activation, FallbackCall):
            return self.fallback.expand_batch(module, activation, output, batch)
        return None

    def operands(self, module, activation, grad_output):
        if isinstance(activation, FallbackCall):
            return self.fallback.operands(module, activation, grad_output)
        if activation.x._version != activation.version:
            raise RuntimeError(
                f"the input of {type(module).__name__} was modified in place after the norm used it (e.g. `h += "
                "norm(h)`), so its per-sample gradients cannot be computed: use an out-of-place operation"
            )
        device, enabled, dtype = activation.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):  # xhat as the forward computed it
            return super().operands(module, activation.x, grad_output)

    def regroup_call(self, module, activation, grad, samples, batch):
        """A call's rows regrouped by unit (``LayerRule.regroup_call``; at user level, each row one of the unit's
        examples): the operands are sums over each row's positions, so a unit's are its rows' sums added up."""
        if isinstance(activation, FallbackCall):
            return self.fallback.regroup_call(module, activation, grad, samples, batch)
        ops = self.operands(module, activation, grad)
        kept = (samples >= 0).to(grad.device)
        units = samples.to(grad.device)[kept]
        regrouped = tuple(o.new_zeros(batch, *o.shape[1:]).index_add_(0, units, o[kept]) for o in ops)
        return regrouped, [self.dims(module, activation, grad)]

    def concat_calls(self, calls):
        kinds = {isinstance(ops[0], FallbackOperands) for ops in calls}
        if len(kinds) > 1:
            raise RuntimeError(
                f"a module recognised as an RMS norm failed its check on a later call of the same step ({self.failed}); "
                "its earlier calls used the norm rule: run this step again (every call now uses the fallback)"
            )
        return self.fallback.concat_calls(calls) if True in kinds else super().concat_calls(calls)

    def per_sample_grads(self, module, ops, names):
        if isinstance(ops[0], FallbackOperands):
            return self.fallback.per_sample_grads(module, ops, names)
        return super().per_sample_grads(module, ops, names)

    def clipped_grads(self, module, ops, factors):
        if isinstance(ops[0], FallbackOperands):
            return self.fallback.clipped_grads(module, ops, factors)
        return super().clipped_grads(module, ops, factors)

    def channels_last(self, module, t):
        return t

    def normalized(self, module, x):
        w = module.weight
        identity = torch.zeros_like(w) if self.one_plus else torch.ones_like(w)
        with torch.no_grad():
            if module._buffers:  # (a buffer the forward might update: the generic replay, which copies them)
                return replay(module, (x,), {}, {"weight": identity})
            return _with_weight(module, identity, x)


def _with_weight(module: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``module``'s own forward on ``x`` with ``weight`` in its weight's slot: what ``replay`` does, for a module with
    one parameter, no submodule and no buffer (a recognised RMS norm), without its generic machinery (a tenth of the
    host time: it runs at every call of every norm in every backward). Past the module's hooks, marked as a replay,
    in an empty ``contextvars`` context, and the parameter put back whatever happens."""
    slots = module._parameters
    own = slots["weight"]
    slots["weight"] = weight  # type: ignore[assignment]
    try:
        with replaying():
            return contextvars.Context().run(module.forward, x)
    finally:
        slots["weight"] = own


def _describe_inputs(inputs: tuple) -> str:
    parts = [f"a tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in inputs]
    return ", ".join(parts) if parts else "no arguments"
