"""The specification every clipping mode is tested against: one sample at a time through autograd.

Public so that users can check their own layer rules::

    ref = dptrain.testing.reference_clipped_gradient(
        model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), (x, y), max_grad_norm=1.0)

The oracle shares no code with the engine: per-sample gradients come from autograd on
each sample alone, and the clipping functions and groups are written out again here.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn


def _slice_batch(batch, i: int):
    if isinstance(batch, torch.Tensor):
        return batch[i : i + 1]
    if isinstance(batch, dict):
        return {k: _slice_batch(v, i) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_batch(v, i) for v in batch)
    return batch


def _batch_len(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch
    return next(_batch_len(v) for v in values if isinstance(v, (torch.Tensor, dict, tuple, list)))


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
    for i in range(_batch_len(batch)):
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
    named = trainable_named_parameters(model)
    grads = per_sample_gradients(model, losses_fn, batch)
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
