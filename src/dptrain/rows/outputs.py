"""The model's outputs: the tensors in them, and tagging them for a plain ``loss.backward()``.

A plain backward gives the engine no per-sample losses; where a model call has patterns whose rows must be read, its
per-sample outputs pass through ``_TagRows``, whose backward first back-propagates the output gradient with per-sample
tags on its rows (``runner.BackwardRunner.tag_outputs``).
"""
from __future__ import annotations

import copy
import dataclasses
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .inputs import _InputRowsNode


def gradient_edge(x: torch.Tensor):
    """What a backward from ``x`` starts at, without keeping ``x`` (and its memory) alive: its gradient edge where
    torch has them (2.3 and later), else ``x`` itself."""
    get = getattr(torch.autograd.graph, "get_gradient_edge", None)
    return get(x) if get is not None and x.grad_fn is not None else x


class _TagRows(torch.autograd.Function):
    """Identity; its backward first back-propagates the output gradient with per-sample tags on its rows."""

    @staticmethod
    def forward(ctx, x, run, axis):
        # the edge, not the output: saving the output would keep it (a language model's [B, T, V] logits) alive
        # until the backward, past the point where the loss's backward frees it
        ctx.run, ctx.axis, ctx.edge = run, axis, gradient_edge(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.run(ctx.edge, grad, ctx.axis)
        return grad, None, None


#: how many containers deep the tensors of a model's input or output are looked for (a model call's (args, kwargs)
#: count as one; a container that holds itself stops there)
DEPTH = 16


def _items(obj):
    """The items of a container the engine looks into (tuple/list/named tuple, dict or any other ``Mapping``
    (``UserDict``, a tokenizer's ``BatchEncoding``), Hugging Face ModelOutput, dataclass, ``types.SimpleNamespace``), or
    None for anything else."""
    if isinstance(obj, (tuple, list)):
        return obj
    if isinstance(obj, Mapping):
        return obj.values()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, types.SimpleNamespace):
        return vars(obj).values()
    return None


def tensors_in(obj, depth: int = 0, whole: tuple[type, ...] = ()):
    """The tensors in a model's input or output, in order, in the containers ``_items`` names, up to ``DEPTH``
    containers deep; objects of the types ``whole`` are yielded as they are, not looked into."""
    if isinstance(obj, torch.Tensor) or whole and isinstance(obj, whole):
        yield obj
    elif depth < DEPTH:
        for item in _items(obj) or ():
            yield from tensors_in(item, depth + 1, whole)


def _leaves(obj, depth: int = 0):
    """``tensors_in``'s tensors, and the objects that hold tensors where it does not look (attributes of a class of the
    user's)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < DEPTH and obj is not None and not isinstance(obj, (str, bytes, int, float)):
        items = _items(obj)
        if items is not None:
            for item in items:
                yield from _leaves(item, depth + 1)
        elif not isinstance(obj, (type, types.ModuleType, torch.nn.Module)) and any(
                isinstance(v, torch.Tensor) for v in getattr(obj, "__dict__", {}).values()):
            yield obj


def refuse_uncarried(inputs, batch: int | None, axis: int) -> None:
    """Refuse a model call's input whose rows the engine cannot carry (``Capture._carry_inputs``): what the forward
    computes from it before its first trainable layer would not be in the graph, and a mixing of the samples there
    would not be seen. A complex tensor with the batch (its gradient's rows are not read), and an object of the user's
    holding tensors in its attributes (it cannot be rebuilt with the carried copies)."""
    for leaf in _leaves(inputs):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"the model's input holds a {type(leaf).__name__} whose attributes hold tensors: the engine passes "
                "each floating-point input with the batch through a copy that carries its rows (what the forward "
                "computes from it is then checked for mixing samples) and cannot rebuild this object with the "
                "copies. Give the model its tensors in a dict, a dataclass, a named tuple or a types.SimpleNamespace"
            )
        if leaf.is_complex() and leaf.dim() > axis and leaf.shape[axis] == batch:
            raise TypeError(
                f"the model's input holds a complex tensor of shape {tuple(leaf.shape)} with the batch: the row check "
                "carries real floating-point inputs only, so what the forward computes from it would not be checked "
                "for mixing samples. Give the model its real and imaginary parts (torch.view_as_real(x))"
            )


def map_tensors(obj, fn, depth: int = 0):
    """``obj`` with ``fn(t)`` in place of each tensor ``t`` found as ``tensors_in`` finds them. A container in which
    nothing changed is returned as it is; one in which something did is a new one of its type (a named tuple, a
    ``Mapping`` or a dataclass copied, then its entries set): the caller's objects are never modified."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth >= DEPTH:
        return obj
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(x, fn, depth + 1) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, Mapping):
        entries = {k: map_tensors(v, fn, depth + 1) for k, v in obj.items()}
        if all(entries[k] is v for k, v in obj.items()):
            return obj
        if type(obj) is dict:
            return entries
        try:
            new: Any = copy.copy(obj)  # (a mapping of the user's: set item by item, or TypeError)
            for k, v in entries.items():
                if v is not obj[k]:
                    new[k] = v
            return new
        except TypeError:  # (a read-only mapping: made from the entries, as a dict is)
            try:
                new = type(obj)(entries)  # type: ignore[call-arg]  # (a Mapping of the user's: its own constructor)
            except Exception:  # noqa: BLE001  (any constructor's error: the refusal below says what to do)
                new = None
            if isinstance(new, type(obj)) and all(new[k] is v for k, v in entries.items()):
                return new
            raise TypeError(
                f"the model's input holds a {type(obj).__name__}, a read-only Mapping that cannot be made from a dict "
                "of its entries: the engine passes each floating-point input with the batch through a copy that "
                "carries its rows (what the forward computes from it is then checked), and could only give the model "
                "a plain dict in its place. Give the model a dict, or a Mapping that supports item assignment or "
                f"{type(obj).__name__}(dict_of_entries)"
            ) from None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn, depth + 1) for f in dataclasses.fields(obj)}
        if all(v is getattr(obj, k) for k, v in changes.items()):
            return obj
        new = copy.copy(obj)
        for k, v in changes.items():
            object.__setattr__(new, k, v)
        return new
    if isinstance(obj, types.SimpleNamespace):
        changes = {k: map_tensors(v, fn, depth + 1) for k, v in vars(obj).items()}
        if all(v is getattr(obj, k) for k, v in changes.items()):
            return obj
        new = copy.copy(obj)
        for k, v in changes.items():
            setattr(new, k, v)
        return new
    return obj


#: the key in an autograd node's ``metadata`` that marks a layer call's output as computed from the model's input
#: (its input was a copy that carries the input's rows, handed over as the original: ``Capture._uncarried``)
FROM_INPUT = "dptrain.from_input"


def carries_input_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` is computed from the model's input: its autograd graph reaches a tensor that carries the
    input's rows (``_InputRowsNode``), or a layer call that was given one (``FROM_INPUT``)."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if isinstance(node, _InputRowsNode._backward_cls) or node.metadata.get(FROM_INPUT):  # type: ignore[attr-defined]  # (torch's stub: metadata a method, a dict in fact)
            return True
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def tag_rows(output, batch: int | None, axis: int, run, from_input: bool = False, tagged: list | None = None):
    """The model's output with every per-sample tensor (``batch`` rows along ``axis``) passed through
    ``_TagRows``; containers are rebuilt (tuples) or updated (dicts, dataclasses).

    ``from_input``: only tensors computed from the model's input are per-sample (``carries_input_rows``): a
    table returned next to the features, whatever its number of rows, is not. Where no output can be followed
    to the input (a compiled model's graph hides the copy), every output of ``batch`` rows is tagged. ``tagged``
    (a list) gets a weak reference to the ``_TagRows`` node of each tensor tagged (its ``edge`` and ``axis``)."""
    def tag(t: torch.Tensor, found: int) -> torch.Tensor:
        out = _TagRows.apply(t, run, found)
        if tagged is not None:  # (its node, held weakly: the graph holds this list, through ``run``)
            tagged.append(weakref.ref(out.grad_fn))
        return out

    return map_per_sample(output, batch, axis, tag, from_input)


def map_per_sample(output, batch: int | None, axis: int, fn, from_input: bool = False, others: bool = False):
    """The model's output with ``fn(tensor, its batch axis)`` in place of every per-sample tensor (one that requires
    gradients, with ``batch`` rows along ``axis``, or along 0 where a sequence-first model's output was pooled);
    containers are rebuilt (tuples) or updated (lists, dicts, dataclasses). ``from_input``: see ``tag_rows``.
    ``others``: ``fn(tensor, None)`` in place of every other floating-point tensor that requires gradients."""
    if batch is None:
        return None
    if from_input:
        outputs = [t for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
        # (one output is per-sample or refused anyway: the graph is walked only to tell several apart)
        from_input = len(outputs) > 1 and any(carries_input_rows(t) for t in outputs)

    def wrap(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            if not (obj.requires_grad and obj.is_floating_point()):
                return obj
            if from_input and not carries_input_rows(obj):
                return fn(obj, None) if others else obj
            # a sequence-first model's output may lead with its batch after pooling; both axes the batch: unclear
            found = [a for a in dict.fromkeys((axis, 0)) if obj.dim() > a and obj.shape[a] == batch]
            if len(found) != 1:
                return fn(obj, None) if others else obj
            return fn(obj, found[0])
        if depth >= 4:
            return obj
        if isinstance(obj, tuple):
            items = [wrap(x, depth + 1) for x in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if isinstance(obj, list):
            obj[:] = [wrap(x, depth + 1) for x in obj]
            return obj
        if isinstance(obj, dict):
            for k in list(obj.keys()):
                obj[k] = wrap(obj[k], depth + 1)
            return obj
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                setattr(obj, f.name, wrap(getattr(obj, f.name), depth + 1))
            return obj
        return obj

    return wrap(output)
