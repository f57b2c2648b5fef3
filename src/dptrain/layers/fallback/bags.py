"""Calls whose samples are segments of a flat input rather than a dimension of the arguments (an
``nn.EmbeddingBag``'s bags given as 1-D ids with offsets): each bag's arguments cut out of the call, one replay
per bag."""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from .parts import _FallbackParts
from .replay_context import autograd_vjp


class _FlatBags(_FallbackParts):
    """``FallbackRule``'s per-sample gradients of a call of flat bags (mixed into it)."""

    def _per_sample_of_bags(self, module, call, g, primals) -> dict[str, torch.Tensor]:
        """Per-sample gradients of a call whose samples are segments of a flat input: one replay per bag, made of
        that bag's ids (and weights) alone. A loop, not a vmap: the bags have different lengths."""
        device, enabled, dtype = call.autocast
        args, kwargs = call.arguments()
        per_bag = _flat_bags(module, args, kwargs)
        assert per_bag is not None  # (call.bags: its arguments are flat bags)
        if len(per_bag) != g.shape[0]:
            raise RuntimeError(f"{self._name(module)}: {len(per_bag)} bags for an output of {g.shape[0]} rows")
        grads: dict[str, list[torch.Tensor]] = {n: [] for n in primals}
        outs = []
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for (bag_args, bag_kwargs), g_i in zip(per_bag, g):
                out, pullback = autograd_vjp(functools.partial(self._replay, module, bag_args, bag_kwargs), primals)
                for n, t in pullback(g_i.unsqueeze(0).to(out.dtype))[0].items():
                    grads[n].append(t)
                outs.append(out)
        stacked = {n: torch.stack(ts) if ts else torch.zeros(0, *primals[n].shape, dtype=primals[n].dtype,
                                                                  device=primals[n].device)
                   for n, ts in grads.items()}
        # at every call, as every replay: each bag alone gives its row of the call, and the gradients sum to its own
        whole = self._whole_vjp(module, call, primals)
        if outs and not self._rows_reproduced(call, torch.cat(outs), whole[0]):
            raise self._split_refusal(module, one_by_one=False)
        self._check_gradient_sum(module, call, g, primals, stacked, whole)
        return stacked


def _flat_bags(module: nn.Module, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]] | None:
    """An ``nn.EmbeddingBag`` called with 1-D ids and ``offsets``: the arguments of each bag alone (its ids, offsets
    ``[0]`` (``[0, n]`` with ``include_last_offset``), its ``per_sample_weights``); ``None`` for any other call.
    Each bag is one sample; the ids of all bags are not a batch dimension, so no per-sample replay can slice them.
    """
    flat = _flat_bag_arguments(module, args, kwargs)
    if flat is None:
        return None
    ids, offsets, weights = flat
    starts = offsets.tolist()  # (in the backward: the boundaries of the bags, read on the host)
    ends = starts[1:] if module.include_last_offset else starts[1:] + [ids.shape[0]]
    starts = starts[:len(ends)]
    bags = []
    for start, end in zip(starts, ends):
        bag_offsets = [0, end - start] if module.include_last_offset else [0]
        bag = {"offsets": torch.tensor(bag_offsets, dtype=offsets.dtype, device=offsets.device)}
        if weights is not None:
            bag["per_sample_weights"] = weights[start:end]
        bags.append(((ids[start:end],), bag))
    return bags


def _flat_bag_arguments(module: nn.Module, args: tuple, kwargs: dict):
    """(ids, offsets, per_sample_weights) of an ``nn.EmbeddingBag`` call with 1-D ids; ``None`` for any other call."""
    if not isinstance(module, nn.EmbeddingBag):
        return None
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    ids, offsets = bound.get("input"), bound.get("offsets")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or offsets is None:
        return None
    return ids, offsets, bound.get("per_sample_weights")
