"""Tensors held inside objects other than tensors (a cache of keys and values among a call's arguments or in its
output): finding them (``_tensors_within``), whether an argument is such an object a call could change
(``_may_change``), copying one with its tensors detached (``_snapshot``), and the places to put another tensor in
(``_tensor_slots``)."""
from __future__ import annotations

import copy
import enum
import functools
from typing import Any, Callable

import torch
from torch import nn


def _tensors_within(obj, depth: int = 0):
    """The tensors in ``obj``: itself, or those its containers and attributes hold (a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and not isinstance(obj, (str, bytes, type, nn.Module)):
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        else:
            items = list(getattr(obj, "__dict__", {}).values())
            items += [getattr(obj, n, None) for n in getattr(type(obj), "__slots__", ()) if isinstance(n, str)]
        for item in items:
            yield from _tensors_within(item, depth + 1)


def _may_change(obj) -> bool:
    """Whether an argument is an object a call could change (a cache of keys and values it adds its own to): not a
    tensor, a plain value, a module, a type or a function."""
    return not (obj is None or isinstance(obj, (torch.Tensor, int, float, bool, str, bytes, complex, torch.dtype,
                                                torch.device, torch.Size, slice, type, nn.Module, enum.Enum))
                or callable(obj))


def _snapshot(obj):
    """A deep copy of ``obj`` whose tensors are its own, detached (no copy of their data); ``obj`` itself where it
    cannot be copied."""
    try:
        return copy.deepcopy(obj, memo={id(t): t.detach() for t in _tensors_within(obj)})
    except Exception:  # an object that cannot be copied: the replay takes it as it is
        return obj


def _tensor_slots(obj, depth: int = 0):
    """(tensor, setter) for each tensor ``_tensors_within(obj)`` yields, in its order; the setter puts another tensor in
    its place (``None`` inside a tuple or set, which cannot be changed in place, or for ``obj`` itself)."""
    if isinstance(obj, torch.Tensor):
        yield obj, None
        return
    if depth >= 4 or isinstance(obj, (str, bytes, type, nn.Module)):
        return
    items: list[tuple[Any, Callable | None]]
    if isinstance(obj, dict):
        items = [(v, functools.partial(obj.__setitem__, key)) for key, v in obj.items()]
    elif isinstance(obj, list):
        items = [(v, functools.partial(obj.__setitem__, j)) for j, v in enumerate(obj)]
    elif isinstance(obj, (tuple, set, frozenset)):
        items = [(v, None) for v in obj]
    else:
        attrs = getattr(obj, "__dict__", {})
        items = [(v, functools.partial(attrs.__setitem__, name)) for name, v in attrs.items()]
        items += [(getattr(obj, n, None), functools.partial(setattr, obj, n))
                  for n in getattr(type(obj), "__slots__", ()) if isinstance(n, str)]
    for item, setter in items:
        if isinstance(item, torch.Tensor):
            yield item, setter
        else:
            yield from _tensor_slots(item, depth + 1)
