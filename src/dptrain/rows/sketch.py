"""Per-row sketches of a gradient: what the row reading keeps of a tag pass instead of the gradient itself.

A tag pass's output gradient of a layer call is as large as the call's output. Reading which sample each row
belongs to needs, per row, the least-squares ratio of the tagged row to the real one and the residual of that fit
(``reading.read_sketches``). Both are taken on a *sketch* of each row instead: ``k = 16`` Gaussian random
projections ``s(x) = x W`` of the flattened row ``x`` (``W``: ``[width, k]``, independent standard Gaussian entries,
drawn for one backward and shared by all its passes). So a sketch costs ``k`` numbers per row, is linear (the parts
of one pass add up), and is computed in float64 in bounded blocks of rows and columns, ``W`` drawn block by block
from a seed: the reading never holds a whole tagged gradient, a float64 copy of one, nor the whole of ``W``.

What a sketch keeps and what it can miss:

- A row of one sample is its tag ``v`` (a power of two) times the real row, up to the rounding of its own
  computation: exactly ``v`` times when the backward is deterministic, since scaling by a power of two commutes
  with rounding. Its sketch is then exactly ``v`` times the real row's sketch (same projections, same order).
- A row that mixes samples is ``v`` times the real row plus a residual ``r`` whose part ``r'`` orthogonal to the real
  row ``g`` is not 0. ``W`` is Gaussian, so ``r' W`` is independent of ``g W``, and the residual of the fit on the
  sketches is at least ``|r'|^2`` times a chi-squared variable of 15 degrees of freedom, against the threshold
  ``rel^2 |t W|^2`` (``|t W|^2`` is ``|t|^2`` times a chi-squared of 16). The mixture passes unseen with probability
  ``P[F(15, 16) <= (rel / rho)^2 16 / 15]`` where ``rho = |r'| / |t|``: in float32 (``rel`` = 1.2e-4), 6e-11 for a
  mixture of a per mille of the row and 7e-26 for one of a percent; a mixture below ``rel`` passes the reading of
  whole gradients too (rounding cannot be told from it).
"""
from __future__ import annotations

import math

import torch

SKETCH_DIM = 16
#: rows are converted to float64 in blocks of at most this many elements (32 MiB)
BLOCK_ELEMENTS = 1 << 22
#: the projection is drawn in blocks of this many columns (of the flattened row): 8 MiB each
COLUMNS = 1 << 16
#: blocks of the projection kept for the backward (drawn again past it)
CACHED_BLOCKS = 8


class Projections:
    """The random projection of one backward's sketches: for rows of each width, a Gaussian ``[width, k]`` matrix
    drawn block by block from this seed (the same for every pass of the backward)."""

    def __init__(self, seed: int, dim: int = SKETCH_DIM):
        self.seed = seed
        self.dim = dim
        self._blocks: dict[tuple, torch.Tensor] = {}

    def block(self, width: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Rows ``start:stop`` of the projection of rows of ``width`` columns, float64, on ``device``."""
        key = (width, start, device)
        got = self._blocks.get(key)
        if got is None:
            seed = (self.seed * 1_000_003 + width * 7_919 + start) % (1 << 62)
            # drawn where it is used: a block drawn on the CPU and copied to a GPU cost seconds per tag pass there
            # (the CPU's Gaussian draws, a pageable copy and a synchronization per block)
            got = torch.randn(stop - start, self.dim, generator=torch.Generator(device).manual_seed(seed),
                              dtype=torch.float64, device=device)
            if len(self._blocks) < CACHED_BLOCKS:
                self._blocks[key] = got
        return got


def sketch_rows(grad: torch.Tensor, axes: int, projections: Projections) -> torch.Tensor:
    """``[rows, k]`` float64 sketches of ``grad``'s rows along its first ``axes`` (1 or 2) dimensions.

    A row of width one (``grad`` of ``axes`` dimensions) is sketched as the number times each projection."""
    rows = math.prod(grad.shape[:axes]) if grad.dim() >= axes else 1
    width = math.prod(grad.shape[axes:])
    flat = grad.detach().reshape(rows, width)
    out = torch.zeros(rows, projections.dim, dtype=torch.float64, device=grad.device)
    columns = min(COLUMNS, max(1, width))
    step = max(1, BLOCK_ELEMENTS // columns)
    for start in range(0, width, columns):
        stop = min(width, start + columns)
        projection = projections.block(width, start, stop, grad.device)
        for first in range(0, rows, step):
            block = flat[first:first + step, start:stop].to(torch.float64)
            out[first:first + step] += block @ projection
    return out
