"""Which sample each row of a layer call belongs to: read from the gradient, never inferred from a shape.

A layer call's output gradient is linear in the weights of the per-sample losses. Back-propagating
``sum_i v_i L_i`` with distinct per-sample tags ``v`` (a *tag pass*) next to the real backward
``sum_i L_i`` gives, for a row ``r`` that belongs to one sample ``s``, a tagged gradient
``t_r = v_s g_r``. A least-squares fit of ``t_r`` on ``g_r`` over the whole row gives the ratio
``v_s`` (robust in float32, unlike element-wise ratios) and its residual shows a row that mixes
samples. The fit is read over the call's leading axis (rows ``[N, ...]``) and, for rules whose
leading axes are all tokens (``LayerRule.rows_fold_into_tokens``), over the first two axes
(sequence-first ``[T, B, ...]``, or any layout of ``[N0, N1, ...]``).

What the engine does with a map (``RowMap``):

- identity (row j is sample j): nothing, the rules run as before;
- one sample per row in another layout (reordered rows, sequence-first, tokens or windows folded
  into the batch, rows routed to experts): the rows are regrouped into ``[B, K, ...]`` (or K calls
  of ``[B, ...]`` joined along the token axis) with zero gradients where a sample has fewer than K
  rows, which contribute nothing;
- rows that mix samples: refused, naming the layer.

A verified layout is cached per pattern (``PatternKey``: the layer, which of its calls in the model
call, and the call's leading sizes written relative to the batch size) when it is structural
(identity, sequence-first, folded in blocks or interleaved), no reordering op on the batch
(``ReorderWatch``) ran before the call, and every sample had a row with a gradient in the call that
was read (``RowMap.complete``); anything else is read again at every step. The rows of a sample
whose loss is zero (a padded row of a fixed-shape batch) carry no gradient, so they show nothing
of where that sample sits: a batch permuted by a reshape (which no watch sees) can agree with the
identity on the rows that do, and would be taken for it at the next step.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from .layers.numerics import autocast_state


class NonFiniteRows(FloatingPointError):
    """A call's output gradient holds inf or NaN: its rows cannot be read (the step is skipped or refused)."""


class RowsMixSamples(ValueError):
    """A layer call's rows combine several samples' gradients: per-sample clipping cannot split them."""


@dataclass(frozen=True)
class Layout:
    """A structural layout, valid for any batch size: where the batch sits among the leading axes.

    ``axes``: 1 (rows along dim 0) or 2 (rows over dims 0 and 1 flattened).
    ``kind``: ``identity`` (row j = sample j, dims 0 (and 1) as given), ``transposed`` (two axes,
    sample = index along dim 1), ``blocks`` (sample = row // K), ``interleaved`` (sample = row % B).
    """

    axes: int
    kind: str

    def fits(self, shape: tuple[int, ...], batch: int) -> bool:
        """Whether a call of this shape can have this layout for ``batch`` samples (no tensor is built)."""
        if len(shape) < self.axes or batch <= 0:
            return False
        rows = shape[0] if self.axes == 1 else shape[0] * shape[1]
        if self.kind == "identity":
            return rows == batch
        if self.kind == "transposed":
            return shape[1] == batch
        return rows % batch == 0

    def samples(self, shape: tuple[int, ...], batch: int) -> torch.Tensor | None:
        """The sample of each row for a call of this shape, or None where the shape does not fit."""
        if not self.fits(shape, batch):
            return None
        rows = shape[0] if self.axes == 1 else shape[0] * shape[1]
        if self.kind == "identity":
            return torch.arange(batch)
        if self.kind == "transposed":
            return torch.arange(batch).repeat(shape[0])
        if self.kind == "blocks":
            return torch.arange(batch).repeat_interleave(rows // batch)
        return torch.arange(batch).repeat(rows // batch)  # interleaved


IDENTITY = Layout(1, "identity")


def pattern_key(shape: tuple[int, ...], batch: int) -> tuple:
    """A call's shape with its two leading sizes written relative to the batch: ``("B", k)`` for k·B.

    Two calls with the same key have the same layout whatever B is, unless the layout depends on the
    data. A leading size that happens to be a multiple of B gives another key, which is verified anew:
    that is when a layout cannot be told from shapes.
    """
    lead = tuple(("B", n // batch) if batch and n % batch == 0 else n for n in shape[:2])
    return (*lead, *shape[2:])


DIGITS = 4  # tags per pass: 1, 1/2, 1/4, 1/8


def tag_passes(batch: int) -> int:
    """How many tag passes tell ``batch`` samples apart: one per base-4 digit of their ids."""
    return max(1, math.ceil(math.log(max(batch, 1), DIGITS) - 1e-9))


def make_tags(batch: int, generator: torch.Generator, passes: int | None = None) -> list[torch.Tensor]:
    """Per-sample tags for ceil(log4 B) tag passes (float64): sample s gets the base-4 digits of a random id.

    A tag is a power of two (1, 1/2, 1/4, 1/8): scaling by it is exact in any floating-point format, so a
    row of one sample is its tag times the real row up to the rounding of its own computation, and two
    tags are a factor of two apart, which bf16 rounding cannot bridge. At most 1, so a tag pass never
    overflows where the real backward does not. Two samples differ in some digit: a row mixing them
    fails that pass's fit.
    """
    ids = torch.randperm(batch, generator=generator)
    passes = max(tag_passes(batch), passes or 0)
    return [torch.pow(2.0, -((ids // DIGITS ** k) % DIGITS).to(torch.float64)) for k in range(passes)]


@dataclass
class RowMap:
    """The sample of every row of one call (``samples[r]``; -1: a row with no gradient this step)."""

    axes: int
    samples: torch.Tensor | None  # long, on the CPU (None for the identity taken from a cached layout)
    batch: int
    identity: bool
    layout: Layout | None  # the structural layout these samples follow, if any
    #: every sample had a row with a gradient: the layout was seen for all of them (only such a map is cached)
    complete: bool = True

    def for_units(self, units: torch.Tensor, count: int, state, call) -> RowMap:
        """This map with each sample replaced by its unit (``units[sample]``, 0..count-1): the rows of a unit's
        samples are regrouped like the rows of one sample, so a rule clips the sum of their gradients."""
        rows = call.shape[0] if self.axes == 1 else call.shape[0] * call.shape[1]
        samples = self.samples if self.samples is not None else torch.arange(rows)
        mapped = torch.where(samples >= 0, units[samples.clamp(min=0)], torch.full_like(samples, -1))
        if not can_regroup(state.rule, call.activation, call.grad, self.axes):
            raise RowsMixSamples(
                f"{state.path} ({type(state.module).__name__}): with privacy_unit='user' the rows of a user's "
                f"examples are regrouped as one unit, which the rule {type(state.rule).__name__} cannot do for this "
                f"call (output of shape {tuple(call.grad.shape)}). Freeze this layer, or register a rule for it"
            )
        return RowMap(self.axes, mapped, count, False, None)

    def regroup(self, rule, module, activation, grad: torch.Tensor) -> tuple[tuple, list]:
        """(operands, dims of each part) of this call with its rows regrouped by sample.

        Rules whose leading axes are all tokens take ``[B, K, ...]`` (K rows per sample, zero gradients
        where a sample has fewer); other rules get K calls of ``[B, ...]`` joined along the token axis; a rule
        with a ``regroup_call`` hook is handed the call and the sample of each row, and regroups it itself.
        """
        hook = getattr(rule, "regroup_call", None)
        if hook is not None:  # the rule regroups the call itself (the fallback replays each sample's rows)
            return hook(module, activation, grad, self.samples, self.batch)
        act, g = activation, grad
        if self.axes == 2:
            act, g = act.flatten(0, 1), g.flatten(0, 1)
        order, counts = _order(self.samples, self.batch)
        k = max(1, int(counts.max()) if counts.numel() else 0)
        slots = torch.full((self.batch, k), -1, dtype=torch.long)  # slots[b, j]: sample b's j-th row, or -1
        starts = torch.cumsum(counts, 0) - counts
        ranked = order[self.samples[order] >= 0]
        owners = self.samples[ranked]
        slots[owners, torch.arange(ranked.numel()) - starts[owners]] = ranked
        index = slots.clamp(min=0).to(g.device)
        keep = (slots >= 0).to(g.device, g.dtype)
        ones = [1] * (g.dim() - 1)
        if getattr(rule, "rows_fold_into_tokens", False):
            a_r = act.index_select(0, index.flatten().to(act.device)).reshape(self.batch, k, *act.shape[1:])
            g_r = g.index_select(0, index.flatten()).reshape(self.batch, k, *g.shape[1:]) * keep.reshape(
                self.batch, k, *ones)
            return rule.operands(module, a_r, g_r), [rule.dims(module, a_r, g_r)]
        parts, dims = [], []
        for j in range(k):
            a_j = act.index_select(0, index[:, j].to(act.device))
            g_j = g.index_select(0, index[:, j]) * keep[:, j].reshape(-1, *ones)
            parts.append(rule.operands(module, a_j, g_j))
            dims.append(rule.dims(module, a_j, g_j))
        return (parts[0] if len(parts) == 1 else rule.concat_calls(parts)), dims


def _order(samples: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.where(samples >= 0, samples, torch.full_like(samples, batch))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(samples[samples >= 0], minlength=batch)[:batch]
    return order, counts


def can_regroup(rule, activation, grad: torch.Tensor, axes: int) -> bool:
    """Whether a rule's activation can be regrouped row by row (a tensor sharing the output's leading axes), or
    the rule regroups a call's rows along dim 0 itself (``LayerRule.regroup_call``)."""
    if getattr(rule, "regroup_call", None) is not None:
        return axes == 1 and grad.dim() >= 1
    if not isinstance(activation, torch.Tensor) or activation.dim() < axes:
        return False
    if activation.shape[:axes] != grad.shape[:axes]:
        return False
    return axes == 1 or getattr(rule, "rows_fold_into_tokens", False)


def computing_precision(device: torch.device, params) -> torch.dtype | None:
    """The lowest floating-point precision the forward computes in now: autocast's dtype where autocast is on for
    ``device``, and the (trainable) parameters' dtypes. A gradient's own dtype does not show it: a float32 input
    of a bf16 model, or a LayerNorm's float32 output under autocast, gets a float32 gradient computed in bf16."""
    lowest = None
    _, on, dtype = autocast_state(device.type)
    for dt in ([dtype] if on else []) + list(params):
        if dt.is_floating_point and (lowest is None or torch.finfo(dt).eps > torch.finfo(lowest).eps):
            lowest = dt
    return lowest


def read_rows(grad: torch.Tensor, tagged: list[torch.Tensor], tags: list[torch.Tensor], batch: int,
              two_axes: bool, precision: torch.dtype | None = None) -> RowMap:
    """The row-to-sample map of one call from its real output gradient and those of the tag passes.

    Raises ``RowsMixSamples`` where some row's gradient is not one sample's (along dim 0, and, with
    ``two_axes``, over dims 0 and 1 either). ``precision``: the lowest precision the forward computed in
    (``computing_precision``), whose rounding the reading allows for.
    """
    err = None
    for axes in ((1, 2) if two_axes and grad.dim() >= 3 else (1,)):
        try:
            return _read(grad, tagged, tags, batch, axes, precision)
        except RowsMixSamples as e:
            err = e
    raise err


def _read(grad, tagged, tags, batch, axes, precision=None) -> RowMap:
    rows = math.prod(grad.shape[:axes]) if grad.dim() >= axes else 1
    if not bool(torch.isfinite(grad).all()) or not all(bool(torch.isfinite(t).all()) for t in tagged):
        raise NonFiniteRows("a layer's output gradient is inf or NaN")
    dtype = torch.float64
    g = grad.detach().reshape(rows, -1).to(dtype)
    eps = torch.finfo(grad.dtype).eps if grad.is_floating_point() else 1e-12
    if precision is not None:
        eps = max(eps, torch.finfo(precision).eps)
    gg = g.square().sum(1)
    scale = gg.max().sqrt() if rows else gg.new_zeros(())
    # A row whose gradient is rounding noise next to the call's largest row says nothing about its sample.
    empty = gg.sqrt() <= 64 * eps * scale
    # The gradient's dtype does not tell the precision it was computed in (a float64 model may normalise in
    # float32): float32's is the floor, or the forward's lower one (``precision``: bf16 autocast allows 5 %,
    # so a row mixing a few percent of another sample's gradient passes there). A row that mixes samples
    # misses by far more than rounding.
    rel = min(1e3 * max(eps, torch.finfo(torch.float32).eps), 0.05)
    ids = torch.zeros(rows, dtype=torch.long)
    ok = torch.ones(rows, dtype=torch.bool)
    for k, t in enumerate(tagged):
        t = t.detach().reshape(rows, -1).to(dtype)
        ratio = torch.where(empty, torch.ones_like(gg), (g * t).sum(1) / gg.clamp_min(torch.finfo(dtype).tiny))
        residual = (t - ratio.unsqueeze(1) * g).square().sum(1)  # no cancellation, unlike tt - ratio * gt
        fits = residual <= rel ** 2 * t.square().sum(1) + (64 * eps * scale) ** 2
        digit = -torch.log2(ratio.clamp_min(2.0 ** -(DIGITS + 1)))
        nearest = digit.round()
        # A row of one sample has its tag to within the rounding of its computation (rel); so little slack
        # also keeps a mixture of rows of a single value each from passing for a tag by chance.
        ok &= (fits & ((digit - nearest).abs() <= 2 * rel) & (nearest >= 0) & (nearest < DIGITS)).cpu() | empty.cpu()
        ids += (nearest.clamp(0, DIGITS - 1).long() * DIGITS ** k).cpu()
    sample_of_id = torch.full((max(DIGITS ** len(tagged), batch),), -1, dtype=torch.long)
    tag_ids = sum((-torch.log2(v.cpu())).round().long() * DIGITS ** k for k, v in enumerate(tags))
    sample_of_id[tag_ids] = torch.arange(batch)
    samples = sample_of_id[ids.clamp(max=sample_of_id.numel() - 1)]
    ok &= (samples >= 0) | empty.cpu()
    if not bool(ok.all()):
        bad = int((~ok).sum())
        raise RowsMixSamples(f"{bad} of {rows} rows along the {'first' if axes == 1 else 'first two'} "
                             f"ax{'is' if axes == 1 else 'es'} mix the gradients of several samples")
    samples = torch.where(empty.cpu(), torch.full_like(samples, -1), samples)
    return _classify(samples, grad.shape, batch, axes)


def _classify(samples: torch.Tensor, shape, batch: int, axes: int) -> RowMap:
    known = samples >= 0
    complete = bool((torch.bincount(samples[known], minlength=batch)[:batch] > 0).all())
    for layout in _candidates(axes):
        expected = layout.samples(tuple(shape), batch)
        if expected is not None and expected.numel() == samples.numel() and bool((expected[known] == samples[known]).all()):
            # rows without a gradient this step follow the structure of those with one: exact for this step,
            # where they add nothing, but a layout for the next steps only where every sample showed its rows
            identity = layout == IDENTITY
            return RowMap(axes, expected, batch, identity, layout, complete)
    return RowMap(axes, samples, batch, False, None, complete)


def _candidates(axes: int):
    if axes == 1:
        return (IDENTITY, Layout(1, "blocks"), Layout(1, "interleaved"))
    return (Layout(2, "transposed"), Layout(2, "blocks"), Layout(2, "interleaved"))


def map_from_layout(layout: Layout, shape: tuple[int, ...], batch: int) -> RowMap | None:
    if layout == IDENTITY:  # the usual case, on every layer call: no index tensor to build
        return RowMap(1, None, batch, True, layout) if layout.fits(shape, batch) else None
    samples = layout.samples(tuple(shape), batch)
    if samples is None:
        return None
    return RowMap(layout.axes, samples, batch, layout == IDENTITY, layout)


# ---------------------------------------------------------------------- reordering ops in a forward
_INDEXING = {
    torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather,
    torch.take, torch.Tensor.take, torch.take_along_dim, torch.Tensor.take_along_dim, torch.masked_select,
    torch.Tensor.masked_select, torch.Tensor.index_add, torch.Tensor.index_add_, torch.index_add,
    torch.Tensor.index_copy, torch.Tensor.index_copy_, torch.Tensor.index_put, torch.Tensor.index_put_,
    torch.Tensor.scatter, torch.Tensor.scatter_, torch.scatter, torch.Tensor.scatter_add, torch.Tensor.scatter_add_,
    torch.scatter_add, torch.Tensor.__setitem__,
}


class InputRows:
    """The gradient of one tensor that carries the model input's rows (the input itself, or the embedding of
    its ids), in the real backward and in each tag pass of a verifying step.

    Row i of a model input is sample i by definition, so its gradient must come from sample i's loss alone:
    a row whose gradient mixes samples shows a forward that mixes samples (a statistic over the batch, rows
    of one sample fed to another) before any trainable layer, where no layer's output gradient can see it.
    """

    def __init__(self, batch: int, axes: tuple[int, ...], precision: torch.dtype | None = None):
        #: where the batch may sit: the model's axis for its own inputs; for a tensor made from ids derived from
        #: an input (transposed, reshaped) either of the first two that has the batch's size
        self.batch, self.axes = batch, axes
        self.precision = precision  # the lowest precision the forward computed in (``computing_precision``)
        self.real: torch.Tensor | None = None
        self.tagged: list[torch.Tensor] = []
        self.tags: list[torch.Tensor] | None = None  # the tags of the passes that made ``tagged``


def _one_sample_per_row(reading: InputRows, axis: int, tags: list[torch.Tensor]) -> bool:
    """Whether each row of the reading along ``axis`` carries the gradient of its own sample's loss only."""
    try:
        rowmap = read_rows(reading.real.movedim(axis, 0), [t.movedim(axis, 0) for t in reading.tagged], tags,
                           reading.batch, two_axes=False, precision=reading.precision)
    except RowsMixSamples:
        return False
    return rowmap.identity


class _InputRowsNode(torch.autograd.Function):
    """Identity (a copy) on a tensor that carries the model input's rows; its backward hands the gradient to
    ``record`` (the running backward's ``BackwardRows.record_input``). ``anchor`` makes the copy require grad."""

    @staticmethod
    def forward(ctx, anchor, x, reading, record):
        ctx.reading, ctx.record = reading, record
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.record(ctx.reading, grad)
        return None, grad if ctx.needs_input_grad[1] else None, None, None


_EMBEDDINGS = {torch.nn.functional.embedding, torch.embedding}
# What acts on the tensor object itself rather than computing from its values (attributes, autograd flags): the
# model's own input stays the object these see (wav2vec2 sets requires_grad on its input).
_ON_THE_OBJECT = {torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.register_hook}


_VIEWS = {
    torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unsqueeze,
    torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze, torch.Tensor.transpose, torch.transpose,
    torch.Tensor.permute, torch.permute, torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten,
    torch.Tensor.narrow, torch.narrow, torch.Tensor.contiguous, torch.Tensor.view_as, torch.Tensor.reshape_as,
}


_MOVES_AXES = {torch.Tensor.transpose, torch.transpose, torch.Tensor.permute, torch.permute}


def _computes(func) -> bool:
    return func not in _ON_THE_OBJECT and getattr(func, "__name__", "") not in ("__get__", "__set__", "__delete__")


class ReorderWatch(TorchFunctionMode):
    """Watches a model call that may record patterns not verified yet (a verifying forward).

    It notes whether rows of a batched tensor were picked by a tensor of indices (``x[order]``,
    ``index_select``, ``gather``, ``scatter``, ...): a layout that depends on the data (a sort inside
    ``forward``, rows routed to experts) cannot be cached from one batch. And it passes the tensors that
    carry the model input's rows through ``_InputRowsNode`` (a floating-point input at its first use; the
    embedding of integer ids derived from an input), so the tag passes also read whether the forward mixes
    samples before the trainable layers (``InputRows``).
    """

    def __init__(self, batch: int, inputs=(), axis: int = 0, anchor=None, record=None,
                 precision: torch.dtype | None = None):
        super().__init__()
        self.batch = batch
        self.precision = precision
        self.seen = False
        self.axis = axis
        self.anchor, self.record = anchor, record
        # floating-point inputs (and views of them), with the axes where their batch may sit
        self._floats = {id(t): (t, (axis,)) for t in inputs if t.is_floating_point()}
        # integer inputs (ids), and the ids derived from them (a shift, a view that keeps the batch axis, a
        # transpose), with the axes where their batch may sit
        self._ids = {id(t): (t, (axis,)) for t in inputs if not t.is_floating_point() and not t.is_complex()}
        self._copies: dict[int, torch.Tensor] = {}  # each floating-point input's copy, used by all its uses
        # tensors made by torch.arange in this call: an index of them picks rows by their place, as a slice does
        # (XLNet's relative shift, index_select(x, 3, torch.arange(klen))), not by the data
        self._ranges: dict[int, torch.Tensor] = {}
        self.readings: list[InputRows] = []

    def _carry(self, t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        reading = InputRows(self.batch, axes, self.precision)
        self.readings.append(reading)
        return _InputRowsNode.apply(self.anchor(t.device), t, reading, self.record)

    def _substitute(self, obj):
        known = self._floats.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        if known is not None and known[0] is obj:
            copy = self._copies.get(id(obj))
            if copy is None:
                copy = self._copies[id(obj)] = self._carry(obj, known[1])
            return copy
        if type(obj) in (list, tuple) and any(isinstance(o, torch.Tensor) for o in obj):  # (not named tuples)
            return type(obj)(self._substitute(o) for o in obj)
        return obj

    def _ids_in(self, args, kwargs) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """The first (derived) input ids tensor among the arguments, with its batch axes."""
        for a in (*args, *kwargs.values()):
            known = self._ids.get(id(a)) if isinstance(a, torch.Tensor) else None
            if known is not None and known[0] is a:
                return known
        return None

    @torch._dynamo.disable  # (its bookkeeping by tensor identity is not for tracing; only verifying forwards)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.seen and func in _INDEXING and args:
            self.seen = _reorders(func, args, kwargs, self.batch, self._ranges)
        if func is torch.arange:  # positions made by the forward, not read from the data (kept: ids stay unique)
            out = func(*args, **kwargs)
            self._ranges[id(out)] = out
            return out
        if self.record is None:
            return func(*args, **kwargs)
        if self._floats and func in _VIEWS and args and self._floats.get(id(args[0]), (None,))[0] is args[0]:
            # a view of the input stays a view of the input (code may set requires_grad on it, which only a leaf
            # allows): followed, and copied where it is computed from
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not out._is_view() and out is not args[0]:
                # it copied (indexing by a tensor, a reshape of a non-contiguous tensor): computed from the input
                # (these functions only read their arguments: called again on its copy)
                return func(*(self._substitute(a) for a in args), **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out is not args[0]:
                if func in _MOVES_AXES or out.shape[:1] != args[0].shape[:1]:
                    # the batch axis moved or was folded: where it went is not guessed from sizes (one may equal
                    # B); the copy is made of the input itself, whose axis is known
                    return func(*(self._substitute(a) for a in args), **kwargs)
                self._floats[id(out)] = (out, self._floats[id(args[0])][1])
            return out
        if self._floats and _computes(func):
            args = tuple(self._substitute(a) for a in args)
            kwargs = {k: self._substitute(v) for k, v in kwargs.items()}
        ids = self._ids_in(args, kwargs) if self._ids else None
        out = func(*args, **kwargs)
        if ids is not None and isinstance(out, torch.Tensor):
            source, axes = ids
            if func in _MOVES_AXES:  # (XLNet runs sequence-first: its ids transposed; either axis, read both)
                axes = tuple(a for a in (0, 1) if out.dim() > a and out.shape[a] == self.batch)
            elif out.shape[:max(axes) + 1] != source.shape[:max(axes) + 1]:
                axes = ()  # folded or resized: where the batch went is not guessed from sizes (one may equal B)
            if axes and out.is_floating_point():
                if func in _EMBEDDINGS:  # an embedding keeps the ids' leading axes
                    out = self._carry(out, axes)
            elif axes and not out.is_complex():
                self._ids[id(out)] = (out, axes)  # ids derived from the input's: their embedding too
        return out


def _reorders(func, args, kwargs, batch: int, ranges: dict[int, torch.Tensor] | None = None) -> bool:
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or isinstance(x, torch.nn.Parameter):
        return False
    ranges = ranges or {}

    def made_by_arange(t) -> bool:
        return isinstance(t, torch.Tensor) and ranges.get(id(t)) is t

    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        index = args[1] if len(args) > 1 else None
        first = index[0] if isinstance(index, tuple) and index else index
        return (isinstance(first, torch.Tensor) and first.dim() > 0 and x.shape[0] % max(batch, 1) == 0
                and not made_by_arange(first))
    if func in (torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather):
        if made_by_arange(kwargs.get("index", args[2] if len(args) > 2 else None)):
            return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else 0)
    size = x.shape[dim] if -x.dim() <= dim < x.dim() else 0
    return size % max(batch, 1) == 0 if size else False


# ---------------------------------------------------------------------- the engine's maps
class RowReader:
    """What row reading keeps across steps: the layouts verified per pattern, the tags' generator, and
    whether the next model call is watched for reordering ops. Each backward reads its maps through its
    own ``BackwardRows``."""

    def __init__(self, seed: int | None = None):
        self.layouts: dict[tuple, Layout] = {}
        # The tags need no secrecy: their random order only keeps a structured mixture of rows (a mean of
        # two samples' gradients) from landing on a third sample's tag.
        self.generator = torch.Generator()
        self.generator.manual_seed(0x5EED if seed is None else seed + 1)
        #: watch the next model call for reordering ops (it may record patterns not verified yet)
        self.watch_next = True
        #: the last model call was watched and picked no rows by the data: recomputations of it may be cached
        self.forward_clean = False
        #: batch sizes whose recomputed calls (activation checkpointing) were verified: a backward of another
        #: batch size runs a tag pass, as recomputed calls are only known once they are recomputed
        self.recomputed_batches: set[int] | None = None

    @staticmethod
    def pattern(state, call) -> tuple | None:
        """The cache key of a call: its layer, which of the layer's calls it is, its shape relative to B."""
        if call.ordinal is None:
            return None
        return (id(state.module), call.recomputed, call.ordinal, call.key)

    def cached(self, state, call) -> Layout | None:
        pattern = self.pattern(state, call)
        return self.layouts.get(pattern) if pattern is not None else None

    def needs_tags(self, state, call) -> bool:
        """Whether this call's layout must be read from a tag pass (it is not known for its pattern)."""
        if call.rowmap is not None:
            return False
        layout = self.cached(state, call)
        return layout is None or call.batch_size is None or not layout.fits(call.shape, call.batch_size)

    def new_tags(self, batch: int, passes: int | None = None) -> list[torch.Tensor]:
        """The tags of the tag passes of a backward of ``batch`` samples (one pass per base-4 digit, or
        ``passes``, which all ranks agree on under data parallelism)."""
        return make_tags(batch, self.generator, passes)


class BackwardRows:
    """The row maps of one backward: the tagged gradients its tag passes deliver, and the maps it reads
    (owned by the backward, so nothing of one backward's reading reaches the next)."""

    def __init__(self, reader: RowReader):
        self.reader = reader
        #: a tag pass is running: output gradients that arrive are tagged ones
        self.tagging = False
        #: the tags of every tag pass of this backward, and which pass runs
        self.tags: list[torch.Tensor] | None = None
        self.tag_pass = 0
        #: tagged gradients of calls recorded during a tag pass (recomputations), by pattern
        self.tagged: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        #: maps read for recomputed calls (a second pass recomputes them again), by pattern
        self.resolved: dict[tuple, RowMap] = {}

        #: the model input's rows seen in this backward (``InputRows``), by identity
        self.inputs: dict[int, InputRows] = {}
        #: the last tag pass weights every sample 1 (of the unmasked losses of a fixed-shape batch): rows are read
        #: against it rather than the real gradient, in which the padded rows have none
        self.reference_pass = False

    def begin_tags(self, tags: list[torch.Tensor]) -> None:
        self.tags = tags
        self.tagged.clear()

    def record_input(self, reading: InputRows, grad: torch.Tensor) -> None:
        """The gradient of a tensor carrying the model input's rows (``_InputRowsNode``)."""
        self.inputs[id(reading)] = reading
        grad = grad.detach().clone()  # (autograd may accumulate into the buffer it handed over: keep a copy)
        if self.tagging:
            if reading.tags is not self.tags:  # (each model call of a plain backward tags with its own tags)
                reading.tagged, reading.tags = [], self.tags
            if len(reading.tagged) > self.tag_pass:
                reading.tagged[self.tag_pass] = reading.tagged[self.tag_pass] + grad
            else:
                reading.tagged.append(grad)
        else:
            reading.real = grad if reading.real is None else reading.real + grad

    def check_inputs(self, layers: str) -> None:
        """Refuse a forward that mixes samples before the trainable layers (``InputRows``); ``layers`` names
        the trainable layers for the message."""
        for reading in self.inputs.values():
            tags = reading.tags
            if self.reference_pass and tags is not None and len(reading.tagged) == len(tags):
                reading.real, reading.tagged, tags = reading.tagged[-1], reading.tagged[:-1], tags[:-1]
            if reading.real is None or tags is None or len(reading.tagged) != len(tags) or tags[0].numel() != reading.batch:
                continue
            if not any(_one_sample_per_row(reading, axis, tags) for axis in reading.axes):
                raise RowsMixSamples(
                    "the forward mixes samples before its trainable layers: a row of the model's input reaches "
                    "other samples' losses (a statistic over the batch such as a mean or a BatchNorm in training "
                    "mode, or rows of one sample fed to another, in a frozen part of the model), so every "
                    f"trainable layer after it ({layers}) sees the other samples' data. Per-sample clipping "
                    "cannot bound such a sample's influence: compute the statistic per sample, or freeze those "
                    "layers"
                )
        self.inputs.clear()

    def record_tagged(self, state, call, grad: torch.Tensor) -> None:
        """An output gradient of tag pass ``self.tag_pass``."""
        if call.recomputed:  # the real pass recomputes it again, as another call: found by its pattern
            pattern = self.reader.pattern(state, call)
            if pattern is None:
                return
            got = self.tagged.setdefault(pattern, ([], self.tags))[0]
        else:
            if call.tagged is None or call.tags is not self.tags:
                call.tagged, call.tags = [], self.tags
            got = call.tagged
        if len(got) > self.tag_pass:  # a model with several outputs: each adds its part of the pass
            got[self.tag_pass] = got[self.tag_pass] + grad.detach()
        else:
            got.append(grad.detach())

    def resolve(self, state, call, batch: int) -> RowMap:
        """The row map of a call that received its output gradient, for a step of ``batch`` samples."""
        if call.rowmap is not None:
            return call.rowmap
        if call.recomputed and self.reader.pattern(state, call) in self.resolved:
            call.rowmap = self.resolved[self.reader.pattern(state, call)]
            return call.rowmap
        if batch == 0:  # no sample: no row can belong to one
            rows = call.shape[0] if call.shape else 0
            call.rowmap = RowMap(1, torch.full((rows,), -1, dtype=torch.long), 0, rows == 0, None)
            return call.rowmap
        name = f"{state.path} ({type(state.module).__name__})"
        # (a table of batch size 1 used without broadcasting it is read at every step: broadcast.py)
        layout = self.reader.cached(state, call) if call.shared_use is None else None
        rowmap = map_from_layout(layout, call.shape, batch) if layout is not None else None
        if rowmap is None:
            tagged, tags = call.tagged, call.tags
            if tagged is None and call.recomputed:
                tagged, tags = self.tagged.get(self.reader.pattern(state, call), (None, None))
            if tagged is None or tags is None or tags[0].numel() != batch or len(tagged) != len(tags):
                raise RuntimeError(
                    f"{name}: the engine could not read which sample each row of this call belongs to (its output "
                    "gradient did not come from the model's per-sample outputs or losses: a layer called outside "
                    "the model, or a loss computed inside the model). Return per-sample outputs from model(...) "
                    "and use engine.backward(per_sample_losses)"
                )
            reference = call.grad
            if self.reference_pass:  # the last pass tagged every sample 1: the reference, padded rows included
                reference, tagged, tags = tagged[-1], tagged[:-1], tags[:-1]
            try:
                rowmap = read_rows(reference, tagged, tags, batch,
                                   two_axes=getattr(state.rule, "rows_fold_into_tokens", False), precision=call.precision)
            except RowsMixSamples as err:
                if call.shared_use is not None:
                    raise RowsMixSamples(
                        f"{name}: its output, of batch size 1 and broadcast over the batch ({tuple(call.grad.shape[1:])} "
                        f"per sample), was used by {call.shared_use} as a whole rather than broadcast against the "
                        f"batch, so {err} (batch of {batch}): per-sample clipping cannot split such rows. Use the "
                        "output only where it meets the batch (x + pos), index or reduce it after that, or give the "
                        "layer per-sample ids (ids.expand(B, -1)), or freeze it"
                    ) from None
                raise RowsMixSamples(
                    f"{name}: {err} (output of shape {tuple(call.grad.shape)}, batch of {batch}): per-sample "
                    "clipping cannot split such rows. Typical causes: a table broadcast over the batch (position "
                    "embeddings looked up on [T] ids), per-class or pooled vectors, an input of the model concatenated "
                    "with itself. Freeze this layer; for a table, give it ids with a batch axis of size 1 "
                    "(torch.arange(T)[None]: its [1, T, d] output then broadcasts over the batch, exactly) or per-sample "
                    "ids (ids.expand(B, -1)); or register a rule for the module that mixes the samples"
                ) from None
            if rowmap.layout is not None and call.cacheable and rowmap.complete:
                self.reader.layouts[self.reader.pattern(state, call)] = rowmap.layout
        if not rowmap.identity and not can_regroup(state.rule, call.activation, call.grad, rowmap.axes):
            raise RowsMixSamples(
                f"{name}: its rows are samples in another order or layout ({_describe(rowmap)}, output of shape "
                f"{tuple(call.grad.shape)}), which the rule {type(state.rule).__name__} cannot regroup. Give the "
                "layer the batch as its first dimension, or freeze it"
            )
        call.rowmap = rowmap
        call.tagged = None
        if call.recomputed and self.reader.pattern(state, call) is not None:
            self.resolved[self.reader.pattern(state, call)] = rowmap
            self.reader.recomputed_batches = (self.reader.recomputed_batches or set()) | {batch}
        return rowmap


def _describe(rowmap: RowMap) -> str:
    """How a call's rows map to samples, in words (``LayerDecision.layout``)."""
    if rowmap.identity:
        return "identity"
    if rowmap.layout is not None:
        return f"{rowmap.layout.kind} over {rowmap.layout.axes} ax{'is' if rowmap.layout.axes == 1 else 'es'}"
    return "rows picked by the data"


def describe_layouts(rowmaps) -> str:
    """The layouts of a layer's calls in one backward, each named once, in the order met."""
    return ", ".join(dict.fromkeys(_describe(m) for m in rowmaps if m is not None)) or "identity"


# ---------------------------------------------------------------------- tagged outputs (plain backward)
class _TagRows(torch.autograd.Function):
    """Identity; its backward first back-propagates the output gradient with per-sample tags on its rows."""

    @staticmethod
    def forward(ctx, x, run, axis):
        ctx.run, ctx.axis = run, axis
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.run(x, grad, ctx.axis)
        return grad, None, None


def tensors_in(obj, depth: int = 0, whole: tuple[type, ...] = ()):
    """The tensors in a model's input or output (a tensor, tuple/list, dict, Hugging Face ModelOutput or
    dataclass), in order; objects of the types ``whole`` are yielded as they are, not looked into."""
    if isinstance(obj, torch.Tensor) or whole and isinstance(obj, whole):
        yield obj
    elif depth >= 4:
        return
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item, depth + 1, whole)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1, whole)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name), depth + 1, whole)


def carries_input_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` is computed from the model's input: its autograd graph reaches a tensor that carries the
    input's rows (``_InputRowsNode``, made on verifying forwards)."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if isinstance(node, _InputRowsNode._backward_cls):
            return True
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def tag_rows(output, batch: int | None, axis: int, run, from_input: bool = False):
    """The model's output with every per-sample tensor (``batch`` rows along ``axis``) passed through
    ``_TagRows``; containers are rebuilt (tuples) or updated (dicts, dataclasses).

    ``from_input``: only tensors computed from the model's input are per-sample (``carries_input_rows``): a
    table returned next to the features, whatever its number of rows, is not. Where no output can be followed
    to the input (a compiled model's graph hides the copy), every output of ``batch`` rows is tagged."""
    if batch is None:
        return None
    if from_input:
        outputs = [t for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
        from_input = any(carries_input_rows(t) for t in outputs)

    def wrap(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            if not (obj.requires_grad and obj.is_floating_point()):
                return obj
            if from_input and not carries_input_rows(obj):
                return obj
            # a sequence-first model's output may lead with its batch after pooling; both axes the batch: unclear
            found = [a for a in dict.fromkeys((axis, 0)) if obj.dim() > a and obj.shape[a] == batch]
            return _TagRows.apply(obj, run, found[0]) if len(found) == 1 else obj
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
