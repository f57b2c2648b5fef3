"""Proofs memoised by the structure of the graph they were made on (``ProofMemo``).

A proof (``proof.prove``) reads every node's shapes and applies a rule to each: on a 12-layer GPT-2 it costs twenty
times a plain walk of the graph. What it proves depends on the graph alone, never on the values in it: the node types,
how they connect, the attributes and shapes the rules read. So the engine proves each backward's graph from a memo
keyed by the structure, read in one walk:

- every node's type, which edges lead where (by position in the walk), where the walk stopped (the model's outputs, for
  the loss check), and whether a layer call reads its gradient there;
- every tensor's rank: each node's outputs' ranks, but where the key already determines them (``_KEEPS_RANK``,
  ``_FIXED_RANK``, ``_BROADCASTS_LISTED``). Broadcasting aligns shapes from the right, so a rank says which axis meets
  the batch's: ``g [B, 1, D]`` expanded to ``[B, B, D]`` keeps each row one sample, ``g [B, D]`` puts every sample in
  each row;
- for each node whose rule reads attributes (reductions, softmaxes, slices, transposes, indexing, padding, ...), those
  attributes (a slice's bounds as whether it keeps its whole axis, an index as which dimensions it picks). Element-wise
  operations, convolutions, poolings and per-sample normalisations read only where the batch sits: their key is their
  type;
- whether the batch has one sample (every size of 1 is then the batch's).

A user's ``autograd.Function`` has no rule, whatever its name (``rules.ruled``): its key is its name alone.

A key seen before gives the proof made on it (which layer calls and input readings were proven, in which layout), once
each of its views is proven again, alone, from the rows the proof gave its output (``_views_hold``): where a reshape
puts the batch depends on how its sizes relate to the batch's (``reshape(4, -1)`` keeps each row one sample at B = 4,
and puts two in a row at B = 8). Any other graph is proven in full and remembered. A layer call's layout taken from the
memo is still checked against the call's own shape (``layout.map_from_layout``): a layout that does not fit is read by
tag passes.
"""
from __future__ import annotations

from collections import OrderedDict

from . import rules as _rules
from .proof import CALL_EDGE, Proof, prove

# The attributes each rule reads (by node type). The sizes the rules read are not in the key (sequence lengths and
# widths change from batch to batch without changing which rows meet): a layout taken from the memo must fit each
# call's shape, and a view, whose result depends on its sizes, is proven again before a proof is reused.
_DIM = ("_saved_dim",)
_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    **{name: ("_saved_dim", "_saved_keepdim") for name in _rules._REDUCTIONS},
    **{name: _DIM for name in ("Softmax", "LogSoftmax", "SafeSoftmax", "Cumsum", "Cumprod", "Logcumsumexp", "Cummax",
                                "Cummin", "Sort", "Topk", "Gather", "Select", "Cat", "Split", "SplitWithSizes",
                                "Unbind", "Chunk", "IndexSelect")},
    **{name: ("_saved_reduction",) for name in (*_rules._POINTWISE_LOSSES, "NllLoss", "NllLoss2D", "NllLoss2d")},
    "Permute": ("_saved_dims",), "Transpose": ("_saved_dim0", "_saved_dim1"),
    "NativeLayerNorm": ("_saved_normalized_shape",),
    "ConstantPadNd": ("_saved_pad",),
}
# Node types whose outputs' ranks follow from their first input's and the attributes the key holds, whatever their
# arguments: functions of one tensor alone, transposes, slices, softmaxes, normalisations, products of fixed ranks,
# attention (the query's), reductions (their dimensions and keepdim are in the key). The key holds every other node's
# output ranks, so every tensor's rank is in it (the rank decides where broadcasting, a reduction or a view puts the
# batch). A function of a tensor and another that needs no gradient may broadcast the first to a higher rank
# (`x.masked_fill(mask, 0)` with a mask of three dimensions, `x * dropout_mask`): not one of these.
_KEEPS_RANK = {
    *_rules._REDUCTIONS, "Slice", "Narrow", "ScaledDotProductFlashAttentionForCpu", "ScaledDotProductFlashAttention",
    "ScaledDotProductEfficientAttention", "ScaledDotProductCudnnAttention",
    "Neg", "Exp", "Exp2", "Expm1", "Log", "Log1p", "Log2", "Log10", "Sqrt", "Rsqrt", "Abs", "Sign", "Sgn", "Tanh",
    "Sigmoid", "Relu", "Gelu", "Silu", "Mish", "Elu", "Selu", "Celu", "LeakyRelu", "Hardtanh", "Hardswish",
    "Hardsigmoid", "Softplus", "Softshrink", "Hardshrink", "Reciprocal", "Sin", "Cos", "Tan", "Atan", "Asin", "Acos",
    "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf", "Erfc", "Erfinv", "Square", "Logit", "LogSigmoid", "Sinc",
    "Clone", "ToCopy", "Alias", "Transpose", "Permute", "T", "Softmax", "LogSoftmax", "SafeSoftmax", "Cumsum",
    "Cumprod", "Logcumsumexp", "NativeLayerNorm", "Cat", "Split", "SplitWithSizes", "Chunk",
}
_FIXED_RANK = {"Mm", "Addmm", "Bmm"}  # (whatever their inputs)
# Element-wise functions whose every tensor argument is an input of the node (an edge, None where it needs no
# gradient): where every edge is a tensor's with a history, the output's rank is the largest of theirs, which the key
# holds. Not `where` nor `masked_fill`, whose condition or mask broadcasts without being an input.
_BROADCASTS_LISTED = {
    "Add", "Sub", "Rsub", "Mul", "Div", "Maximum", "Minimum", "Fmax", "Fmin", "Atan2", "Hypot", "Pow", "Lerp",
    "Addcmul", "Addcdiv", "Xlogy",
}
_MISSING = object()


class _Reads:
    """What the key holds of one node type (made once per type)."""

    __slots__ = ("attributes", "dim_slots", "is_slice", "is_index", "is_view", "has_facts", "keeps_rank",
                 "fixed_rank", "broadcasts_listed")

    def __init__(self, name: str, ruled: bool):
        base = name[: name.find("Backward")] if "Backward" in name else name
        rule = _rules.rule_of_name(name) if ruled else None
        ruled = rule is not None
        self.attributes = _ATTRIBUTES.get(base, ()) if ruled else ()
        self.dim_slots = tuple(k for k, a in enumerate(self.attributes) if a.startswith("_saved_dim"))
        self.is_slice = ruled and base in ("Slice", "Narrow")
        self.is_index = ruled and base == "Index"
        self.is_view = ruled and base in _rules._VIEWS
        self.has_facts = bool(self.attributes) or self.is_slice or self.is_index
        self.keeps_rank = ruled and base in _KEEPS_RANK
        self.fixed_rank = ruled and base in _FIXED_RANK
        self.broadcasts_listed = ruled and base in _BROADCASTS_LISTED


_READS: dict[tuple[str, bool], _Reads] = {}
#: node type -> (its name, what the key reads of it), for the types whose every node has one name (each of autograd's
#: node types, each ``autograd.Function``'s): a type's lookup saves making the name's string at every node of a walk
_BY_TYPE: dict[type, tuple[str, _Reads]] = {}


def _reads_of(node) -> tuple[str, _Reads]:
    """A node's name and what the key reads of it."""
    kind = type(node)
    known = _BY_TYPE.get(kind)
    if known is not None:
        return known
    name = node.name()
    ruled = _rules.ruled(node)
    reads = _READS.get((name, ruled))
    if reads is None:
        reads = _READS[(name, ruled)] = _Reads(name, ruled)
    if name.rpartition("::")[2] == kind.__name__:  # (a type that names its nodes: not a generic wrapper's)
        _BY_TYPE[kind] = (name, reads)
    return name, reads


def _facts(node, reads: _Reads) -> tuple:
    facts = []
    for a in reads.attributes:
        f = getattr(node, a, _MISSING)
        facts.append(None if f is _MISSING else tuple(f) if type(f) is list else f)
    for k in reads.dim_slots:
        if _negative(facts[k]):  # -2 names the batch's axis at rank 2, not at rank 3
            shape = _rules._shape(node, 0)
            facts.append(None if shape is None else len(shape))
            break
    if reads.is_slice:  # whether it keeps every row of its axis depends on its bounds and sizes
        dim = _rules._axis(node._saved_dim, len(_rules._shape(node, 0)))
        facts.append((dim, _rules._whole(node, dim)))
    if reads.is_index:  # which dimensions it indexes (not by which values)
        facts.append(_rules.index_pattern(node))
    return tuple(facts)


def _negative(dim) -> bool:
    """Whether a saved dimension (or any of several) counts from the end (``rules._signed``)."""
    if type(dim) is int:
        return dim < 0 or dim >= 1 << 63  # (``rules._signed``: some nodes save a negative one unsigned)
    return isinstance(dim, tuple) and any(_negative(d) for d in dim)


class ProofMemo:
    """The proofs of the graphs seen so far, by structure (see the module docstring); at most ``limit`` kept."""

    def __init__(self, limit: int = 128):
        self.limit = limit
        self._entries: OrderedDict[tuple, list] = OrderedDict()
        #: how many proofs were made in full, and how many were taken from the memo (for tests and benchmarks)
        self.made = self.reused = 0

    def prove(self, roots: list, batch: int, stop=None) -> Proof:
        """``proof.prove``'s answer for the edges the engine reads (layer calls' outputs, the model input's readings,
        parameters, the edges it stopped at), and whether anything was left unproven."""
        if batch <= 0:
            return Proof({}, set(), set(), "an empty batch")
        try:
            nodes, nexts, key = _structure(roots, batch, stop)
            return self._proof(key, roots, batch, stop, nodes, nexts)
        finally:
            _rules._SHAPES.clear()
            _rules._NEXT.clear()

    def _proof(self, key: tuple, roots: list, batch: int, stop, nodes: list, nexts: list) -> Proof:
        variants = self._entries.get(key)
        entry = next((v for v in variants if _views_hold(v[0], nodes, batch)), None) if variants else None
        if entry is None:
            self.made += 1
            _rules._NEXT.clear()  # (prove's walk takes a node it has read for one it has walked)
            found = prove(roots, batch, stop)
            if variants is None:
                variants = self._entries[key] = []
                if len(self._entries) > self.limit:
                    self._entries.popitem(last=False)
            variants.append(_remember(found, nodes, nexts))
            del variants[:-_VARIANTS]
            return found
        self.reused += 1
        self._entries.move_to_end(key)
        _, values, unproven, stopped_at, recomputes = entry
        edges = {(node, nr): rows for node, nr, rows in roots if node is not None}
        for i, k, value in values:
            edge = nexts[i][k]
            edges[edge] = _concrete(value, _rules._shape(*edge), batch) if type(value) is tuple else value
        stops = {nexts[i][k] for i, k, _ in values if stop is not None and stop(*nexts[i][k])}
        return Proof(edges, {nexts[i][k] for i, k in unproven}, stops, stopped_at, recomputes)


#: proofs kept for one structure whose views place the batch differently (``_views_hold``)
_VARIANTS = 4


def _views_hold(views: list, nodes: list, batch: int) -> bool:
    """Whether each view of a remembered proof still takes the batch's rows where it did when proven. The key holds
    the node types alone; where a view puts the batch depends on how its sizes relate to the batch's, and a reshape to
    a size of the code's (``reshape(4, -1)``) keeps each row one sample at B = 4 and puts two samples in a row at B = 8.
    So each view is proven again, alone (``rules._regroup``), from the rows the proof gave its output: two shapes read
    (a sequence length that changes keeps the proof)."""
    for at, out, into, ranks in views:
        oshape, ishape = _view_shapes(nodes[at])
        if ishape is None or not oshape or not ishape or (len(oshape), len(ishape)) != ranks:
            return False  # (a view that changes rank where it did not, a squeeze of a size 1: what a dim names moves)
        if out in _LEADING and into in _LEADING:
            # The batch leading on both sides, a sample's elements one run of the flattened order on each: it stays so
            # where both leading sizes are multiples of the batch, each row one sample exactly where it is the batch.
            if (oshape[0] % batch or ishape[0] % batch or (oshape[0] == batch) != (out[1] == "identity")
                    or (ishape[0] == batch) != (into[1] == "identity")):
                return False
            continue
        rows = _concrete(out, tuple(oshape), batch) if type(out) is tuple else out
        got = None if rows is _rules.UNPROVEN else _rules._regroup(rows, oshape, tuple(ishape), batch)
        if got is None or _abstract(got) != into:
            return False
    return True


_LEADING = ((0, "identity"), (0, "blocks"))


def _view_shapes(node) -> tuple:
    """A view's output and input shapes."""
    return _rules._shape(node, 0), getattr(node, "_saved_self_sym_sizes", None) or _rules._input_shapes(node)[0]


class _Key(tuple):
    """A graph's key, its hash taken once (a key holds a few entries per node: hashing it is a walk of its own)."""

    _hash: int

    def __new__(cls, items):
        key = super().__new__(cls, items)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash


def _interesting(node) -> bool:
    """An edge into a node whose value the engine reads: a layer call's output, a reading of the model's input, a
    parameter (the loss check refuses parameters outside the model)."""
    if node.metadata.get(CALL_EDGE) is not None:
        return True
    name = node.name()
    return name == "torch::autograd::AccumulateGrad" or name == "_InputRowsNodeBackward"


def _structure(roots, batch: int, stop):
    """The walk's next edges of each node in order, and the key of the graph (see the module docstring), flat. Nodes
    are numbered as the walk discovers them; each one's entry names the numbers its edges lead to."""
    index: dict = {}
    nodes: list = []
    nexts: list = []
    key: list = [batch == 1]
    stack = []
    for node, nr, rows in roots:
        if node is not None and node not in index:
            index[node] = len(index)
            stack.append((node, index[node]))
        key.extend((index.get(node), nr, rows))
    stack.reverse()
    by_type, shapes_of = _BY_TYPE, _rules._SHAPES  # (the shapes read here serve the proof of this graph too)
    while stack:
        node, at = stack.pop()
        following = node.next_functions
        nodes.append(node)
        nexts.append(following)
        known = by_type.get(type(node))
        name, reads = known if known is not None else _reads_of(node)
        ranks = None
        if not (reads.fixed_rank or reads.keeps_rank and following and following[0][0] is not None
                or reads.broadcasts_listed and all(nxt is not None for nxt, _ in following)):
            shapes = shapes_of.get(node)
            if shapes is None:
                shapes = shapes_of[node] = tuple(m.shape for m in node._input_metadata)
            ranks = tuple(map(len, shapes))
        key.extend((at, name, len(following), CALL_EDGE in node.metadata, ranks,
                    _facts(node, reads) if reads.has_facts else None))
        for nxt, nr in following:
            if nxt is None:
                key.append(None)
                continue
            if stop is not None and stop(nxt, nr):
                key.append(-1 - nr)  # (the walk stops there: a model output)
                continue
            to = index.get(nxt)
            if to is None:
                to = index[nxt] = len(index)
                stack.append((nxt, to))
            key.append(to)
            key.append(nr)
    return nodes, nexts, _Key(key)


def _remember(found: Proof, nodes: list, nexts: list) -> tuple:
    """What the memo keeps of a full proof: no node, only positions in the walk (the graph is not held); with, for each
    view that took the batch's rows, the rows at its output and at its input (``_views_hold``)."""
    views = []
    for at, node in enumerate(nodes):
        if _reads_of(node)[1].is_view and nexts[at] and nexts[at][0][0] is not None:
            out, into = found.edges.get((node, 0)), found.edges.get(nexts[at][0])
            if isinstance(out, _rules.Rows) and isinstance(into, _rules.Rows):
                oshape, ishape = _view_shapes(node)
                ranks = (len(oshape), len(ishape)) if oshape is not None and ishape is not None else None
                views.append((at, _abstract(out), _abstract(into), ranks))
    values, unproven = [], []
    for i, following in enumerate(nexts):
        for k, (nxt, nr) in enumerate(following):
            if nxt is None:
                continue
            edge = (nxt, nr)
            if edge in found.unproven:
                unproven.append((i, k))
            if edge in found.stops or _interesting(nxt):
                values.append((i, k, _abstract(found.edges.get(edge, _rules.UNPROVEN))))
    return views, values, unproven, found.stopped_at, found.recomputes


def _abstract(value):
    """A proven ``Rows`` as the memo keeps it: where the batch sits, and how a sample's rows are laid out along that
    axis (each its own row, in blocks, interleaved), not how many rows it has (a sequence length)."""
    if not isinstance(value, _rules.Rows):
        return value
    if value.inner == 1 and value.outer == 1:
        return (value.axis, "identity")
    if value.outer == 1:
        return (value.axis, "blocks")
    if value.inner == 1:
        return (value.axis, "interleaved")
    return value  # (both: kept as it is, it fits only the sizes it was proven at)


def _concrete(value: tuple, shape, batch: int):
    """``_abstract``'s form as the ``Rows`` of an edge of ``shape``; unproven where it does not fit."""
    axis, kind = value
    if shape is None or axis >= len(shape) or shape[axis] % batch:
        return _rules.UNPROVEN
    count = shape[axis] // batch
    if kind == "identity":
        return _rules.Rows(axis) if count == 1 else _rules.UNPROVEN
    return _rules.Rows(axis, count, 1) if kind == "blocks" else _rules.Rows(axis, 1, count)
