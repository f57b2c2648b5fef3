"""Proving from the autograd graph that rows stay apart, without a tag pass.

A tag pass reads which sample each row belongs to from a gradient (``reading.py``); it costs a backward. Where every
operation between the per-sample losses and a tensor is known to keep each row's gradient to one sample - row-wise
activations and normalisations, reductions over other axes, matrix products with a constant, views that keep the
batch where it can be followed - the rows of that tensor are one sample's each, in a layout that follows from the
shapes alone. ``prove`` walks the graph from the losses (or the model's outputs) and propagates, edge by edge, where
the batch sits (``Rows``): at each node, a rule of its type maps where the batch sits in its output to where it sits
in each input. A node without a rule, an operation along the batch axis (a mean over the batch, an index that
picks rows), or a tensor reached in two different layouts leaves the tensors below it unproven: those are read by
tag passes as before. Nothing is proven by a rule that is not sure: a rule returns ``None`` (unproven) whenever the
shapes do not show what it needs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from . import rules as _rules
from .rules import FREE, RULES, UNPROVEN, Rows, _fits, _regroup, _shape, rule_of, rule_of_name  # noqa: F401


# ------------------------------------------------------------------------------------------ the walk
@dataclass
class Proof:
    """What a walk proved: where the batch sits at each edge it reached (``Rows`` or ``FREE``), the edges left
    unproven, the edges it stopped at, and the first node type it had no rule for."""

    edges: dict[tuple, object]
    unproven: set
    stops: set  # the edges the walk stopped at (``prove``'s ``stop``)
    stopped_at: str | None = None  # the first node type without a rule
    recomputes: bool = False  # it holds a region that reentrant checkpointing recomputes in the backward


def prove(roots: list[tuple[object, int, Rows]], batch: int, stop: Callable[[object, int], bool] | None = None,
          limit: int = 200_000) -> Proof:
    """Propagate where the batch sits from ``roots`` ((node, output index, Rows) of the losses or the model's outputs)
    through the graph below them. ``stop(node, index)``: an edge not to walk below (the model's outputs, for a walk
    of the loss alone); the edges it stops at are in ``Proof.stops``. Edges below an unproven one are unproven too."""
    stop = stop or (lambda node, nr: False)
    if batch <= 0:
        return Proof({}, set(), set(), "an empty batch")
    try:
        return _walk(roots, batch, stop, limit)
    finally:
        _rules._SHAPES.clear()
        _rules._NEXT.clear()


def _walk(roots, batch: int, stop, limit: int) -> Proof:
    # the nodes below the roots and how many gradients each receives (its consumers), for a walk in order
    consumers: dict[object, int] = {}
    stops: set = set()
    stack = [node for node, _, _ in roots if node is not None]
    nexts = _rules._NEXT
    while stack:
        node = stack.pop()
        if node in nexts:
            continue
        following = nexts[node] = node.next_functions
        if len(nexts) > limit:
            return Proof({}, {(n, 0) for n in nexts}, set(), "a graph too large to walk")
        for nxt, nr in following:
            if nxt is None:
                continue
            if stop(nxt, nr):
                stops.add((nxt, nr))
                continue
            consumers[nxt] = consumers.get(nxt, 0) + 1
            stack.append(nxt)
    edges: dict[tuple, object] = {}
    unproven: set = set()
    incoming: dict[object, dict[int, object]] = {}
    for node, nr, rows in roots:
        if node is not None:
            incoming.setdefault(node, {})[nr] = rows
            edges[(node, nr)] = rows  # (a root is an edge too: a model output a layer returned)
    ready = list(dict.fromkeys(node for node, _, _ in roots if node is not None and consumers.get(node, 0) == 0))
    stopped = None
    recomputes = False
    done = set()
    while ready:
        node = ready.pop()
        if node in done:
            continue
        done.add(node)
        outs = incoming.get(node, {})
        following = nexts[node]
        if any(v is UNPROVEN for v in outs.values()):
            result = UNPROVEN
        else:
            rule = rule_of(node)
            result = rule(node, outs, batch) if rule is not None else UNPROVEN
            if rule is None and following:
                name = node.name()
                stopped = stopped or name
                recomputes = recomputes or name.startswith("CheckpointFunction")
        for k, (nxt, nr) in enumerate(following):
            if nxt is None:
                continue
            value = UNPROVEN if result is UNPROVEN or k >= len(result) else result[k]
            if value is not UNPROVEN and value is not FREE and not _fits(value, _shape(nxt, nr), batch):
                value = UNPROVEN
            edge = (nxt, nr)
            previous = edges.get(edge, "unset")
            if previous != "unset" and previous != value:
                value = UNPROVEN  # reached in two layouts: the gradients of the two paths add up
            edges[edge] = value
            if value is UNPROVEN:
                unproven.add(edge)
            if edge in stops:
                continue
            incoming.setdefault(nxt, {})[nr] = value
            consumers[nxt] -= 1
            if consumers[nxt] == 0:
                ready.append(nxt)
    return Proof(edges, unproven, stops, stopped, recomputes)


# ------------------------------------------------------------------------------------------ layer calls
#: the key in an autograd node's ``metadata`` of the token that names it as a layer call's output edge
CALL_EDGE = "dptrain.call_edge"
_edge_tokens = itertools.count()


def call_edge(node, nr: int) -> tuple:
    """How a layer call remembers where its output gradient is read: a token written into the node's ``metadata``
    (which lives with the autograd node itself), and the output index; the call does not hold the graph.

    Not ``id(node)``: in torch 2.11 and earlier a node's Python object dies with its last Python reference, and
    ``grad_fn`` makes a new one at the next access. The id of a dead one was soon another node's, and the proof
    gave that node's layout to the call (the test transformer's head read as transposed at T == B: two-pass modes
    clipped at the wrong samples' norms there, and the loss check stopped at nodes that were no call).
    """
    meta = node.metadata
    token = meta.get(CALL_EDGE)
    if token is None:
        token = meta[CALL_EDGE] = next(_edge_tokens)
    return token, nr


def marked_edge(node, nr: int) -> tuple | None:
    """The key ``call_edge`` gave this edge, or None where no layer call's output is read at it."""
    token = node.metadata.get(CALL_EDGE) if node is not None else None
    return None if token is None else (token, nr)


def call_layout(proof: Proof, by_edge: dict, call, batch: int, two_axes: bool):
    """The layout (``layout.Layout``) of a layer call's rows that ``proof`` shows, or None where it does not."""
    from .layout import IDENTITY, Layout

    if call.edge is None:
        return None
    found = by_edge.get(call.edge)
    if found is None:
        return None
    (node, nr), rows = found
    if not isinstance(rows, Rows):
        return None
    if call.edge_shape is not None:  # the gradient is read at the base of a reshape of the output
        rows = _regroup(rows, call.edge_shape, call.edge_view, batch)
        if rows is None:
            return None
    if call.edge_swapped:  # the rule sees the output with its first two dimensions swapped
        rows = Rows(1 - rows.axis if rows.axis < 2 else rows.axis, rows.inner, rows.outer)
    if rows.axis == 0 and rows.outer == 1 and rows.inner == 1:
        return IDENTITY
    if rows.axis == 0 and rows.outer == 1:
        return Layout(1, "blocks")
    if rows.axis == 0 and rows.inner == 1:
        return Layout(1, "interleaved")
    if rows.axis == 1 and rows.outer == 1 and rows.inner == 1 and two_axes:
        return Layout(2, "transposed")
    return None


def edges_by_call(proof: Proof) -> dict:
    """The proof's edges where layer calls' outputs are read, keyed as the calls remember them (``call_edge``)."""
    found = {}
    for (node, nr), value in proof.edges.items():
        key = marked_edge(node, nr)
        if key is not None:
            found[key] = ((node, nr), value)
    return found
