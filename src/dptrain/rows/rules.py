"""The rules of the proof (``proof.py``): where the batch sits in each input of an autograd node, given where it sits
in its outputs, by node type.

A rule gets (node, where the batch sits in each output that receives a gradient, the batch size) and returns where it
sits in each input (one entry per ``next_functions`` edge: a ``Rows``, ``FREE``, or ``UNPROVEN``). It reads the node's
type, the attributes autograd saved (dimensions, bounds) and shapes, never a value: what it proves holds for every
value of the computation. A rule returns ``UNPROVEN`` whenever the shapes do not show what it needs.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


class Rows(NamedTuple):
    """Where the batch sits in a tensor: along ``axis``, of ``outer * B * inner`` rows, row ``r`` of sample
    ``(r // inner) % B`` (``inner``: a sample's rows in blocks; ``outer``: the batch repeated; one an edge)."""

    axis: int
    inner: int = 1
    outer: int = 1

    def stride(self, shape) -> int:
        """The step, in elements of the flattened tensor, from one sample to the next."""
        return self.inner * math.prod(shape[self.axis + 1:])


FREE, UNPROVEN = "free", None  # (FREE: a tensor without a batch axis, broadcast over it: its gradient sums samples)


# What one walk reads of each node, read once: reading a node's metadata makes new Python objects each time, and the
# rules ask for the same shapes several times (``prove`` fills these and empties them when it returns).
_SHAPES: dict = {}  # node -> the shapes of its outputs
_NEXT: dict = {}  # node -> its next_functions


def _shapes(node) -> tuple:
    got = _SHAPES.get(node)
    if got is None:
        got = _SHAPES[node] = tuple(m.shape for m in node._input_metadata)
    return got


def _next(node) -> tuple:
    got = _NEXT.get(node)
    if got is None:
        got = _NEXT[node] = node.next_functions
    return got


def _shape(node, nr: int):
    shapes = _shapes(node)
    return shapes[nr] if nr < len(shapes) else None


def _input_shapes(node) -> list:
    return [None if nxt is None else _shape(nxt, nr) for nxt, nr in _next(node)]


def _signed(dim: int) -> int:
    """A dimension autograd saved, with its sign: some nodes save a negative one as an unsigned 64-bit integer
    (``mean(-1)`` reads as 2**64 - 1), whose remainder would name another axis."""
    return dim - (1 << 64) if dim >= 1 << 63 else dim


def _axis(dim: int, rank: int) -> int:
    """A dimension autograd saved, as a non-negative axis of a tensor of ``rank`` dimensions (``_signed``)."""
    return _signed(dim) % max(1, rank)


def _fits(rows: Rows, shape, batch: int) -> bool:
    return shape is not None and 0 <= rows.axis < len(shape) and shape[rows.axis] == rows.outer * batch * rows.inner


# ------------------------------------------------------------------------------------------ rules

def _on_rows(rule):
    """A rule written for one output with the batch in it (``Rows``): an output without a batch (FREE) makes every
    input FREE, one unproven (or several that disagree) leaves the node unproven."""

    def wrapped(node, outs, batch):
        out = _one(outs)
        if out is UNPROVEN:
            return UNPROVEN
        if out is FREE:
            return [FREE] * len(_next(node))
        return rule(node, out, batch)

    wrapped.__doc__ = rule.__doc__
    return wrapped


@_on_rows
def _same(node, out, batch):
    """Element-wise, inputs of the output's shape or broadcast to it (right-aligned)."""
    oshape = _shape(node, 0)
    result = []
    for shape in _input_shapes(node):
        if shape is None:
            result.append(FREE)
            continue
        if shape == oshape:  # (the usual case)
            result.append(out)
            continue
        axis = out.axis - (len(oshape) - len(shape))
        if axis < 0 or shape[axis] == 1 != oshape[out.axis]:
            result.append(FREE)  # broadcast over the batch
        elif shape[axis] == oshape[out.axis]:
            result.append(Rows(axis, out.inner, out.outer))
        else:
            return UNPROVEN
    return result


def _one(outs):
    """The single output's Rows (UNPROVEN for a node with several outputs that disagree)."""
    if len(outs) == 1:
        for value in outs.values():
            return value
    values = list(outs.values())
    if not values or any(v != values[0] for v in values):
        return UNPROVEN
    return values[0]


def _along(dim_attr: str):
    """An operation along one dimension (softmax, cumsum, a sort): rows along other axes stay apart."""

    @_on_rows
    def rule(node, out, batch):
        oshape = _shape(node, 0)
        dim = _axis(getattr(node, dim_attr), len(oshape))
        return UNPROVEN if dim == out.axis else _same(node, {0: out}, batch)

    return rule


@_on_rows
def _reduction(node, out, batch):
    """sum / mean / amax ... over some dimensions (``_saved_dim``, ``_saved_keepdim``)."""
    shape = _input_shapes(node)[0]
    if shape is None:
        return UNPROVEN
    dims = getattr(node, "_saved_dim", None)
    if dims is None:
        return UNPROVEN  # a full reduction: the batch axis too
    dims = {_axis(d, len(shape)) for d in (dims if isinstance(dims, (tuple, list)) else (dims,))} if shape else set()
    keep = getattr(node, "_saved_keepdim", False)
    kept = [d for d in range(len(shape)) if d not in dims]
    axis = out.axis if keep else (kept[out.axis] if out.axis < len(kept) else None)
    if axis is None or axis in dims:
        return UNPROVEN
    return [Rows(axis, out.inner, out.outer)] + [FREE] * (len(_next(node)) - 1)


@_on_rows
def _view(node, out, batch):
    """A view or reshape: the batch's rows are followed through the flattened order where they stay in one axis."""
    oshape, ishape = _shape(node, 0), _input_shapes(node)[0]
    if oshape is None or ishape is None:
        return UNPROVEN
    found = _regroup(out, oshape, ishape, batch)
    return UNPROVEN if found is None else [found]


def _regroup(rows: Rows, oshape, ishape, batch: int) -> Rows | None:
    """Where the batch of a tensor of shape ``oshape`` (``rows``) sits in the same elements shaped ``ishape``."""
    if 0 in ishape or 0 in oshape:
        return None  # (no element: no flattened order to follow; a loss over no token, logits[:, :-1] at T = 1)
    stride = rows.stride(oshape)
    span = stride * batch  # the batch digit covers [stride, stride * batch) of the flattened index
    inner_size = 1
    for axis in range(len(ishape) - 1, -1, -1):
        size = ishape[axis]
        if stride % inner_size == 0 and stride >= inner_size and span <= inner_size * size:
            inner = stride // inner_size
            if size % (inner * batch) == 0:
                return Rows(axis, inner, size // (inner * batch))
            return None
        inner_size *= size
    return None


@_on_rows
def _transpose(node, out, batch):
    n = len(_shape(node, 0))
    if hasattr(node, "_saved_dims"):  # permute: output dim i is input dim dims[i]
        dims = [_axis(d, n) for d in node._saved_dims]
        return [Rows(dims[out.axis], out.inner, out.outer)]
    if hasattr(node, "_saved_dim0"):
        d0, d1 = _axis(node._saved_dim0, n), _axis(node._saved_dim1, n)
        axis = d1 if out.axis == d0 else d0 if out.axis == d1 else out.axis
        return [Rows(axis, out.inner, out.outer)]
    # .t(): two dims
    return [Rows(1 - out.axis, out.inner, out.outer)] if n == 2 else UNPROVEN


@_on_rows
def _slice(node, out, batch):
    """A slice or narrow along another axis than the batch's (the batch's own rows are picked otherwise), or one that
    keeps the batch's axis whole (``x[:, ...]``, which torch 2.8 records as a slice node)."""
    n = len(_shape(node, 0))
    dim = _axis(node._saved_dim, n)
    if dim == out.axis and not _whole(node, dim):
        return UNPROVEN
    return [Rows(out.axis, out.inner, out.outer)]


def _whole(node, dim: int) -> bool:
    """Whether a slice node keeps every row along ``dim``, in order."""
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    start, end, step = (getattr(node, f"_saved_{k}", None) for k in ("start", "end", "step"))
    return (sizes is not None and start == 0 and step == 1 and isinstance(end, int)
            and end >= int(sizes[dim]) and _shape(node, 0)[dim] == int(sizes[dim]))


@_on_rows
def _index_select(node, out, batch):
    """index_select along another axis than the batch's: it picks positions within each sample, whatever the index."""
    dim = _axis(node._saved_dim, len(_shape(node, 0)))
    return UNPROVEN if dim == out.axis else [Rows(out.axis, out.inner, out.outer)]


def index_pattern(node) -> tuple | None:
    """Which leading dimensions an advanced index (``x[:, idx]``) leaves whole, as the positions of its index tensors
    (a boolean mask covers as many dimensions as it has); None where they are not adjacent (their dimensions then move
    to the front)."""
    positions: list[int] = []
    at = 0
    for index in node._saved_indices:
        if index is None:
            at += 1
            continue
        span = index.dim() if index.dtype == torch.bool else 1
        positions.extend(range(at, at + span))
        at += span
    if positions and positions != list(range(positions[0], positions[-1] + 1)):
        return None
    return tuple(positions)


@_on_rows
def _index(node, out, batch):
    """Advanced indexing on dimensions after the batch's (``x[:, idx]``, a mask over positions): positions picked
    within each sample, whatever the index."""
    positions = index_pattern(node)
    if not positions or out.axis >= positions[0]:
        return UNPROVEN
    return [Rows(out.axis, out.inner, out.outer)]


@_on_rows
def _select(node, out, batch):
    ishape = _input_shapes(node)[0]
    dim = _axis(node._saved_dim, len(ishape))
    axis = out.axis if out.axis < dim else out.axis + 1
    return UNPROVEN if axis == dim else [Rows(axis, out.inner, out.outer)]


@_on_rows
def _nll(node, out, batch):
    """nll_loss / cross-entropy with reduction='none': the class dimension (1) is gone in the output."""
    if getattr(node, "_saved_reduction", 0) != 0:
        return UNPROVEN
    axis = out.axis if out.axis == 0 else out.axis + 1
    return [Rows(axis, out.inner, out.outer)] + [FREE] * (len(_next(node)) - 1)


def _pointwise_loss(node, outs, batch):
    """mse / l1 / binary cross-entropy ... with reduction='none': element-wise."""
    if getattr(node, "_saved_reduction", 0) != 0:
        return UNPROVEN
    return _same(node, outs, batch)


@_on_rows
def _matmul(node, out, batch):
    """mm / addmm / bmm: rows of the left factor stay apart when the right one holds no batch; a batched product
    keeps the batch along its batch dimension."""
    name = node.name()
    shapes = _input_shapes(node)
    oshape = _shape(node, 0)
    if name.startswith("Bmm"):
        if out.axis == 0:
            return [Rows(0, out.inner, out.outer) if s is not None else FREE for s in shapes]
        # along the rows of the left factor (or the columns of the right one): the other factor is the same for each,
        # so it holds no batch (FREE: whatever lies below it with a batch is left unproven)
        if len(shapes) == 2 and out.axis in (1, 2):
            rows = Rows(out.axis, out.inner, out.outer)
            return [rows, FREE] if out.axis == 1 else [FREE, rows]
        return UNPROVEN
    # mm (self, mat2) or addmm (bias, mat1, mat2): the rows are the left factor's
    if out.axis != 0:
        return UNPROVEN
    result = []
    for k, s in enumerate(shapes):
        if s is None:
            result.append(FREE)
        elif name.startswith("Addmm") and k == 0:  # the bias, broadcast over the rows
            result.append(FREE if len(s) < 2 or s[0] == 1 != oshape[0] else (
                Rows(0, out.inner, out.outer) if s[0] == oshape[0] else UNPROVEN))
        elif k == len(shapes) - 2 or (not name.startswith("Addmm") and k == 0):
            result.append(Rows(0, out.inner, out.outer))
        else:
            result.append(FREE)  # the right factor: the same for every row
    return result if UNPROVEN not in result else UNPROVEN


@_on_rows
def _attention(node, out, batch):
    """Fused scaled dot-product attention (flash, memory-efficient, cuDNN): each query attends over the keys of its own
    leading indices (the batch, the heads), so rows along a leading axis stay apart in the query, key and value; an
    attention bias (a fourth input) broadcasts over the leading axes."""
    oshape = _shape(node, 0)
    if oshape is None or out.axis >= len(oshape) - 2:
        return UNPROVEN  # (along the positions: a query meets every key)
    result = []
    for k, shape in enumerate(_input_shapes(node)):
        if shape is None:
            result.append(FREE)
        elif k < 3:
            if len(shape) != len(oshape) or shape[out.axis] != oshape[out.axis]:
                return UNPROVEN
            result.append(out)
        else:
            axis = out.axis - (len(oshape) - len(shape))
            if axis < 0 or shape[axis] == 1 != oshape[out.axis]:
                result.append(FREE)
            elif shape[axis] == oshape[out.axis]:
                result.append(Rows(axis, out.inner, out.outer))
            else:
                return UNPROVEN
    return result


def _leading_only(spatial: int):
    """Convolutions, pooling, per-sample normalisations: the batch must be in the first dimension."""

    @_on_rows
    def rule(node, out, batch):
        if out.axis != 0:
            return UNPROVEN
        return [Rows(0, out.inner, out.outer) if k == 0 else FREE for k in range(len(_next(node)))]

    return rule


@_on_rows
def _constant_pad(node, out, batch):
    """``F.pad`` (constant): the pairs of ``_saved_pad`` pad (or, negative, crop) the last dimensions, the batch's too
    where they reach it: ``F.pad(h, (0, 0, 1, -1))`` of ``[B, d]`` shifts every sample onto the next, its shape kept."""
    pad = [_signed(int(p)) for p in node._saved_pad]
    k = len(_shape(node, 0)) - 1 - out.axis  # (the pair of the batch's axis, counted from the last)
    if k < len(pad) // 2 and (pad[2 * k] or pad[2 * k + 1]):
        return UNPROVEN
    return [Rows(out.axis, out.inner, out.outer)] + [FREE] * (len(_next(node)) - 1)


@_on_rows
def _layer_norm(node, out, batch):
    oshape = _shape(node, 0)
    normalized = len(getattr(node, "_saved_normalized_shape", ()))
    if out.axis >= len(oshape) - normalized:
        return UNPROVEN
    return [Rows(out.axis, out.inner, out.outer)] + [FREE] * (len(_next(node)) - 1)


@_on_rows
def _cat(node, out, batch):
    oshape = _shape(node, 0)
    dim = _axis(node._saved_dim, len(oshape))
    if dim == out.axis:
        return UNPROVEN
    return [Rows(out.axis, out.inner, out.outer) if s is not None else FREE for s in _input_shapes(node)]


def _split(node, outs, batch):
    """split / chunk / unbind along another axis: every piece keeps the batch where the whole has it."""
    known = [v for v in outs.values()]
    if not known or any(v != known[0] for v in known):
        return UNPROVEN
    out = known[0]
    if out is FREE:
        return [FREE]
    ishape = _input_shapes(node)[0]
    dim = _axis(node._saved_dim, len(ishape))
    if node.name().startswith("Unbind"):
        axis = out.axis if out.axis < dim else out.axis + 1
        return UNPROVEN if axis == dim else [Rows(axis, out.inner, out.outer)]
    return UNPROVEN if dim == out.axis else [Rows(out.axis, out.inner, out.outer)]


def _shifted(leading: int):
    """An engine Function whose backward passes output k's gradient to input ``leading + k`` (after anchors)."""

    def rule(node, outs, batch):
        return [outs.get(k - leading, FREE) for k in range(len(_next(node)))]

    return rule


def _stops(node, outs, batch):
    """An engine Function whose backward passes nothing on (``capture._Origin``)."""
    return [FREE] * len(_next(node))


_ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Neg", "Exp", "Exp2", "Expm1", "Log", "Log1p", "Log2", "Log10", "Pow", "Sqrt", "Rsqrt",
    "Abs", "Sign", "Tanh", "Sigmoid", "Relu", "Threshold", "Gelu", "Silu", "Mish", "Elu", "Selu", "Celu", "LeakyRelu",
    "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softshrink", "Hardshrink", "Clamp", "ClampMin", "ClampMax",
    "Reciprocal", "Sin", "Cos", "Tan", "Atan", "Asin", "Acos", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf",
    "Erfc", "Erfinv", "Where", "MaskedFill", "Maximum", "Minimum", "Fmax", "Fmin", "Atan2", "Lerp", "Addcmul",
    "Addcdiv", "Clone", "ToCopy", "Alias", "NativeDropout", "Rsub", "Xlogy", "Square", "Trunc", "Frac", "Floor",
    "Ceil", "Round", "Logit", "Prelu", "Glu", "SpecialXlog1py", "Polar", "Hypot", "Copysign", "Remainder", "Fmod",
    "Lgamma", "Digamma", "LogSigmoid", "SoftplusBackward", "Deg2rad", "Rad2deg", "Sinc", "Nan_to_num", "NanToNum",
    "Expand", "Conj", "Real", "Imag", "View_as_real", "Sgn", "MulScalar", "Float",
    "BinaryCrossEntropyWithLogits_", "Copy", "Contiguous",
}
_POINTWISE_LOSSES = {"MseLoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "BinaryCrossEntropy",
                     "BinaryCrossEntropyWithLogits", "SoftMarginLoss", "KlDiv", "PoissonNllLoss"}
_VIEWS = {"View", "ReshapeAlias", "UnsafeView", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Unflatten",
          "ViewAs", "_Reshape_alias", "AsView"}
_REDUCTIONS = {"Sum", "Mean", "Amax", "Amin", "Max", "Min", "Logsumexp", "Norm", "LinalgVectorNorm", "Prod", "Std",
               "Var", "StdMean", "VarMean", "Nansum", "Nanmean", "Median", "Nanmedian", "Mode", "Kthvalue"}

RULES: dict[str, Callable] = {}
for _name in _ELEMENTWISE:
    RULES[_name] = _same
for _name in _POINTWISE_LOSSES:
    RULES[_name] = _pointwise_loss
for _name in _VIEWS:
    RULES[_name] = _view
for _name in _REDUCTIONS:
    RULES[_name] = _reduction
for _name in ("Softmax", "LogSoftmax", "SafeSoftmax", "Cumsum", "Cumprod", "Logcumsumexp", "Cummax", "Cummin",
              "Sort", "Topk", "Gather"):
    RULES[_name] = _along("_saved_dim")
RULES.update({
    "NllLoss": _nll, "NllLoss2D": _nll, "NllLoss2d": _nll,
    "Transpose": _transpose, "Permute": _transpose, "T": _transpose,
    "Slice": _slice, "Narrow": _slice, "Select": _select, "IndexSelect": _index_select, "Index": _index,
    "Mm": _matmul, "Addmm": _matmul, "Bmm": _matmul,
    "NativeLayerNorm": _layer_norm, "NativeGroupNorm": _leading_only(0),
    "Convolution": _leading_only(0), "MaxPool2DWithIndices": _leading_only(2), "MaxPool1DWithIndices": _leading_only(1),
    "MaxPool3DWithIndices": _leading_only(3), "AvgPool2D": _leading_only(2), "AvgPool1D": _leading_only(1),
    "AvgPool3D": _leading_only(3), "AdaptiveAvgPool2D": _leading_only(2), "AdaptiveAvgPool1D": _leading_only(1),
    "AdaptiveAvgPool3D": _leading_only(3), "AdaptiveMaxPool2D": _leading_only(2), "UpsampleNearest2D": _leading_only(2),
    "UpsampleBilinear2D": _leading_only(2), "ConstantPadNd": _constant_pad, "ReflectionPad2D": _leading_only(2),
    "ReflectionPad1D": _leading_only(1), "ReflectionPad3D": _leading_only(3), "ReplicationPad1D": _leading_only(1),
    "ReplicationPad2D": _leading_only(2), "ReplicationPad3D": _leading_only(3),
    "Cat": _cat, "Split": _split, "SplitWithSizes": _split, "Unbind": _split, "Chunk": _split,
    "ScaledDotProductFlashAttentionForCpu": _attention, "ScaledDotProductFlashAttention": _attention,
    "ScaledDotProductEfficientAttention": _attention, "ScaledDotProductCudnnAttention": _attention,
})


_RULE_BY_NAME: dict[str, Callable | None] = {}


def rule_of(node) -> Callable | None:
    """The rule of a node's type: its name without the ``Backward<n>`` suffix (``rule_of_name``), for autograd's own
    nodes and the engine's Functions (``ruled``)."""
    return rule_of_name(node.name()) if ruled(node) else None


_PYTHON_NODE = torch.autograd.function.BackwardCFunction
_RULED_BY_TYPE: dict[type, bool] = {}


def ruled(node) -> bool:
    """Whether a node's name says what it computes: one of autograd's (a C++ node), or one of the engine's own
    Functions. A user's ``torch.autograd.Function`` is named after its class, and one called ``Clone`` or ``Expand``
    is no clone: it gets no rule (its rows are read by tag passes)."""
    kind = type(node)
    known = _RULED_BY_TYPE.get(kind)
    if known is None:
        forward = getattr(node, "_forward_cls", None)
        known = _RULED_BY_TYPE[kind] = not isinstance(node, _PYTHON_NODE) or (
            forward is not None and forward.__module__.startswith("dptrain.") and forward.__name__ in _OWN)
    return known


def rule_of_name(name: str) -> Callable | None:
    """The rule of the node type named ``name``."""
    try:
        return _RULE_BY_NAME[name]
    except KeyError:
        base = name[: name.find("Backward")] if "Backward" in name else name
        # (a double backward's node, `NativeLayerNormBackwardBackward0`, computes no layer norm: no rule)
        rule = _RULE_BY_NAME[name] = RULES.get(base) if name.count("Backward") <= 1 else None
        return rule


# the engine's own Functions (capture, rows.outputs, rows.inputs), by name (``ruled``)
_OWN = {"_OutputLeaves": _shifted(1), "_TagRows": _shifted(0), "_InputRowsNode": _shifted(1),
        "_GradientPenalty": _shifted(0), "_Origin": _stops}
RULES.update(_OWN)
