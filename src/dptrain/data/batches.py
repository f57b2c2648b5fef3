"""The structure of a batch: its number of samples, its per-sample leaves, and empty batches.

:func:`batch_len` reads a batch's number of samples leniently, ``_batch_size`` strictly; ``_map_batch`` applies a
function to every per-sample leaf (what slicing, padding and gathering rows build on); ``_EmptyBatchCollate``
collates an empty Poisson draw into an empty batch of the right structure.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Callable

import torch

# A batch is a tensor, or a Mapping / tuple / list nesting of batches, or a per-sample
# list or tuple of plain values (what default_collate makes of strings: a list in a dict,
# a tuple in a tuple of fields).

_PLAIN_VALUES = (str, bytes, numbers.Number, type(None))


def batch_len(batch: Any) -> int | None:
    """The number of samples in a batch, read leniently: the length along dim 0 of its first tensor that has a
    dim 0 (in dicts, tuples and lists, depth first); None if it holds none. ``_batch_size`` is the strict reading."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    return next((n for n in map(batch_len, values) if n is not None), None)


def _is_per_sample_list(batch: Any) -> bool:
    return (
        isinstance(batch, (list, tuple))
        and not hasattr(batch, "_fields")
        and all(isinstance(item, _PLAIN_VALUES) for item in batch)
    )


def _map_batch(batch: Any, fn: Callable[..., Any], *others: Any) -> Any:
    """Apply ``fn`` to every per-sample leaf (tensor or per-sample list) of a batch.

    With ``others`` (batches of the same structure), ``fn`` gets the leaf and theirs.
    """
    if isinstance(batch, torch.Tensor) or _is_per_sample_list(batch):
        return fn(batch, *others)
    if isinstance(batch, Mapping):
        mapped = {key: _map_batch(value, fn, *(o[key] for o in others)) for key, value in batch.items()}
        try:
            return type(batch)(mapped)  # type: ignore[call-arg]  # (a mapping class built from a dict)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_batch(value, fn, *rest) for value, *rest in zip(batch, *others)))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_batch(value, fn, *rest) for value, *rest in zip(batch, *others))
    raise TypeError(
        f"Cannot split a batch element of type {type(batch).__name__}: batches must be "
        "tensors, or dicts / tuples / lists of tensors (lists of strings are also fine)."
    )


def _batch_size(batch: Any) -> int:
    sizes: set[int] = set()

    def record(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0:
            raise ValueError(
                "A batch contains a 0-dimensional tensor, which has no batch dimension to "
                "split; every tensor in a batch must have the samples along dim 0."
            )
        sizes.add(len(leaf))
        return leaf

    _map_batch(batch, record)
    if len(sizes) != 1:
        raise ValueError(
            f"Inconsistent batch: its tensors / lists have sizes {sorted(sizes)} along dim 0; "
            "every element of a batch must have one entry per sample along dim 0."
            if sizes
            else "The batch contains no tensors, so its number of samples is unknown."
        )
    return sizes.pop()


def _empty_like_batch(batch: Any) -> Any:
    return _map_batch(batch, lambda leaf: leaf[:0])


class _EmptyBatchCollate:
    """Collate function that also handles empty batches.

    ``default_collate([])`` fails, and a user's collate function rarely expects an empty
    list. The empty batch is instead made from the collated first dataset item, sliced
    to 0 samples: the same structure, dtypes and trailing shapes as a real batch.
    """

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any):
        self.collate_fn = collate_fn
        try:
            self.empty_batch = _empty_like_batch(collate_fn([example_item]))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"Cannot build the empty batch for Poisson sampling from dataset[0] ({error}). "
                "Collated batches must be tensors, or dicts / tuples / lists of tensors."
            ) from error

    def __call__(self, items: list) -> Any:
        if len(items) == 0:
            return _empty_like_batch(self.empty_batch)  # fresh views: nothing shared
        return self.collate_fn(items)
