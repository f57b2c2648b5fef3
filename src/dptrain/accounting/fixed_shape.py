"""Fixed-shape batches: the delta that truncating Poisson batches to ``max_batch_size`` rows adds to a run
(the binomial tail, exactly and without scipy), the smallest ``max_batch_size`` that costs a tenth of delta, and
the delta left to the Poisson-subsampled Gaussian."""

from __future__ import annotations

import math
from typing import Any

from .. import _checks
from .accountants import _check_count, _check_delta, _check_max_batch_size

# A fixed-shape loader (dptrain.data.poisson_loader(..., max_batch_size=K)) draws a Poisson
# sample and, when it has more than K examples, keeps a uniformly random K of them. Compare
# neighbouring datasets D and D + x: on the event that every step draws at most K - 1 of D's
# examples, neither run truncates (x makes at most K), so both are the Poisson runs; that
# event depends only on D's draws, so the Poisson guarantee holds on it, and the run is
# (epsilon, delta + steps * P[Binomial(N, q) >= K])-DP (union bound). See docs/accounting.md.

_ULP = 2.0**-52
_NEGLIGIBLE = 2.0**-60  # a term below this fraction of the running sum ends a sum


def _binomial_tail(n: int, p: float, k: int) -> float:
    """An upper bound on ``P[Binomial(n, p) > k]`` within ~1e-9 relative of the exact value.

    Sums probability terms outward from the boundary in log space (``math.lgamma`` for the
    first term, the ratio ``pmf(j + 1) / pmf(j) = (n - j) p / ((j + 1)(1 - p))`` for the
    next), so the cost is the width of the distribution, not ``n``. Every approximation
    errs upward: the first term is inflated by a bound on the rounding of ``lgamma`` and
    of the ratios, the terms left out above the mode are bounded by a geometric series,
    and when the complement is summed (``k`` below the mode) the terms left out only make
    ``P[X <= k]`` smaller.
    """
    if k >= n:
        return 0.0
    if k < 0 or p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    odds = p / (1.0 - p)

    def log_pmf(j: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * log_p + (n - j) * log_q

    # Rounding in log_pmf: a few ulps of the magnitudes that cancel in it (generously 64).
    slack = 64.0 * _ULP * (2.0 * math.lgamma(n + 1) + n * (abs(log_p) + abs(log_q)) + 1.0)
    mode = math.floor((n + 1) * p)
    if k + 1 >= mode:
        # Upper tail: pmf(j) decreases for j >= mode, so the terms j = k+1, k+2, ... shrink.
        j, term, total = k + 1, 1.0, 1.0  # terms relative to pmf(k + 1)
        while j < n:
            ratio = (n - j) / (j + 1) * odds  # < 1 and decreasing in j past the mode
            if term < _NEGLIGIBLE * total:
                total += term * ratio / (1.0 - ratio)  # all later terms: at most a geometric series
                break
            term *= ratio
            total += term
            j += 1
        slack += 8.0 * _ULP * (j - k)  # each ratio and product rounds by a few ulps
        if total == 0.0:
            return 0.0
        return min(1.0, math.exp(log_pmf(k + 1) + math.log(total) + slack))
    # Lower tail: 1 - P[X <= k]; pmf(j) increases up to the mode, so j = k, k-1, ... shrink.
    j, term, total = k, 1.0, 1.0  # terms relative to pmf(k)
    while j > 0 and term >= _NEGLIGIBLE * total:
        term *= j / ((n - j + 1) * odds)  # pmf(j - 1) / pmf(j)
        total += term
        j -= 1
    slack += 8.0 * _ULP * (k - j + 1)
    cdf_lower = math.exp(log_pmf(k) + math.log(total) - slack)
    return min(1.0, max(0.0, 1.0 - cdf_lower))


def truncation_delta(sample_size: int, sample_rate: float, max_batch_size: int, steps: int) -> float:
    """The delta that truncating Poisson batches to ``max_batch_size`` rows adds to a run.

    ``steps * P[Binomial(sample_size, sample_rate) >= max_batch_size]`` (capped at 1): by the
    union bound, the probability that some step draws ``K = max_batch_size`` or more of the
    dataset's N examples. Outside that event a draw has at most K - 1 of them, so even with
    the one example in which a neighbouring dataset differs it has at most K and nothing is
    truncated: both runs are Poisson runs, and the Poisson guarantee holds there. A run
    whose accountant gives epsilon at ``delta`` is then ``(epsilon, delta +
    truncation_delta(...))``-DP (docs/accounting.md). ``>= K``, not ``> K``: the neighbour
    with one more example must not be truncated either. Computed exactly (an upper bound
    within ~1e-9 relative), without scipy; 0.0 when ``K > sample_size``.
    """
    n = _checks.integer("sample_size", sample_size, 1, "the number of training examples", integral_floats=True)
    q = _checks.sample_rate(sample_rate)
    k = _check_max_batch_size(max_batch_size)
    steps = _check_count(steps, "steps", 0)
    if steps == 0:
        return 0.0
    tail = _binomial_tail(n, q, k - 1)  # P[X >= k] = P[X > k - 1]
    if tail == 0.0 and k <= n:
        tail = 5e-324  # the exact tail is positive; round up, not to zero
    return min(1.0, steps * tail)


def default_max_batch_size(sample_size: int, sample_rate: float, delta: float, steps: int) -> int:
    """The smallest K whose :func:`truncation_delta` over ``steps`` steps is at most ``delta / 10``.

    Fixed-shape batches then cost a tenth of the delta budget: the accountant computes
    epsilon at ``0.9 * delta`` or more (:func:`poisson_delta`). Any larger K (e.g. rounded
    up to a multiple of 8 for the accelerator) costs even less.
    """
    n = _checks.integer("sample_size", sample_size, 1, "the number of training examples", integral_floats=True)
    q = _checks.sample_rate(sample_rate)
    budget = _check_delta(delta) / 10.0
    steps = _check_count(steps, "steps", 1)
    low, high = 0, n + 1  # truncation_delta(high) <= budget (it is 0 at n + 1); low fails or is 0
    while high - low > 1:
        middle = (low + high) // 2
        if truncation_delta(n, q, middle, steps) <= budget:
            high = middle
        else:
            low = middle
    return high


def poisson_delta(
    delta: float, sample_size: int, sample_rate: float, max_batch_size: int | None, steps: int
) -> float:
    """The part of ``delta`` left to the Poisson-subsampled Gaussian after truncation takes its share.

    ``delta - truncation_delta(sample_size, sample_rate, max_batch_size, steps)``, or
    ``delta`` itself when ``max_batch_size`` is None (batches not truncated). An epsilon
    computed at this delta holds at ``delta`` for the fixed-shape run. Raises
    ``ValueError`` when truncation alone spends all of ``delta``.
    """
    delta = _check_delta(delta)
    if max_batch_size is None:
        return delta
    extra = truncation_delta(sample_size, sample_rate, max_batch_size, steps)
    left = delta - extra
    if not left > 0.0:
        suggestion = default_max_batch_size(sample_size, sample_rate, delta, max(1, steps))
        raise ValueError(
            f"max_batch_size={max_batch_size} truncates too often: over {steps} steps the chance that a "
            f"Poisson draw exceeds it is {extra:.3g} >= delta={delta:.3g}, so no epsilon holds at this delta. "
            f"Use max_batch_size >= {suggestion} (default_max_batch_size: a tenth of delta), or a larger delta"
        )
    return left


def _fixed_shape_delta(delta: float, sample_size: Any, q: float, max_batch_size: Any, steps: int) -> float:
    if max_batch_size is None:
        return delta
    if sample_size is None:
        raise ValueError("max_batch_size needs sample_size (the dataset size N): the truncation term is "
                         "steps * P[Binomial(N, q) >= max_batch_size]")
    return poisson_delta(delta, sample_size, q, max_batch_size, steps)
