"""The rows of the model's input: a tensor that carries them, read in the real backward and in the tag passes.

Row i of a model input is sample i by definition, so its gradient must come from sample i's loss alone. At every
training forward the capture passes each floating-point input with the batch (and each untrained embedding's output
of ids with the batch) through ``_InputRowsNode``: what the forward computes from it is then in the autograd graph,
where the proof follows it (``proof.py``), and where the proof cannot, its backward hands the gradient to
``InputRows``, kept as sketches, which the tag passes read.
"""
from __future__ import annotations

import torch

from .errors import RowsMixSamples
from .reading import read_sketches, tolerance
from .sketch import Projections, sketch_rows


class InputRows:
    """The gradient of one tensor that carries the model input's rows (the input itself, or the embedding of
    its ids), in the real backward and in each tag pass of a step whose graph does not prove its rows apart, kept as
    per-row sketches along each axis where the batch may sit.

    Row i of a model input is sample i by definition, so its gradient must come from sample i's loss alone:
    a row whose gradient mixes samples shows a forward that mixes samples (a statistic over the batch, rows
    of one sample fed to another) before any trainable layer, where no layer's output gradient can see it.
    """

    def __init__(self, batch: int, axes: tuple[int, ...], precision: torch.dtype | None = None):
        #: where the batch may sit: the model's axis for its own inputs; for a tensor made from ids derived from
        #: an input (transposed, reshaped) either of the first two that has the batch's size
        self.batch, self.axes = batch, axes
        self.precision = precision  # the lowest precision the forward computed in (``computing_precision``)
        self.dtype: torch.dtype | None = None
        self.shape: tuple[int, ...] = ()
        self.real: dict[int, torch.Tensor] | None = None  # axis -> sketch of the real gradient's rows along it
        self.tagged: list[dict[int, torch.Tensor]] = []  # per tag pass, the same
        self.tags: list[torch.Tensor] | None = None  # the tags of the passes that made ``tagged``
        self.proven = False  # its rows stay apart by the graph itself (rows.proof): nothing to read

    def sketches(self, grad: torch.Tensor, projections: Projections) -> dict[int, torch.Tensor]:
        self.dtype, self.shape = grad.dtype, tuple(grad.shape)
        return {axis: sketch_rows(grad.movedim(axis, 0), 1, projections)
                for axis in self.axes if grad.dim() > axis and grad.shape[axis] == self.batch}


def _add(into: dict[int, torch.Tensor] | None, more: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Sketches of two parts of one gradient: the sketch of their sum (a sketch is linear)."""
    if into is None:
        return more
    return {axis: into[axis] + s for axis, s in more.items() if axis in into}


def _one_sample_per_row(reading: InputRows, axis: int, tags: list[torch.Tensor], real: dict, tagged: list,
                        padded: torch.Tensor | None = None) -> bool:
    """Whether each row of the reading along ``axis`` carries the gradient of its own sample's loss only (rows that
    hold inf or NaN only where they are padded samples of a fixed-shape batch: ``padded``, [B] bool)."""
    if axis not in real or any(axis not in t for t in tagged):
        return False
    shape = list(reading.shape)
    shape.insert(0, shape.pop(axis))
    assert reading.dtype is not None  # (set with its sketches)
    eps, rel = tolerance(reading.dtype, reading.precision, real[axis].device)
    sketches = [real[axis], *(t[axis] for t in tagged)]
    bad = torch.zeros(sketches[0].shape[0], dtype=torch.bool, device=sketches[0].device)
    for s in sketches:
        bad |= ~torch.isfinite(s).all(1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().cpu()
        if padded is None or bool((rows >= padded.numel()).any()) or not bool(padded[rows].all()):
            return False
        sketches = [torch.where(bad.unsqueeze(1), torch.zeros((), dtype=s.dtype, device=s.device), s) for s in sketches]
    try:
        rowmap = read_sketches(sketches[0], sketches[1:], tags, reading.batch, tuple(shape), 1, eps, rel)
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


class CarriedRows(torch.Tensor):
    """A copy that carries the model input's rows (``_InputRowsNode``'s output), and its views.

    It requires gradients without being a leaf, where the forward expects its input as a leaf that does not: code that
    sets ``requires_grad = True`` on its input or a view of it (wav2vec2's feature encoder, for gradient
    checkpointing) would fail on it. Setting it to True is a no-op here (it already does); a view of it is one again,
    so the same holds for ``x[:, None]``; any other operation returns an ordinary tensor (so only operations on the
    input itself pass through this class's Python)."""

    @classmethod
    @torch._dynamo.disable  # (traced, dynamo recursed into it; run eagerly: only operations on the input come here)
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if any(not issubclass(cls, t) for t in types):
            return NotImplemented  # (another subclass's operation, the engine's BroadcastRows: it decides)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _VIEWS and isinstance(out, torch.Tensor) and out._is_view():
            return out.as_subclass(CarriedRows)
        return out

    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)  # type: ignore[attr-defined]  # (torch's stub: a bool, a descriptor in fact)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if not (value and self.requires_grad):
            torch._C.TensorBase.requires_grad.__set__(self, value)  # type: ignore[attr-defined]  # (likewise)

    def requires_grad_(self, requires_grad: bool = True):
        if not (requires_grad and self.requires_grad):
            torch._C.TensorBase.requires_grad_(self, requires_grad)
        return self


_VIEWS = {
    torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unsqueeze,
    torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze, torch.Tensor.transpose, torch.transpose,
    torch.Tensor.permute, torch.permute, torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten,
    torch.Tensor.narrow, torch.narrow, torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand,
    torch.Tensor.expand_as,
}
