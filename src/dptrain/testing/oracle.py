"""The oracle: the clipped sum written out from its definition, one sample at a time through plain autograd.

It shares no code with the engine: per-sample gradients come from autograd on each sample alone, and the clipping
functions and groups are written out again here. ``threshold_between`` picks a ``max_grad_norm`` that clips some
samples and not others, so that a comparison tests the clipping factors and not only the sum.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..data.batches import batch_len
from ..layers.registry import layer_params


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


def gradients(loss: torch.Tensor, params: list, retain_graph: bool = False) -> list:
    """``d loss / d params`` (None for a parameter it does not use). Reentrant activation checkpointing refuses
    ``torch.autograd.grad``: there it is read with ``loss.backward()``, each parameter's ``.grad`` put back as it was."""
    try:  # (the graph kept: where checkpointing refuses, it does so on the way, after freeing what it passed)
        return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        loss.backward(retain_graph=retain_graph)
        return [None if p.grad is None else p.grad.detach() for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def per_sample_gradients(model: nn.Module, losses_fn: Callable, batch) -> dict[str, torch.Tensor]:
    """{name: [B, *shape]} gradients of each sample's loss, from one autograd call per sample."""
    from ..core.attached import is_attached

    if is_attached(model):
        raise RuntimeError(
            "the oracle differentiates the model one sample at a time with plain autograd, but a PrivacyEngine is "
            "attached to it: its layers' parameters do not require gradients during their own calls (ghost "
            "differentiation), so the oracle would see none. Run it on a copy taken before attach "
            "(copy.deepcopy(model)), or after engine.detach()")
    named = trainable_named_parameters(model)
    params = [p for _, p in named.values()]
    rows: list[list[torch.Tensor]] = []
    samples = batch_len(batch)
    if samples is None:
        raise ValueError("the batch holds no tensor with a batch dimension: the oracle cannot tell its samples")
    for i in range(samples):
        loss = _call(losses_fn, model, _take(batch, i, i + 1))
        grads = gradients(loss.sum(), params)
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



def _call(losses_fn, model, batch):
    return losses_fn(model, *batch) if isinstance(batch, (tuple, list)) else losses_fn(model, batch)


def _per_sample(losses: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B], summing each sample's other dims (what ``engine.backward`` does)."""
    return losses.reshape(losses.shape[0], math.prod(losses.shape[1:])).sum(1)
