"""A layer output of batch size 1 that broadcasts over the batch keeps its shape under the engine.

A position table looked up on ids of shape ``[1, T]`` (Hugging Face passes position ids this way) returns
``[1, T, d]``, which the model adds to the ``[B, T, d]`` features. The gradient of that output is summed over the
samples by the broadcast: its per-sample rows exist only where the table meets the batch. So the engine hooks the
layer's output expanded over the batch (``rows``, ``[B, T, d]``, a view: no copy) and returns a
:class:`BroadcastRows`, a tensor of the layer's own shape and values whose operations run on ``rows`` instead
wherever that gives the same result:

- the operation broadcasts it against the batch (``x + pos``, ``torch.where(mask, pos, x)``): the result, as
  without the engine, carries each sample's gradient back to that sample's row;
- the operation works row by row (``pos.to(dtype)``, a LayerNorm, ``pos.permute(0, 2, 1)``): the result is such a
  tensor again, of the shape the operation gives without the engine.

Any other use (``pos[0]``, ``pos.sum(0)``, ``pos.view(T, d)``, dropout on the table alone) runs as without the engine
on the first row of ``rows``: the values are the same, and its gradient reaches the engine in that row, where the
row reading (``rows.py``) finds which samples it comes from. The call is then read at every step, never from a
cached layout: a row that several samples' gradients reach is refused, naming the layer.

Whether an operation gives the same result on ``rows`` is verified by value the first time each signature (the
function, the arguments' shapes, dtypes and other values) is met, one synchronisation, then remembered.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from ..layers.numerics import close

# signature -> how the operation treats a BroadcastRows argument: "batch" (broadcast against the batch: run it on the
# rows), "rowwise" (row by row: run it on the rows, the result is a BroadcastRows again), "shared" (run it as it is)
_VERDICTS: dict[tuple, str] = {}
_MAX_VERDICTS = 4096


class BroadcastRows(torch.Tensor):
    """A layer's output of batch size 1, broadcast over a batch of B samples (see the module docstring).

    Its value is row 0 of ``dptrain_rows`` (the output expanded over the batch, whose gradient the engine hooks);
    ``dptrain_shared_use`` are the callbacks told of a use that does not broadcast it (by the operation's name).
    Once the table was written in place (``_write_table``) its rows are copies that the write was made on, its value
    is the table as without the engine (``dptrain_written``), and ``dptrain_family`` (the tables made from one layer
    output) says whether it is still current."""

    dptrain_rows: torch.Tensor
    dptrain_shared_use: tuple[Callable[[str], None], ...]
    dptrain_family: "_Family | None" = None
    dptrain_generation: int = 0
    dptrain_written: bool = False
    dptrain_rows_version: int = 0

    @staticmethod
    def wrap(rows: torch.Tensor, on_shared_use: tuple[Callable[[str], None], ...], family: "_Family | None" = None,
             first: torch.Tensor | None = None) -> "BroadcastRows":
        with torch._C.DisableTorchFunctionSubclass():
            written = first is not None
            first = rows.narrow(0, 0, 1) if first is None else first
        out = first.as_subclass(BroadcastRows)
        out.dptrain_rows = rows
        out.dptrain_shared_use = on_shared_use
        out.dptrain_family = family
        out.dptrain_generation = family.generation if family is not None else 0
        out.dptrain_written = written
        out.dptrain_rows_version = rows._version
        return out

    @classmethod
    @torch._dynamo.disable
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():  # (inside, a BroadcastRows is an ordinary tensor)
            return _dispatch(func, args, kwargs or {})


class _Family:
    """The tables made from one layer output: the output itself, and what operations that keep its rows made of it.

    ``generation`` counts the writes into them that the engine followed (``_write_table``): the written table and
    those made of it afterwards are current; one made before a write, used after it, is refused (its rows, copies or
    views, may no longer hold its values). ``storage`` is the layer output's memory: rows that view it are copied
    before a write."""

    __slots__ = ("where", "storage", "generation")

    def __init__(self, where: str, rows: torch.Tensor):
        self.where = where
        self.storage = _storage(rows)
        self.generation = 0

    def check(self, table: "BroadcastRows") -> None:
        if table.dptrain_rows._version != table.dptrain_rows_version:
            raise ValueError(
                f"the output of {self.where}, a table broadcast over the batch, was modified in place in the forward "
                "through a view of it that the engine does not follow (a view of the table as a whole, `t[0] *= 2`), "
                "then used: its rows over the batch, on which the engine reads each sample's gradient, no longer hold "
                "its values. Modify the table out of place (`t = t * 2`), or through its own name (`t *= 2`)"
            )
        if table.dptrain_generation != self.generation:
            raise ValueError(
                f"the output of {self.where}, a table broadcast over the batch, was modified in place in the forward, "
                "and a view of it taken before the write was used after it: the engine follows a written table only "
                "through the name the write was made on (and what is made of it afterwards). Take the view after "
                "the write, or modify the table out of place (`t = t / 2`)"
            )


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _dispatch(func, args, kwargs):
    if func is torch.Tensor.register_hook and isinstance(args[0], BroadcastRows):
        return _hook_rows(args[0], args[1] if len(args) > 1 else kwargs["hook"])
    leaves = pytree.tree_leaves((args, kwargs))
    wrapped = [a for a in leaves if isinstance(a, BroadcastRows) and hasattr(a, "dptrain_rows")]
    if not wrapped:  # (one that lost its rows, unpickled: an ordinary tensor)
        return _plain(func, args, kwargs)
    signature = _signature(func, args, kwargs, leaves)
    if _writes(func, kwargs):
        return _in_place(func, args, kwargs, wrapped, signature)
    verdict = _VERDICTS.get(signature) if signature is not None else None
    if verdict in ("batch", "rowwise"):
        return _on_rows(func, args, kwargs, wrapped, verdict == "rowwise")
    plain = _plain(func, *_written((args, kwargs)))  # as without the engine (an error is the program's own)
    if verdict == "shared" or not _needs_gradient(plain):
        if verdict == "shared":
            _tell_shared(func, wrapped, plain)
        return plain
    verdict, on_rows = _judge(func, args, kwargs, wrapped, plain)
    _remember(signature, verdict)
    if verdict == "shared":
        _tell_shared(func, wrapped, plain)
        return plain
    if verdict == "rowwise" and any(w.dptrain_written for w in wrapped):
        return _wrap_rowwise(on_rows, wrapped, _plain(func, args, kwargs))  # (the values as in _on_rows)
    return _wrap_rowwise(on_rows, wrapped) if verdict == "rowwise" else on_rows


def broadcast_rows(rows: torch.Tensor, on_shared_use: Callable[[str], None], where: str = "a layer") -> BroadcastRows:
    """The ``[1, ...]`` tensor to hand to the model for a layer output expanded over the batch (``rows``); ``where``
    names the layer in a refusal."""
    return BroadcastRows.wrap(rows, (on_shared_use,), _Family(where, rows))


def rows_of(t):
    """``t``'s rows over the batch if it is a :class:`BroadcastRows`, else ``t``."""
    if isinstance(t, BroadcastRows) and hasattr(t, "dptrain_rows"):
        _current([t])
        return t.dptrain_rows
    return t


def shared_use_marker(call) -> Callable[[str], None]:
    """A callback that marks ``call`` as used without broadcasting: its rows are read (tag passes) in its backward,
    never proven from the graph. Held weakly."""
    call_ref = weakref.ref(call)

    def mark(operation: str) -> None:
        c = call_ref()
        if c is not None:
            c.shared_use = c.shared_use or operation

    return mark


def _hook_rows(t: BroadcastRows, hook):
    """A user's hook on the table: it gets the gradient the table gets without the engine, summed over the batch."""
    _current([t])

    def on_rows(grad):
        if hook(grad.sum(0, keepdim=True)) is not None:
            raise ValueError(
                f"a hook on a layer's output of shape {tuple(t.shape)}, broadcast over the batch, returned a new "
                "gradient: each sample's part of it cannot be told, so per-sample clipping would be wrong. Change the "
                "gradient where the output meets the batch (a hook on x + pos), or give the layer per-sample ids"
            )
        return None

    return t.dptrain_rows.register_hook(on_rows)


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _substituted(args, kwargs):
    return pytree.tree_map(rows_of, (args, kwargs))


def _on_rows(func, args, kwargs, wrapped: list, rowwise: bool):
    out = _run_on_rows(func, args, kwargs)
    if not rowwise:
        return out
    if any(w.dptrain_written for w in wrapped):  # the table's value as without the engine, its rows the copies'
        return _wrap_rowwise(out, wrapped, _plain(func, args, kwargs))
    return _wrap_rowwise(out, wrapped)


def _current(tables) -> None:
    """Refuse a table whose rows may no longer hold its values (``_Family``); its own value always does (it is the
    table as without the engine), so only a use of its rows asks."""
    for t in tables:
        if isinstance(t, BroadcastRows) and t.dptrain_family is not None:
            t.dptrain_family.check(t)


def _run_on_rows(func, args, kwargs):
    """``func`` with every BroadcastRows argument replaced by its rows; ``t.repeat(B, ...)`` / ``t.tile(B, ...)``
    of a table that leads with 1 (a broadcast written out, timm's XCiT) is its rows repeated ``(1, ...)``."""
    if func in (torch.Tensor.repeat, torch.Tensor.tile) and isinstance(args[0], BroadcastRows) and not kwargs:
        counts = args[1:]
        if len(counts) == 1 and isinstance(counts[0], (tuple, list)):
            counts = tuple(counts[0])
        _current(args[:1])
        rows = args[0].dptrain_rows
        if len(counts) == rows.dim() and counts[0] == rows.shape[0]:
            return func(rows, (1, *counts[1:]))
    if func in _RESHAPES and isinstance(args[0], BroadcastRows):
        shape = _leading_one_shape(args[1:], kwargs)
        if shape is not None:  # t.view(1, T, heads, -1), the table's own batch axis named: each row so
            rows = rows_of(args[0])
            return func(rows, (rows.shape[0], *shape[1:]))
    args, kwargs = _substituted(args, kwargs)
    return func(*args, **kwargs)


_RESHAPES = (torch.Tensor.view, torch.Tensor.reshape)


def _leading_one_shape(rest: tuple, kwargs: dict) -> tuple | None:
    """The shape a ``view`` / ``reshape`` was given (as one tuple or as integers), where it leads with 1."""
    if kwargs:
        return None
    shape = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
    if shape and all(isinstance(n, int) and not isinstance(n, bool) for n in shape) and shape[0] == 1:
        return shape
    return None


def _wrap_rowwise(out, wrapped: list, firsts=None):
    """Each tensor of ``out`` (results on the rows) as a table of the wrapped tables' family; ``firsts``: the values
    (the results on the tables themselves) where those are not the rows' first (a written table's)."""
    callbacks = tuple(dict.fromkeys(cb for w in wrapped for cb in w.dptrain_shared_use))
    family = wrapped[0].dptrain_family
    if firsts is None:
        return pytree.tree_map(lambda t: BroadcastRows.wrap(t, callbacks, family) if isinstance(t, torch.Tensor)
                               else t, out)
    return pytree.tree_map(lambda t, f: BroadcastRows.wrap(t, callbacks, family, f) if isinstance(t, torch.Tensor)
                           else t, out, firsts)


def _in_place(func, args, kwargs, wrapped: list, signature):
    """An operation that writes into its first argument (``h += pos``, ``h.add_(pos)``): run once. Into an ordinary
    tensor, with the table broadcast over the batch, it runs on the rows (checked on copies once per signature);
    into the table itself, ``_write_table``; any other way, as it is."""
    target = args[0] if args else None
    if isinstance(target, BroadcastRows) and hasattr(target, "dptrain_rows") and "out" not in kwargs:
        return _write_table(func, args, kwargs, wrapped, signature)
    verdict = _VERDICTS.get(signature) if signature is not None else None
    if verdict is None and isinstance(target, torch.Tensor) and not isinstance(target, BroadcastRows) \
            and "out" not in kwargs:
        with torch.no_grad():
            plain = func(target.detach().clone(), *args[1:], **kwargs)
            sub_args, sub_kwargs = _substituted(args[1:], kwargs)
            try:
                on_rows = func(target.detach().clone(), *sub_args, **sub_kwargs)
            except Exception:
                on_rows = None
        verdict = "shared" if on_rows is None else _compare(plain, on_rows, wrapped[0].dptrain_rows.shape[0],
                                                            wrapped[0].dim())
        verdict = "batch" if verdict == "batch" else "shared"
        _remember(signature, verdict)
    if verdict == "batch":
        return _on_rows(func, args, kwargs, wrapped, rowwise=False)
    out = _plain(func, *_written((args, kwargs)))
    _tell_shared(func, wrapped, out)
    return out


def _write_table(func, args, kwargs, wrapped: list, signature):
    """A write into the table itself (``pos /= s``, ``pos.mul_(w)``, ``pos[..., 0] = v``; DeBERTa scales its projected
    relative table in place, Longformer its global queries).

    The table's value is written as without the engine (its other views see the write). Its rows over the batch get
    the same write: rows that view the layer's output are copied first (written through, their history would lead
    around the engine's hook on that output, and each sample's gradient would be lost), rows that are copies already
    are written in place. Later uses of the table run on those rows, each sample's gradient reaching its own row. Where
    the write is not the same on every row (checked by value once per signature), a copied table's rows become its
    first row alone, whose every later use reaches the engine in that row (read at every step, as a table used as a
    whole); rows written in place already are refused. A view of the table taken before the write and used after it
    is refused (``_Family``); so is, when a gradient reaches it, any use of the layer's output written through a view
    the engine did not follow (``capture``: the written output's base is guarded)."""
    target = args[0]
    family = target.dptrain_family
    _current([target])
    rows = target.dptrain_rows
    batch = rows.shape[0]
    verdict = _VERDICTS.get(signature) if signature is not None else None
    sub_args, sub_kwargs = _substituted(args[1:], kwargs)
    copied = family is None or _storage(rows) == family.storage
    on_rows = first = None
    if not copied:  # the table's own copies: written in place (a failed write writes nothing)
        try:
            func(rows, *sub_args, **sub_kwargs)
            on_rows = rows
        except RuntimeError:  # (rows expanded from one: more than one element in one place)
            copied = True
    if copied:
        if verdict != "shared":
            try:  # (a copy of the rows over the batch: their own memory, unlike the expanded view)
                on_rows = rows.clone()
                func(on_rows, *sub_args, **sub_kwargs)
            except Exception:  # the write does not take the rows (an index on the table's axis of size 1)
                on_rows = None
        if verdict != "rowwise" or on_rows is None:  # before the table is written: the first row as it was
            first = rows.narrow(0, 0, 1).clone()
            func(first, *_written(args[1:]), **_written(kwargs))
    if _storage(target) == _storage(on_rows if on_rows is not None else rows):
        out = None if getattr(func, "__name__", "") == "__setitem__" else target  # (its rows' write was its own)
    else:
        out = _plain(func, args, kwargs)  # the table itself, as without the engine
    if verdict is None or (verdict == "rowwise" and on_rows is None):
        with torch.no_grad():
            same = on_rows is not None and on_rows.shape == (batch, *target.shape[1:]) and _same(
                on_rows, target.expand_as(on_rows))
        verdict = "rowwise" if same else "shared"
        _remember(signature, verdict)
    if verdict != "rowwise" and not copied:
        raise ValueError(
            f"the output of {family.where}, a table broadcast over the batch, was written in place a second time "
            f"({getattr(func, '__name__', func)}) in a way that is not the same on every row of the batch: its rows "
            "cannot follow it. Modify the table out of place, or write it once"
        )
    if verdict == "rowwise":
        target.dptrain_rows = on_rows
    else:
        assert first is not None  # (copied: kept above, before the write)
        target.dptrain_rows = first.expand(batch, *first.shape[1:])
        _tell_shared(func, wrapped, first)
    target.dptrain_written = True
    target.dptrain_rows_version = target.dptrain_rows._version
    if family is not None:
        family.generation += 1
        target.dptrain_generation = family.generation
    return out


def _written(tree):
    """``tree`` with each table written in place (``_write_table``) replaced by the first of its rows: its values, and a
    history that reaches the engine's hook (the table itself, written through, leads around it)."""
    written = [t for t in pytree.tree_leaves(tree) if isinstance(t, BroadcastRows) and t.dptrain_written]
    if not written:
        return tree
    _current(written)
    return pytree.tree_map_only(BroadcastRows, lambda t: t.dptrain_rows.narrow(0, 0, 1) if t.dptrain_written else t,
                                tree)


def _remember(signature, verdict: str) -> None:
    if signature is not None:
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        _VERDICTS[signature] = verdict


def _writes(func, kwargs) -> bool:
    """Whether ``func`` writes into an argument (``mul_``, ``+=``, ``x[i] = v``, ``out=``)."""
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


_IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow",
                                             "and", "or", "xor", "lshift", "rshift")} | {"__setitem__"}


def _needs_gradient(out) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out))


def _judge(func, args, kwargs, wrapped: list, plain) -> tuple[str, object]:
    """How ``func`` treats the BroadcastRows among its arguments, from its results (``plain``, as without the engine,
    and on the rows), by value; and its result on the rows. A random operation draws its numbers for the rows from a
    copy of the generators' states: the program's own draws are those it makes without the engine."""
    batch = wrapped[0].dptrain_rows.shape[0]
    if any(w.dptrain_rows.shape[0] != batch for w in wrapped):
        return "shared", None
    devices = list(dict.fromkeys(w.device.index or 0 for w in wrapped if w.device.type == "cuda"))
    try:
        with torch.random.fork_rng(devices=devices):
            on_rows = _run_on_rows(func, args, kwargs)
    except Exception:  # e.g. a view to the table's own shape: the operation does not take the rows
        return "shared", None
    return _compare(plain, on_rows, batch, wrapped[0].dim()), on_rows


def _compare(plain, on_rows, batch: int, rank: int) -> str:
    """"batch" where each result as without the engine broadcasts the table's batch axis of size 1 to the batch (the
    axis it aligns with, counted from the right, has B entries) and equals the result on the rows; "rowwise" where
    each result keeps an axis of size 1 in front and the result on the rows is it repeated over the batch; else
    "shared" (``pos[0]`` equals ``rows[0]``, but only row 0 would get the gradient)."""
    plain_leaves, plain_spec = pytree.tree_flatten(plain)
    rows_leaves, rows_spec = pytree.tree_flatten(on_rows)
    if plain_spec != rows_spec:
        return "shared"
    verdicts = set()
    for a, b in zip(plain_leaves, rows_leaves):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
                return "shared"
            continue
        if a.shape == b.shape and a.dim() >= rank and a.shape[a.dim() - rank] == batch and _same(b, a):
            verdicts.add("batch")
        elif a.dim() and a.shape[0] == 1 and b.shape == (batch, *a.shape[1:]) and _same(b, a.expand_as(b)):
            verdicts.add("rowwise")
        else:
            return "shared"
    return verdicts.pop() if len(verdicts) == 1 else "shared"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of another kernel (a product broadcast or over expanded rows)."""
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return close(a, b, tol=16 * torch.finfo(a.dtype).eps)


def _tell_shared(func, wrapped: list, plain) -> None:
    if not _needs_gradient(plain):
        return
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    for w in wrapped:
        for callback in w.dptrain_shared_use:
            callback(name)


def _signature(func, args, kwargs, leaves: list) -> tuple | None:
    """What the verdict depends on: the function, how it was given its arguments, and each argument's shape, dtype,
    device and gradient flag (tensors; a table's also the batch its rows span: the same shapes may meet another
    batch in another model) or value (others); ``None`` where an argument has no hashable description (never
    remembered)."""
    key = [func, len(args), tuple(kwargs)]
    for a in leaves:
        if isinstance(a, torch.Tensor):
            rows = a.dptrain_rows.shape[0] if isinstance(a, BroadcastRows) and hasattr(a, "dptrain_rows") else None
            key.append((rows, tuple(a.shape), a.dtype, a.device.type, a.requires_grad))  # (the batch it spans too)
        elif isinstance(a, slice):
            key.append(("slice", a.start, a.stop, a.step))
        elif a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                         torch.memory_format, type(Ellipsis))):
            key.append((type(a), a))
        elif isinstance(a, tuple) and all(isinstance(x, int) or x is None for x in a):  # a torch.Size
            key.append((type(a), a))
        else:
            return None
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)
