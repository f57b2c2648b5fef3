"""Per-row sketches of a gradient: what the row reading keeps of a tag pass instead of the gradient itself.

A tag pass's output gradient of a layer call is as large as the call's output. Reading which sample each row
belongs to needs, per row, the least-squares ratio of the tagged row to the real one and the residual of that fit
(``reading.read_sketches``). Both are taken on a *sketch* of each row instead: ``k`` random projections

    s(x)_j = sum_c x[c] * prod_l u_{j,l}[c_l]

of the row ``x`` (its trailing dimensions ``c = (c_1, ..., c_m)``), with independent standard Gaussian factors
``u_{j,l}`` drawn for one backward and shared by every pass of it. So a sketch costs ``k`` numbers per row, is
linear (the parts of one pass add), and is computed in float64 in bounded blocks of rows: the reading never holds
a whole tagged gradient nor a float64 copy of one.

What a sketch keeps and what it can miss:

- A row of one sample is its tag ``v`` (a power of two) times the real row, up to the rounding of its own
  computation: exactly ``v`` times when the backward is deterministic, since scaling by a power of two commutes
  with rounding. Its sketch is then exactly ``v`` times the real row's sketch (same projections, same order).
- A row that mixes samples differs from ``v`` times the real row by a residual ``r != 0``. Its sketch misses it
  only if every projection of ``r`` is small: each ``s(r)_j`` is a non-zero polynomial in independent Gaussians
  (Gaussian itself for a one-dimensional row), so the chance that all ``k = 16`` fall below a fraction ``f`` of
  their typical size is at most of order ``(c f)^16`` (``c`` a small constant, a log factor for products) - for
  the reading's thresholds, far below 1e-20 for any mixture that moves the row by more than a per mille.
"""
from __future__ import annotations

import math

import torch

SKETCH_DIM = 16
#: rows are converted to float64 in blocks of at most this many elements (32 MiB)
BLOCK_ELEMENTS = 1 << 22


class Projections:
    """The random factors of one backward's sketches, drawn on first use for each row shape and device."""

    def __init__(self, seed: int, dim: int = SKETCH_DIM):
        self.seed = seed
        self.dim = dim
        self._factors: dict[tuple, list[torch.Tensor]] = {}

    def factors(self, sizes: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
        """One ``[size, k]`` float64 factor per trailing dimension of a row (the same for every pass)."""
        key = (sizes, device)
        got = self._factors.get(key)
        if got is None:
            g = torch.Generator().manual_seed(self.seed + 1_000_003 * len(self._factors))
            got = [torch.randn(n, self.dim, generator=g, dtype=torch.float64).to(device) for n in sizes]
            self._factors[key] = got
        return got


def sketch_rows(grad: torch.Tensor, axes: int, projections: Projections) -> torch.Tensor:
    """``[rows, k]`` float64 sketches of ``grad``'s rows along its first ``axes`` (1 or 2) dimensions.

    A row of width one (``grad`` of ``axes`` dimensions) is sketched as the number itself in every projection."""
    lead = grad.shape[:axes]
    rows = math.prod(lead) if grad.dim() >= axes else 1
    trailing = tuple(grad.shape[axes:])
    flat = grad.detach().reshape(rows, math.prod(trailing))
    if not trailing:
        return flat.to(torch.float64).expand(rows, projections.dim).clone()
    factors = projections.factors(trailing, grad.device)
    width = max(1, flat.shape[1])
    step = max(1, BLOCK_ELEMENTS // width)
    out = torch.empty(rows, projections.dim, dtype=torch.float64, device=grad.device)
    for start in range(0, rows, step):
        block = flat[start:start + step].to(torch.float64).reshape(-1, *trailing)
        out[start:start + step] = _contract(block, factors)
    return out


def _contract(block: torch.Tensor, factors: list[torch.Tensor]) -> torch.Tensor:
    """``sum_c block[n, c] * prod_l factors[l][c_l, j]`` for each row n and projection j, last dimension first."""
    n = block.shape[0]
    # the last dimension by a matrix product: [n, ..., d] @ [d, k] -> [n, ..., k]
    y = block @ factors[-1]
    for factor in reversed(factors[:-1]):  # then each earlier dimension by the same projection index j
        # y: [n, ..., d_l, k] -> sum over d_l of y * factor[d_l, k]
        y = (y * factor).sum(-2)
    return y.reshape(n, -1)


def sketch_rows_two_axes(grad: torch.Tensor, projections: Projections) -> tuple[torch.Tensor, torch.Tensor]:
    """Sketches of ``grad``'s rows along its first axis and along its first two axes (flattened), from one pass.

    The second axis is one more trailing dimension of a first-axis row: its sketch is the two-axis rows' sketches
    weighted by one more random factor over that axis."""
    both = sketch_rows(grad, 2, projections)  # [N0 * N1, k]
    n0, n1 = grad.shape[0], grad.shape[1]
    weights = projections.factors((n1,), grad.device)[0]
    first = (both.reshape(n0, n1, projections.dim) * weights).sum(1)
    return first, both
