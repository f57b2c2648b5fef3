"""Watching every training forward: its trace (which forwards were verified), reordering ops on the batch axis, and
the rows of the model's input (``ForwardWatch``)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .inputs import InputRows, _InputRowsNode
from .traces import Traces, op_key

_INDEXING = {
    torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather,
    torch.take, torch.Tensor.take, torch.take_along_dim, torch.Tensor.take_along_dim, torch.masked_select,
    torch.Tensor.masked_select, torch.Tensor.index_add, torch.Tensor.index_add_, torch.index_add,
    torch.Tensor.index_copy, torch.Tensor.index_copy_, torch.Tensor.index_put, torch.Tensor.index_put_,
    torch.Tensor.scatter, torch.Tensor.scatter_, torch.scatter, torch.Tensor.scatter_add, torch.Tensor.scatter_add_,
    torch.scatter_add, torch.Tensor.__setitem__,
}


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
# what keeps a range of positions a range of positions (each element where it was, or repeated): its index picks rows
# by their place, as a slice does
_KEEPS_POSITIONS = _VIEWS | {torch.Tensor.expand, torch.Tensor.expand_as, torch.Tensor.to, torch.Tensor.clone,
                             torch.Tensor.repeat, torch.broadcast_to, torch.Tensor.long, torch.Tensor.int}
_HOOKS = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}
# Reads of a tensor's metadata compute nothing: they are not in the trace, so a profiler reading each parameter's
# ``.grad`` at every module call, or code asking for a device, does not make a forward verify again. (Attributes
# that make a tensor - ``.T``, ``.mT``, ``.data``, ``.real`` - stay in it.)
_METADATA_READS = {getattr(torch.Tensor, name).__get__ for name in (
    "shape", "dtype", "device", "ndim", "layout", "names", "grad", "grad_fn", "requires_grad", "is_leaf", "output_nr",
    "_version", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "itemsize", "nbytes",
) if hasattr(torch.Tensor, name) and hasattr(getattr(torch.Tensor, name), "__get__")}
# dropout in its element-wise forms: on or off (train() or eval()), each element stays where it is
_ELEMENTWISE_RANDOM = {torch.nn.functional.dropout, torch.nn.functional.alpha_dropout,
                       torch.nn.functional.feature_alpha_dropout, torch.dropout, torch.alpha_dropout,
                       torch.feature_alpha_dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
                       torch.nn.functional.dropout3d, torch.feature_dropout}


def _computes(func) -> bool:
    return func not in _ON_THE_OBJECT and getattr(func, "__name__", "") not in ("__get__", "__set__", "__delete__")


# What the watch does with a function, as bits, made once per function (one lookup at each operation, not six).
_UNTRACED = 1  # not in the trace: dropout in its element-wise forms, a metadata read
_HOOK = 2
_PICKS = 4  # may pick rows by a tensor of indices
_KEEPS = 8  # keeps positions (a range stays one)
_VIEW = 16
_COMPUTES = 32  # computes from its arguments' values
_FLAGS: dict = {}


def _flags_of(func) -> int:
    """A function's bits, made and kept (the watch looks in ``_FLAGS`` first)."""
    flags = ((_UNTRACED if func in _ELEMENTWISE_RANDOM or func in _METADATA_READS else 0)
             | (_HOOK if func in _HOOKS else 0) | (_PICKS if func in _INDEXING else 0)
             | (_KEEPS if func in _KEEPS_POSITIONS else 0) | (_VIEW if func in _VIEWS else 0)
             | (_COMPUTES if _computes(func) else 0))
    if len(_FLAGS) < 4096:  # (functions made at run time are not kept without bound)
        _FLAGS[func] = flags
    return flags


#: whether torch.compile is tracing (the watch then stays out of the compiled graph; torch.compiler.is_compiling is
#: torch 2.3's name for it)
_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


class ForwardWatch(TorchFunctionMode):
    """Watches every training forward of the model (a TorchFunctionMode from the model's pre-hook to its forward
    hook): the row check is continuous because this is cheap.

    - It records the forward's *trace* (``op_key`` of every operation, and each covered layer call) and follows it in
      ``Traces``: a forward that computes as a verified one did is not verified again. At the first operation that
      leaves every verified trace (a branch taken on some batches, a mixup, another operation on the batch axis)
      the forward becomes a verifying one from there on, and its whole backward is read by tag passes.
    - It notes whether rows of a batched tensor were picked by a tensor of indices (``x[order]``, ``index_select``,
      ``gather``, ``scatter``, ...): a layout that depends on the data (a sort inside ``forward``, rows routed to
      experts) is read at every step, never cached (such a trace is never kept).
    - It follows the tensors that carry the model input's rows and do not require gradients (the input, views of it,
      what frozen operations compute from it, the ids derived from integer inputs). Once the forward verifies (from
      the start when nothing is verified yet, else from the divergence on), each such tensor passes through
      ``_InputRowsNode`` at its next use, so the tag passes also read whether the forward mixes samples before any
      trainable layer (``InputRows``).

    The engine's own hooks run ``quiet``: what they do is not the forward's computation.
    """

    def __init__(self, batch: int, inputs=(), axis: int = 0, anchor=None, record=None,
                 precision: torch.dtype | None = None, traces: Traces | None = None):
        super().__init__()
        self.batch = batch
        self.precision = precision
        self.seen = False
        self.axis = axis
        self.anchor, self.record = anchor, record
        self.traces = traces
        #: the trie node of the trace so far (None: it left every verified trace)
        self.node = traces.root if traces is not None else None
        self.keys: list = []
        #: the input's rows are carried (InputRows): the forward verifies from here on
        self.verifying = traces is None or not traces.root
        #: where the forward left the verified traces (a function's name, or a layer call)
        self.diverged_at: str | None = None
        self.quiet = 0
        #: the operations it saw run (none, with layer calls recorded: the forward ran compiled, unseen)
        self.operations = 0
        #: a gradient hook was registered during the forward (on a tensor): what it does to the gradient is not in
        #: the graph, so no row of this forward is proven from the graph (rows.proof); tag passes read them
        self.hooked = False
        # tensors that carry the input's rows without requiring gradients (the input, its views, what is computed from
        # it without gradients), with the axes where their batch may sit
        self._floats = {id(t): (t, (axis,)) for t in inputs if t.is_floating_point()}
        # integer inputs (ids), and the ids derived from them (a shift, a view that keeps the batch axis, a
        # transpose), with the axes where their batch may sit
        self._ids = {id(t): (t, (axis,)) for t in inputs if not t.is_floating_point() and not t.is_complex()}
        self._copies: dict[int, torch.Tensor] = {}  # each carried tensor's copy, used by all its uses
        # tensors made by torch.arange in this call: an index of them picks rows by their place, as a slice does
        # (XLNet's relative shift, index_select(x, 3, torch.arange(klen))), not by the data
        self._ranges: dict[int, torch.Tensor] = {}
        self.readings: list[InputRows] = []

    # ------------------------------------------------------------------ the trace
    def note(self, key, where) -> None:
        """One step of the trace: an operation, or a covered layer call (recorded by the capture). ``where``: the
        layer's path, or the operation's function (named only if the forward leaves the verified traces there)."""
        self.keys.append(key)
        node = self.node
        if node is not None:
            node = node.get(key)
            self.node = node
            if node is None:
                self._diverge(where if isinstance(where, str) else getattr(where, "__name__", str(where)))

    def _diverge(self, where: str) -> None:
        self.node = None
        if self.diverged_at is None:
            self.diverged_at = where
        self.verifying = True

    def verified_record(self) -> int | None:
        """The record of the verified trace this forward followed to its end, or None (it verifies)."""
        if self.verifying or self.seen or self.node is None:
            return None
        return self.node.get(Traces.END)

    # ------------------------------------------------------------------ the input's rows
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

    def _batch_axes(self, out: torch.Tensor) -> tuple[int, ...]:
        return tuple(a for a in (0, 1) if out.dim() > a and out.shape[a] == self.batch)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet or _IS_COMPILING():  # (a compiled region: its bookkeeping by tensor identity is not for tracing)
            return func(*args, **kwargs)
        self.operations += 1
        flags = _FLAGS.get(func)
        if flags is None:
            flags = _flags_of(func)
        # (dropout keeps each element where it is, in eval() or not: the same trace; a metadata read computes nothing)
        if not flags & _UNTRACED:
            self.note(op_key(func, args, kwargs, self.batch), func)  # (its name is made only where it diverges)
        if flags & _HOOK:
            self.hooked = True
        if flags & _PICKS and args and not self.seen:
            self.seen = _reorders(func, args, kwargs, self.batch, self._ranges)
            if self.seen:
                self._diverge(getattr(func, "__name__", str(func)))
        if func is torch.arange or (flags & _KEEPS and self._ranges and args
                                    and self._ranges.get(id(args[0]), (None,)) is args[0]):
            # positions made by the forward (a range, and views or expansions of one), not read from the data
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self._ranges[id(out)] = out
            return out
        if flags & _VIEW and self._floats and args and self._floats.get(id(args[0]), (None,))[0] is args[0]:
            # a view of the input stays a view of the input (code may set requires_grad on it, which only a leaf
            # allows): followed, and copied where it is computed from
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not out._is_view() and out is not args[0]:
                # it copied (indexing by a tensor, a reshape of a non-contiguous tensor): computed from the input
                # (these functions only read their arguments: called again on its copy)
                if self.verifying:
                    return func(*(self._substitute(a) for a in args), **kwargs)
                self._follow(out)
                return out
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out is not args[0]:
                if func in _MOVES_AXES or out.shape[:1] != args[0].shape[:1]:
                    # the batch axis moved or was folded: where it went is not guessed from sizes (one may equal
                    # B); the copy is made of the input itself, whose axis is known
                    if self.verifying:
                        return func(*(self._substitute(a) for a in args), **kwargs)
                    self._follow(out)
                    return out
                self._floats[id(out)] = (out, self._floats[id(args[0])][1])
            return out
        floats = self._floats if self._floats and flags & _COMPUTES else None
        if floats is not None and self.verifying:
            args = tuple(self._substitute(a) for a in args)
            kwargs = {k: self._substitute(v) for k, v in kwargs.items()}
            floats = None
        source = ids = None
        if floats is not None or self._ids:
            source, ids = _first_tracked(floats, self._ids, args, kwargs)
        out = func(*args, **kwargs)
        if source is not None:
            self._follow(out)
        if ids is not None and isinstance(out, torch.Tensor):
            src, axes = ids
            if func in _MOVES_AXES:  # (XLNet runs sequence-first: its ids transposed; either axis, read both)
                axes = self._batch_axes(out)
            elif out.shape[:max(axes) + 1] != src.shape[:max(axes) + 1]:
                axes = ()  # folded or resized: where the batch went is not guessed from sizes (one may equal B)
            if axes and out.is_floating_point():
                if func in _EMBEDDINGS:  # an embedding keeps the ids' leading axes
                    if self.verifying:
                        out = self._carry(out, axes)
                    elif not out.requires_grad:
                        self._floats[id(out)] = (out, axes)
            elif axes and not out.is_complex():
                self._ids[id(out)] = (out, axes)  # ids derived from the input's: their embedding too
        return out

    def _follow(self, out) -> None:
        """An output computed without gradients from a tensor that carries the input's rows carries them too (until
        the forward verifies, when it is carried at its next use): where its batch sits is read from its sizes."""
        for t in (out if type(out) in (tuple, list) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
                axes = self._batch_axes(t)
                if axes:
                    self._floats[id(t)] = (t, axes)


def _first_tracked(floats: dict | None, ids: dict | None, args, kwargs=None):
    """The first argument tracked in ``floats`` and the first tracked in ``ids`` (either table may be empty), with
    their batch axes: one pass over the arguments (lists and tuples included) for both tables."""
    source = found = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            if floats and source is None:
                known = floats.get(id(a))
                if known is not None and known[0] is a:
                    source = known
            if ids and found is None:
                known = ids.get(id(a))
                if known is not None and known[0] is a:
                    found = known
        elif type(a) in (list, tuple):
            inner = _first_tracked(floats if source is None else None, ids if found is None else None, a)
            source, found = source or inner[0], found or inner[1]
        else:
            continue
        if (source is not None or not floats) and (found is not None or not ids):
            break
    return source, found


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
