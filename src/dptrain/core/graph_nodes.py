"""What the engine puts into the model and its autograd graph: the hooks the model holds (``EngineHook``, inert
in a copy of the model), the identity nodes through which the engine reads gradients or refuses them
(``_GradientPenalty``, ``_Origin``, ``_OutputLeaves``; ``rows.proof`` knows them by name), and the guard of a
table written in place."""
from __future__ import annotations

import functools
import weakref

import torch

from .calls import LayerState


class EngineHook(functools.partial):
    """One of the engine's hooks as the model holds it: ``EngineHook(fn)`` calls ``fn``.

    A copy of the model (``copy.deepcopy``, or ``torch.save`` then ``torch.load``) gets a ``DroppedHook`` in its
    place: a copy is a plain model, attached to no engine, and neither the engine nor its optimizer is copied
    along. Attach an engine to the copy to train it privately.
    """

    __slots__ = ()

    def __deepcopy__(self, memo):
        return DroppedHook()

    def __reduce__(self):
        return (DroppedHook, ())


class DroppedHook:
    """What an engine hook becomes in a copy of the model: nothing."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return None

    def __repr__(self) -> str:
        return "DroppedHook()"


class _GradientPenalty(torch.autograd.Function):
    """Identity on a gradient taken with ``create_graph=True`` under ``engine.paused()`` through a covered layer;
    refuses to be differentiated by a training backward (a loss built on that gradient: a gradient penalty).
    Differentiated under ``paused()`` again (a second input derivative), it is the identity.

    Ghost differentiation records no parameter in a layer's forward, so the graph of such a gradient has lost
    its direct dependence on the layer's weights: its backward would silently drop part of the penalty's
    gradient.
    """

    @staticmethod
    def forward(ctx, grad, where: str, capture: weakref.ref):
        ctx.where, ctx.capture = where, capture
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, grad):
        capture = ctx.capture()
        if capture is not None and capture.paused:
            return grad, None, None
        raise RuntimeError(
            f"the loss depends on a gradient taken through {ctx.where} with create_graph=True inside "
            "engine.paused() (a gradient penalty, or a double backward): gradient penalties are not supported with "
            "per-sample clipping yet, since the engine would drop the penalty's direct dependence on the weights. "
            "Train without the penalty term, or take that gradient without create_graph=True (detached)"
        )


class _Origin(torch.autograd.Function):
    """Identity on ``x`` that makes it require grad through ``anchor`` (no gradient flows back)."""

    @staticmethod
    def forward(ctx, anchor, x):
        if x._is_view():  # marking a view dirty would detach it from its base's history
            return x.clone()
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, None


class _OutputLeaves(torch.autograd.Function):
    """Identity (a copy of each) on the output leaves of a covered call that its rule differentiates
    (``LayerRule.capture_leaves``): one node, so its backward receives every leaf's gradient at once, after every
    tensor hook on them, the user's included, and ``None`` for a leaf that no gradient reaches in this backward (an
    output the model does not use): autograd runs a node once all the gradients it will get have arrived. ``read``
    takes them and gives back what flows on to the leaves. ``anchor`` makes the copies require grad where the leaves
    do not (the layer's parameters are switched off during its call).
    """

    @staticmethod
    def forward(ctx, anchor, read, *leaves):
        ctx.read = read
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in leaves)

    @staticmethod
    def backward(ctx, *grads):
        grads = ctx.read(grads)
        return (None, None, *(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[2:])))


def guard_written_base(rows: torch.Tensor, state: LayerState) -> None:
    """A table's rows over the batch (a view of the layer's output) whose memory was written in place in the forward.

    Writes into the table itself leave later uses of it on copies of the rows that lead to the engine's hook
    (``broadcast._write_table``). A use of another view of the output after a write leads instead through the
    write's node on the output's base (``CopySlices``), around the hook: its gradient would escape clipping. Each such
    node refuses the gradient that reaches it."""
    where = f"{state.path} ({type(state.module).__name__})"

    def refuse(grad_outputs):
        raise ValueError(
            f"the output of {where}, a table broadcast over the batch, was modified in place in the forward (e.g. "
            "`t /= 2`), and the loss depends on a view of it taken before the write or through another name: its "
            "gradient would not reach the engine, which reads each sample's part of it. Modify the table "
            "out of place (`t = t / 2`), or write it only through the name the layer returned"
        )

    assert rows._base is not None  # (a view of the layer's output)
    node = rows._base.grad_fn
    while node is not None and type(node).__name__ == "CopySlices":
        node.register_prehook(refuse)
        node = node.next_functions[0][0]
