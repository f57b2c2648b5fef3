"""The traces of the forwards whose rows were verified (``Traces``), and what a trace records of an operation
(``op_key``)."""
from __future__ import annotations

import torch


class Traces:
    """The forwards whose rows were verified, as a trie of their traces (``ForwardWatch``'s keys, in order).

    A forward whose trace ends at a verified record (``END``) computed as a verified one did: its layer calls' layouts
    are the record's (``RowReader``, keyed by record and call pattern). Any other forward is verified again. At most
    ``limit`` traces are kept: past it, a new trace is verified at each of its steps, never cached.
    """

    END = "end"

    def __init__(self, limit: int = 256):
        self.root: dict = {}
        self.limit = limit
        self.count = 0
        self._records = 0

    def new_record(self) -> int:
        self._records += 1
        return self._records

    def insert(self, keys: list, record: int) -> None:
        """A verified forward's trace (its backward read every call's rows, and it picked no rows by the data)."""
        if self.count >= self.limit:
            return
        node = self.root
        for key in keys:
            node = node.setdefault(key, {})
        if self.END not in node:
            node[self.END] = record
            self.count += 1


def _size(n, batch: int):
    """An integer argument as a trace key: the batch size as such, small ones (dims) as they are, others not at all
    (sequence lengths and widths change from batch to batch without changing which rows meet)."""
    if n == batch:
        return "B"
    return n if -8 <= n < 8 else "*"


#: a tensor's key by its rank (made once: one is made at every operation of every training forward)
_TENSOR_KEYS = tuple(("t", d) for d in range(16))


def _arg_key(a, batch: int, depth: int = 0):
    t = type(a)
    if t is int:
        return _size(a, batch)
    if isinstance(a, torch.Tensor):
        d = a.dim()
        return _TENSOR_KEYS[d] if d < 16 else ("t", d)
    if t is slice:
        return ("s", *(None if v is None else _size(v, batch) if type(v) is int else "?" for v in
                       (a.start, a.stop, a.step)))
    if (t is tuple or t is list) and depth == 0:
        return tuple(_arg_key(x, batch, 1) for x in a)
    if a is None or t is bool or t is str or a is Ellipsis:
        return a
    if isinstance(a, torch.dtype):
        return a
    return t.__name__


def op_key(func, args, kwargs, batch: int) -> tuple:
    """What a trace records of one operation: the function and the form of its arguments (tensors by rank, integers as
    ``_size`` has them, floats not at all: a mixing coefficient drawn per batch changes nothing)."""
    key = [func]
    for a in args:  # (tensors and integers, the usual arguments, inline: this runs at every operation)
        t = type(a)
        if t is int:
            key.append(_size(a, batch))
        elif isinstance(a, torch.Tensor):
            d = a.dim()
            key.append(_TENSOR_KEYS[d] if d < 16 else ("t", d))
        else:
            key.append(_arg_key(a, batch))
    if kwargs:
        for k, v in kwargs.items():
            key.append((k, _arg_key(v, batch)))
    return tuple(key)
