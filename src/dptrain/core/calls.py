"""A layer call as the engine records it (``Call``), the calls a layer waits on (``CallList``) and a covered
layer's state (``LayerState``); whether a backward pass runs on this thread."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..layers.protocol import LayerDims, LayerRule
from ..rows.layout import pattern_key

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)  # (looked up once: read at every layer call)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return _graph_task_id is not None and _graph_task_id() != -1


def graph_task() -> int:
    return _graph_task_id() if _graph_task_id is not None else -1


class Call:
    """One forward call of a covered module, and later its output gradient. (A plain class whose defaults live on the
    class: one is made at every layer call of every training forward, and most fields keep their default.)"""

    version: int | None = None  # the activation's version counter when it was captured
    forward_id: int | None = None  # the model call it belongs to (None: outside one, or a recomputation)
    recomputed: bool = False  # recorded during a backward pass (checkpointing recomputes the forward)
    grad: torch.Tensor | None = None
    shape: tuple = ()  # the shape of the output (the gradient) as the rule sees it
    ordinal: int | None = None  # which call of its layer in the model call (or the recomputation); None: neither
    tagged: torch.Tensor | None = None  # its output gradient in a tag pass
    tags: torch.Tensor | None = None  # the per-sample tags of that pass
    rowmap: Any = None  # rows.RowMap, once read
    precision: torch.dtype | None = None  # the lowest precision its model call computed in (rows.computing_precision)
    broadcast: bool = False  # a call on one row, its output broadcast over the batch (broadcast.py)
    #: where its output gradient is read in the graph, for rows.proof (the call does not hold the graph): the edge
    #: (rows.proof.call_edge: a token in the node's metadata, and the output index), the shapes where it is read at
    #: a reshape's base (base, output), and whether the rule sees the output with its first two dimensions swapped
    #: (sequence first)
    edge: tuple | None = None
    edge_shape: tuple | None = None
    edge_view: tuple | None = None
    edge_swapped: bool = False
    shared_use: str | None = None  # an operation that used its output of batch size 1 without broadcasting it
    #: a gradient hook was registered during its model call (on some tensor): it acts on the gradient outside the
    #: graph, so its rows are read by tag passes, never proven
    hooked: bool = False
    #: it was given the model's input (or a view of it) as it is, token ids included, no gradient required: its rows
    #: are the samples in their order, which no gradient can show, so its output gradient's rows must be in that
    #: order too (``rows.layout.check_source_rows``). None: not given; else where that input lies in the model's
    #: (``rows.layout.source_samples``), () where it cannot be told
    source: tuple | None = None

    def __init__(self, activation: Any, dims: LayerDims, batch_size: int | None, version: int | None = None,
                 forward_id: int | None = None, recomputed: bool = False):
        self.activation, self.dims, self.batch_size = activation, dims, batch_size
        if version is not None:
            self.version = version
        if forward_id is not None:
            self.forward_id = forward_id
        if recomputed:
            self.recomputed = True

    @property
    def key(self) -> tuple:
        """``rows.pattern_key``: the shape relative to the batch size (made when asked: few calls need it)."""
        return pattern_key(self.shape, self.batch_size) if self.batch_size is not None else ()

    def __repr__(self) -> str:
        return f"Call(shape={self.shape}, batch_size={self.batch_size}, forward_id={self.forward_id})"


class CallList:
    """A layer's calls still waiting for their output gradient, held weakly.

    A call lives as long as the autograd graph that is to deliver its gradient (the hook on its output holds
    it): a forward whose graph was dropped without a backward (its loss failed, its outputs were thrown
    away) leaves nothing behind here.
    """

    def __init__(self, calls=()):
        self._refs = [weakref.ref(c) for c in calls]
        self._held = [c for c in calls if c.grad is not None]

    def _live(self) -> list[Call]:
        return [c for c in (r() for r in self._refs) if c is not None]

    def __iter__(self):
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __bool__(self) -> bool:
        return any(r() is not None for r in self._refs)

    def __getitem__(self, k):
        return self._live()[k]

    def holds(self, call: Call) -> bool:
        """Whether ``call`` is among the calls waiting."""
        return any(r() is call for r in self._refs)

    def only(self) -> Call | None:
        """The one call waiting, or None where there are none or several."""
        found = None
        for r in self._refs:
            c = r()
            if c is not None:
                if found is not None:
                    return None
                found = c
        return found

    def append(self, call: Call) -> None:
        if len(self._refs) > 8:
            self._refs = [r for r in self._refs if r() is not None]
        self._refs.append(weakref.ref(call))

    def hold(self, call: Call) -> None:
        """Keep a call that received its gradient until it is reduced: a recomputation's graph (reentrant
        checkpointing) is freed at the end of its nested backward, before the outer backward reduces it."""
        self._held.append(call)

    def clear(self) -> None:
        self._refs.clear()
        self._held.clear()


@dataclass
class LayerState:
    name: str
    module: nn.Module
    rule: LayerRule
    params: dict[str, nn.Parameter]
    _calls: CallList = field(default_factory=CallList, repr=False)

    @property
    def path(self) -> str:
        """The module's path in the model, as ``named_modules()`` gives it (``<root>``: the model itself)."""
        return self.name or "<root>"

    @property
    def calls(self) -> CallList:
        return self._calls

    @calls.setter
    def calls(self, calls) -> None:
        self._calls = calls if isinstance(calls, CallList) else CallList(calls)


def outside_model_call(state: LayerState) -> ValueError:
    """The refusal of a layer call whose samples cannot be counted: made outside a call of the model."""
    return ValueError(
        f"{state.path} ({type(state.module).__name__}) was called outside a call of the model given "
        "to the engine, or the model's input held no tensor to read the batch size from: through a plain "
        "loss.backward() the engine cannot tell which sample each row belongs to. Call the model itself "
        "(model(x)), or use engine.backward(per_sample_losses)"
    )
