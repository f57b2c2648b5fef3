"""Fixed-shape batches: every batch exactly K rows, the real ones first, then zero rows, and a mask.

``poisson_loader(..., max_batch_size=K)`` collates with ``_FixedShapeCollate`` into a :class:`FixedShapeBatch`;
:func:`masked_losses` zeroes the losses of the padding rows.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .batches import _batch_size, _EmptyBatchCollate, _map_batch

# The outputs of masked_losses still alive, with their masks: engine.backward(masked_losses(losses, mask)) comes with
# its mask although no mask= is given (a weak map owned here: nothing is hung on the user's tensor).
_MASKS_OF_MASKED_LOSSES = WeakIdKeyDictionary()


class FixedShapeBatch(NamedTuple):
    """A fixed-shape batch from ``poisson_loader(..., max_batch_size=K)``.

    ``data``: the collated batch (same structure as without ``max_batch_size``), every
    tensor with exactly K rows along dim 0 (per-sample lists: K entries). The first
    ``n`` rows are the real examples (``n = int(mask.sum())``, at most K), the rest are
    padding: zeros (``""`` / ``0`` in per-sample lists). ``mask``: ``torch.bool`` of shape
    ``[K]``, True for real rows.

    Unpack it as ``for (x, y), mask in loader`` (or ``batch.data`` / ``batch.mask``) and
    give the engine the mask, ``engine.backward(losses, mask=mask)``: a padded row's loss
    then counts as 0, its per-sample gradient 0 and its clipped contribution exactly 0,
    while its unmasked loss still shows the engine where its rows are, so each layer's
    layout is read once and cached. (``engine.backward(masked_losses(losses, mask))`` is
    exact too, but a padded row without a gradient hides its layout: it is read at every
    step.) Padded rows are never counted as samples: the engine divides the noisy sum
    by the *expected* batch size, ``q * len(dataset)``, not by a number of rows. (For a
    plain ``loss.backward()`` with ``loss_reduction="mean"``, take the mean over all K
    rows, ``masked_losses(losses, mask).mean()``, not over the real ones.) Attached to
    the loader (``engine.attach(optimizer, data_loader=loader)``), the engine refuses a
    backward of a padded batch that does not carry the mask: losses not returned by
    ``masked_losses`` itself, or a plain ``loss.backward()``.
    """

    data: Any
    mask: torch.Tensor


def masked_losses(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``losses`` with the rows of padding (``mask`` False) set to exactly 0.

    ``losses``: per-sample losses ``[K]`` or ``[K, ...]``; ``mask``: the batch's boolean
    ``[K]`` mask (:class:`FixedShapeBatch`). Unlike ``losses * mask``, a non-finite loss
    on a padded row (zero inputs can give one) becomes 0 too.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        raise ValueError(
            "mask must be the boolean [K] mask of a FixedShapeBatch (True for real rows), got "
            + (f"a {mask.dtype} tensor of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor)
               else type(mask).__name__)
        )
    if not isinstance(losses, torch.Tensor) or losses.dim() == 0 or losses.shape[0] != mask.shape[0]:
        shape = list(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"losses must be per-sample losses with one row per row of the batch ({mask.shape[0]}), got {shape}; "
            "use reduction='none'"
        )
    keep = mask.to(losses.device).view(-1, *([1] * (losses.dim() - 1)))
    masked = torch.where(keep, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
    if not torch.compiler.is_compiling():  # (a compiled function returns other tensors: nothing to note there)
        _MASKS_OF_MASKED_LOSSES[masked] = mask
    return masked


def mask_of_masked_losses(losses: Any) -> torch.Tensor | None:
    """The mask that made ``losses``, if they are exactly what :func:`masked_losses` returned (not a tensor computed
    from them), else None."""
    return _MASKS_OF_MASKED_LOSSES.get(losses) if isinstance(losses, torch.Tensor) else None


def _zero_value(value: Any) -> Any:
    """The padding entry of a per-sample list: an empty string, a zero number, None."""
    if value is None:
        return None
    try:
        return type(value)()
    except TypeError:
        return 0


def _zero_row(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return torch.zeros_like(leaf[:1])
    return [_zero_value(leaf[0])]


def _append_rows(leaf: Any, pad: Any, count: int) -> Any:
    if count == 0:
        return leaf
    if isinstance(leaf, torch.Tensor):
        if leaf.dim() != pad.dim() or leaf.dtype != pad.dtype:
            raise ValueError(
                f"fixed-shape batches need every example to collate to tensors of one dtype and rank: a batch tensor "
                f"of {leaf.dtype} with trailing shape {list(leaf.shape[1:])} differs from dataset[0]'s "
                f"({pad.dtype}, {list(pad.shape[1:])}); make the examples' fields one dtype and rank in the dataset"
            )
        # A collator that pads to the batch's longest example (DataCollatorWithPadding) gives each batch its own
        # trailing sizes: the padding rows (zeros, masked) take the batch's. The rows are K whatever the draw.
        return torch.cat([leaf, leaf.new_zeros(count, *leaf.shape[1:])])
    return type(leaf)(list(leaf) + list(pad) * count)


class _FixedShapeCollate(_EmptyBatchCollate):
    """Collate to a :class:`FixedShapeBatch` of exactly ``max_batch_size`` rows: the real
    rows first, then zero rows (made from the collated ``dataset[0]``)."""

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any, max_batch_size: int):
        super().__init__(collate_fn, example_item)
        self.max_batch_size = max_batch_size
        self.zero_row = _map_batch(collate_fn([example_item]), _zero_row)

    def __call__(self, items: list) -> FixedShapeBatch:
        real, rows = len(items), self.max_batch_size
        if real > rows:
            raise RuntimeError(f"a batch of {real} examples reached a loader of max_batch_size={rows}")
        batch = super().__call__(items)
        collated = _batch_size(batch)
        if collated != real:
            raise ValueError(
                f"collate_fn made {collated} rows of {real} examples: fixed-shape batches need one row per example"
            )
        data = _map_batch(batch, lambda leaf, pad: _append_rows(leaf, pad, rows - real), self.zero_row)
        return FixedShapeBatch(data, torch.arange(rows) < real)
