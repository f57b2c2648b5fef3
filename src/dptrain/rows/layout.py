"""What a row map is: which sample each row of a layer call belongs to, and the structural layouts a map can follow.

- identity (row j is sample j): the rules run as they are;
- one sample per row in another layout (reordered rows, sequence-first, tokens or windows folded into the batch,
  rows routed to experts): the rows are regrouped into ``[B, K, ...]`` (or K calls of ``[B, ...]`` joined along
  the token axis) with zero gradients where a sample has fewer than K rows, which contribute nothing;
- rows that mix samples: refused, naming the layer (``reading.RowsMixSamples``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .errors import RowsMixSamples


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
    """A call's shape as far as its rows' layout can depend on it: its rows (the first size) as the batch itself
    (``"B"``), a multiple of it (``"kB"``) or neither (``"*"``); its second size as the batch itself or not; and its
    number of dimensions.

    Two calls with the same key have the same layout whatever B and the other sizes are (a sequence length or a
    number of windows that changes from batch to batch), unless the layout depends on the data. A second size that
    happens to equal B gives another key, verified anew: that is when which axis holds the batch cannot be told
    from the shapes (a sequence-first call at T = B).
    """
    if not shape or not batch:
        return ("*", len(shape))
    rows = "B" if shape[0] == batch else "kB" if shape[0] % batch == 0 else "*"
    second = ("B" if shape[1] == batch else "*") if len(shape) > 1 else None
    return (rows, second, len(shape))


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
    #: rows of padded samples (a fixed-shape batch's), on the identity path: zeroed before any norm (``without``)
    dropped: torch.Tensor | None = None

    def without(self, padded: torch.Tensor, rows: int) -> RowMap:
        """This map with the rows of padded samples (``padded``: [batch] bool) belonging to none: they contribute
        nothing whatever they hold (a mask sentinel, NaN, inf), zeroed before any norm is formed."""
        samples = self.samples if self.samples is not None else torch.arange(rows)
        drop = (samples >= 0) & padded[samples.clamp(min=0, max=max(padded.numel() - 1, 0))]
        if not bool(drop.any()):
            return self
        if self.identity:
            return dataclasses.replace(self, dropped=drop)
        return RowMap(self.axes, torch.where(drop, torch.full_like(samples, -1), samples), self.batch, False, None,
                      self.complete)

    def for_units(self, units: torch.Tensor, count: int, state, call) -> RowMap:
        """This map with each sample replaced by its unit (``units[sample]``, 0..count-1): the rows of a unit's
        samples are regrouped like the rows of one sample, so a rule clips the sum of their gradients."""
        rows = call.shape[0] if self.axes == 1 else call.shape[0] * call.shape[1]
        samples = self.samples if self.samples is not None else torch.arange(rows)
        if self.dropped is not None:
            samples = torch.where(self.dropped, torch.full_like(samples, -1), samples)
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
        assert self.samples is not None  # (regrouped: a map that is not the identity)
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
        if getattr(rule, "rows_fold_into_tokens", False):
            a_r = _kept(act.index_select(0, index.flatten().to(act.device)).reshape(self.batch, k, *act.shape[1:]),
                        keep, 2)
            g_r = _kept(g.index_select(0, index.flatten()).reshape(self.batch, k, *g.shape[1:]), keep, 2)
            return rule.operands(module, a_r, g_r), [rule.dims(module, a_r, g_r)]
        parts, dims = [], []
        for j in range(k):
            a_j = _kept(act.index_select(0, index[:, j].to(act.device)), keep[:, j], 1)
            g_j = _kept(g.index_select(0, index[:, j]), keep[:, j], 1)
            parts.append(rule.operands(module, a_j, g_j))
            dims.append(rule.dims(module, a_j, g_j))
        return (parts[0] if len(parts) == 1 else rule.concat_calls(parts)), dims


def _kept(t: torch.Tensor, keep: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` with the rows where ``keep`` (its ``lead`` leading sizes) is 0 set to 0, whatever they held (NaN and
    inf too, unlike a product)."""
    mask = (keep != 0).reshape(*keep.shape[:lead], *([1] * (t.dim() - lead))).to(t.device)
    return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))


def zero_rows(t, dropped: torch.Tensor):
    """A call's activation or gradient with the rows ``dropped`` (its leading axis) set to 0, where it is a tensor
    leading with those rows; anything else as it is."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != dropped.numel():
        return t
    keep = (~dropped).to(t.device).reshape(-1, *([1] * (t.dim() - 1)))
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def _order(samples: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.where(samples >= 0, samples, torch.full_like(samples, batch))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(samples[samples >= 0], minlength=batch)[:batch]
    return order, counts


def can_regroup(rule, activation, grad, axes: int) -> bool:
    """Whether a rule's activation can be regrouped row by row (a tensor sharing the output's leading axes), or
    the rule regroups a call's rows along dim 0 itself (``LayerRule.regroup_call``). ``grad``: the output gradient,
    or its shape."""
    shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else tuple(grad)
    if getattr(rule, "regroup_call", None) is not None:
        return axes == 1 and len(shape) >= 1
    if not isinstance(activation, torch.Tensor) or activation.dim() < axes:
        return False
    if tuple(activation.shape[:axes]) != shape[:axes]:
        return False
    return axes == 1 or getattr(rule, "rows_fold_into_tokens", False)


def classify(samples: torch.Tensor, shape, batch: int, axes: int) -> RowMap:
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


def _describe(rowmap: RowMap) -> str:
    """How a call's rows map to samples, in words (``LayerDecision.layout``)."""
    if rowmap.identity:
        return "identity"
    if rowmap.layout is not None:
        return f"{rowmap.layout.kind} over {rowmap.layout.axes} ax{'is' if rowmap.layout.axes == 1 else 'es'}"
    return "rows picked by the data"


def source_samples(source: tuple, axes: int) -> torch.Tensor | None:
    """The sample of each row (its first ``axes`` axes) of a view of the model's input, read from where the row lies
    in the input's storage (``Call.source``: the view's offset, strides and shape, the input's offset, batch stride and
    batch size); -1 for a row whose elements are several samples'. None where the view has fewer axes."""
    offset, strides, shape, base, stride, batch = source
    if len(shape) < axes or not batch:
        return None
    start = torch.arange(shape[0]) * strides[0]
    if axes == 2:
        start = (start[:, None] + torch.arange(shape[1]) * strides[1]).reshape(-1)
    start = start + (offset - base)
    end = start + sum((n - 1) * s for n, s in zip(shape[axes:], strides[axes:]) if n)
    first, last = start // stride, end // stride
    return torch.where(first == last, first % batch, -1)


def check_source_rows(rowmap: RowMap, grad: torch.Tensor | None, name: str, units: torch.Tensor | None = None,
                      source: tuple = ()) -> None:
    """Refuse the row map of a call whose inputs required no gradient (``Call.source``) where it reorders the samples.

    Such a call's rows are in the order the forward gave them (the model's input as it is, token ids), and no gradient
    reaches that order to show it: its row j is sample j, or, with several rows per sample, the rows of its own leading
    axes in the order its input has them (``source_samples`` where ``source`` tells: a view of the input, token ids
    reshaped or transposed; else blocks or time-major). Its output gradient's row j coming from another sample's loss
    means the forward reordered the rows after this layer (a roll, an index or argsort along the batch, a gather, a
    batch-major tensor folded and read as time-major: ``h.flatten(0, 1).unflatten(0, (T, B))``) without undoing it,
    so that one sample's features meet another sample's loss, and the clipped unit of that loss holds two samples.
    Rows without a gradient count for nothing, whichever sample they are read as (a padded sample's); a reordering
    within one user is none at user level (``units``: each sample's user). The gradient is looked at (a copy to the
    host) only where the rows are not in order.
    """
    if rowmap.identity or rowmap.samples is None:
        return  # (a layout's rows are checked too: an interleaved one is a reordering where the batch leads the input)
    samples, batch = rowmap.samples, rowmap.batch
    rows = samples.numel()
    own = torch.arange(rows)
    told = source_samples(source, rowmap.axes) if source else None
    if told is not None and told.numel() == rows:
        orders = [told]
    else:
        orders = ([own] if rows == batch else [own // (rows // batch), own % batch] if batch and rows % batch == 0
                  else [])
    units = units.cpu() if units is not None else None

    def in_order(live: torch.Tensor) -> bool:
        for natural in orders:  # (one row per sample; else the input's order, or blocks or time-major)
            moved = live & (samples != natural)
            if units is not None:
                moved &= (units[samples.clamp(min=0)] != units[natural.clamp(min=0)]) | (natural < 0)
            if not bool(moved.any()):
                return True
        return False

    live = samples >= 0
    if in_order(live):
        return
    if grad is not None:  # (rows without a gradient, a padded sample's: forgiven)
        flat = grad.flatten(0, 1) if rowmap.axes == 2 and grad.dim() >= 2 else grad
        if flat.shape[0] == rows:
            live &= (flat.reshape(rows, -1) != 0).any(1).cpu()
            if in_order(live):
                return
    wrong = (live & (samples != orders[0])).nonzero() if rows == batch and orders else None
    if wrong is not None and wrong.numel():
        row = int(wrong[0])
        detail = f"row {row} (sample {int(orders[0][row])}) gets the gradient of sample {int(samples[row])}'s loss"
    else:
        detail = f"its {rows} rows are {batch} samples' in an order no layout explains"
    raise RowsMixSamples(
        f"{name}: its inputs required no gradient (the model's input as it is, token ids, or a tensor made outside "
        f"autograd), so its rows are the samples in the order the forward gave them, but {detail}. The forward "
        "reorders the samples after this layer (a roll, an index or argsort along the batch, a gather, a batch-major "
        "tensor folded and read as time-major: h.flatten(0, 1).unflatten(0, (T, B))) without "
        "undoing it, so one sample's features meet another sample's loss and per-sample clipping cannot keep them "
        "apart, or it packs the samples into rows of another size (the batch folded into one row, [1, B * T], as "
        "packing does with a block-diagonal mask), which the engine does not follow. Undo the reordering before the "
        "losses, or reorder the inputs (and the targets) before the model; rather than packing, keep each sample a "
        "row of its own ([B, T], padded, with an attention mask)"
    )


def describe_layouts(rowmaps) -> str:
    """The layouts of a layer's calls in one backward, each named once, in the order met."""
    return ", ".join(dict.fromkeys(_describe(m) for m in rowmaps if m is not None)) or "identity"
