"""Lower-triangular Toeplitz matrices by their first column: products, inverses, errors, sensitivities.

A lower-triangular Toeplitz matrix ``T(c)`` of size ``n`` is fixed by its first column ``c``
(``T[i, j] = c[i - j]`` for ``i >= j``). Such matrices form a commutative algebra: the product of
``T(a)`` and ``T(b)`` is ``T(a * b)`` with ``a * b`` the truncated convolution, and the inverse of
``T(c)`` is ``T(h)`` with ``h`` the first ``n`` coefficients of the power series ``1 / c(x)``. So every
computation here costs ``O(n log n)`` (FFT convolutions; Newton's iteration for the inverse) instead of
the ``O(n^2)``-``O(n^3)`` of the materialized matrices, and it is differentiable (torch, float64), which
is what the strategy optimization (``strategies``) needs.

Notation (as in Choquette-Choo et al. 2023 and jax_privacy's ``matrix_factorization``): the workload
``A`` (prefix sums for SGD: ``T(1, 1, ..., 1)``) is factored as ``A = B C``; ``C`` is the strategy, the
noise added at step ``t`` is row ``t`` of ``C^{-1} Z``, and ``B = A C^{-1}`` maps that noise into the
trajectory. The expected squared error of query ``t`` under unit noise is ``||B[t, :]||^2``.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "materialize",
    "minsep_sensitivity_squared",
    "multiply",
    "per_query_error",
    "series_inverse",
    "workload_coefficients",
]

DTYPE = torch.float64


def _as_tensor(c) -> torch.Tensor:
    return c if isinstance(c, torch.Tensor) else torch.as_tensor(c, dtype=DTYPE)


def _padded(c: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of ``c``, zeros after its end."""
    c = c[:n]
    return torch.cat([c, c.new_zeros(n - len(c))]) if len(c) < n else c


def multiply(a, b, n: int) -> torch.Tensor:
    """First column of ``T(a) T(b)`` (size ``n``): the convolution of ``a`` and ``b``, cut to ``n``."""
    a, b = _padded(_as_tensor(a), n), _padded(_as_tensor(b), n)
    if n <= 64:  # exact and cheaper than an FFT for short columns
        return torch.stack([torch.dot(a[: k + 1], b[: k + 1].flip(0)) for k in range(n)])
    size = 1 << (2 * n - 1).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)[:n]


def series_inverse(c, n: int) -> torch.Tensor:
    """First column of ``T(c)^{-1}`` (size ``n``): the first ``n`` coefficients of ``1 / c(x)``.

    Newton's iteration ``g <- g (2 - c g) mod x^{2m}`` doubles the number of correct coefficients
    per step, so ``log2(n)`` steps of FFT convolutions suffice. Needs ``c[0] != 0``.
    """
    c = _padded(_as_tensor(c), n)
    if float(c[0].detach()) == 0.0:
        raise ValueError("a lower-triangular Toeplitz matrix with c[0] = 0 is singular")
    g = (1.0 / c[:1])
    m = 1
    while m < n:
        m = min(2 * m, n)
        correction = -multiply(c[:m], g, m)
        correction = correction + torch.cat([correction.new_full((1,), 2.0), correction.new_zeros(m - 1)])
        g = multiply(g, correction, m)
    return g[:n]


def materialize(c, n: int | None = None) -> torch.Tensor:
    """The ``n x n`` matrix ``T(c)`` (for tests and small checks)."""
    c = _as_tensor(c)
    n = len(c) if n is None else n
    c = _padded(c, n)
    i = torch.arange(n)
    diff = i[:, None] - i[None, :]
    return torch.where(diff >= 0, c[diff.clamp_min(0)], c.new_zeros(()))


def workload_coefficients(n: int, momentum: float = 0.0) -> torch.Tensor:
    """First column of the workload: what the model's parameters sum of the gradients.

    Plain SGD: the parameters after ``t`` steps are the prefix sum of the updates (``A = T(1, ..., 1)``).
    Heavy-ball momentum ``beta`` (``m_t = beta m_{t-1} + g_t``, ``theta_t = theta_{t-1} - lr m_t``) makes
    ``theta_t = theta_0 - lr sum_s a_{t-s} g_s`` with ``a_k = (1 - beta^{k+1}) / (1 - beta)``, still Toeplitz
    (Denisov et al. 2022; Choquette-Choo et al. 2023).
    """
    k = torch.arange(n, dtype=DTYPE)
    if momentum == 0.0:
        return torch.ones(n, dtype=DTYPE)
    return (1.0 - momentum ** (k + 1)) / (1.0 - momentum)


def per_query_error(*, strategy=None, noising=None, n: int, workload=None) -> torch.Tensor:
    """``||B[t, :]||^2`` for every step ``t`` (``B = A C^{-1}``), the squared error of query ``t`` under unit noise.

    Give the strategy ``C`` or the noising matrix ``C^{-1}`` (by first columns). ``workload``: the first
    column of ``A`` (default: prefix sums). ``B`` is lower-triangular Toeplitz, so row ``t``'s squared norm
    is the sum of its first ``t + 1`` squared coefficients.
    """
    if (strategy is None) == (noising is None):
        raise ValueError("give exactly one of strategy or noising")
    inverse = series_inverse(strategy, n) if noising is None else _padded(_as_tensor(noising), n)
    b = torch.cumsum(inverse, 0) if workload is None else multiply(workload, inverse, n)
    return torch.cumsum(b * b, 0)


def minsep_sensitivity_squared(strategy, n: int, min_sep: int, max_participations: int | None = None
                               ) -> torch.Tensor:
    """Squared L2 sensitivity of ``T(c)`` (size ``n``) when a unit takes part at most ``max_participations``
    times, any two of them at least ``min_sep`` steps apart; every contribution of norm at most 1.

    The neighbouring difference is ``sum_j C[:, t_j] g_j`` with ``||g_j|| <= 1``; by the triangle inequality
    row by row its norm is at most ``||T(|c|) 1_S||`` for the set ``S`` of steps taken part in, and at most
    ``||T(c_bar) 1_S||`` for ``c_bar`` the smallest non-increasing majorant of ``|c|``. For non-negative,
    non-increasing coefficients the worst ``S`` is the earliest, tightest one, ``{0, b, 2b, ...}`` (Kalinin &
    Lampert 2024, Theorem 2; jax_privacy's ``toeplitz.minsep_sensitivity_squared``), and the bound is
    attained by aligned contributions. So this is exact when ``c`` is non-negative and non-increasing (the
    strategies ``strategies`` builds), and an upper bound otherwise.
    """
    if min_sep < 1:
        raise ValueError(f"min_sep must be a positive integer, got {min_sep}")
    c = _padded(_as_tensor(strategy), n).abs()
    c = torch.cummax(c.flip(0), 0).values.flip(0)  # the smallest non-increasing majorant
    k = math.ceil(n / min_sep)
    if max_participations is not None:
        k = min(k, max_participations)
    rows = math.ceil(n / min_sep)
    blocks = torch.cat([c, c.new_zeros(rows * min_sep - n)]).reshape(rows, min_sep)
    # column sums of T(c) over {0, b, 2b, ...}: u[t] = sum_{j >= 0, jb <= t} c[t - jb] ...
    summed = torch.cumsum(blocks, 0).reshape(-1)
    if k * min_sep < len(summed):  # ... less the terms of participations k, k+1, ...
        summed = torch.cat([summed[: k * min_sep], summed[k * min_sep:] - summed[: len(summed) - k * min_sep]])
    u = summed[:n]
    return torch.dot(u, u)
