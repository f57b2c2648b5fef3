"""One-shot computations: the epsilon of a planned run (:func:`compute_epsilon`) and the smallest noise multiplier
for a target epsilon (:func:`calibrate_noise_multiplier`), with the truncation term of fixed-shape batches."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from .. import _checks
from .accountants import (
    _GDP_WARNING,
    DEFAULT_ACCOUNTANT,
    GDPApproximationWarning,
    HistoryEntry,
    _check_accountant_name,
    _check_count,
    _check_delta,
    _check_noise_multiplier,
    _epsilon,
    gdp_epsilon,
    gdp_mu,
)
from .fixed_shape import _fixed_shape_delta

# Calibration refuses targets that would need more noise than this: such a run would
# learn nothing, and the request is almost always a mistake in epsilon, q or steps.
MAX_NOISE_MULTIPLIER = 1e4


def compute_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    *,
    sample_size: int | None = None,
    max_batch_size: int | None = None,
) -> float:
    """Epsilon of ``steps`` DP-SGD steps with Poisson sample rate ``sample_rate``.

    With ``max_batch_size=K`` (fixed-shape batches of K rows; needs ``sample_size``) the
    epsilon is the one that holds at ``delta`` *including* the truncation term: the
    accountant's epsilon at :func:`poisson_delta`.
    """
    name = _check_accountant_name(accountant)
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _checks.sample_rate(sample_rate)
    steps = _check_count(steps, "steps", 0)
    delta = _fixed_shape_delta(_check_delta(delta), sample_size, q, max_batch_size, steps)
    if name == "gdp":
        warnings.warn(_GDP_WARNING, GDPApproximationWarning, stacklevel=2)
    return _epsilon(name, [(sigma, q, steps)] if steps else [], delta)


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = DEFAULT_ACCOUNTANT,
    *,
    sample_size: int | None = None,
    max_batch_size: int | None = None,
    history: Sequence[HistoryEntry] = (),
) -> float:
    """The smallest noise multiplier whose epsilon does not exceed ``target_epsilon``.

    The result ``sigma`` satisfies ``0.99 * target_epsilon <= epsilon(sigma) <=
    target_epsilon``: it never overshoots the target and wastes at most 1 % of it.
    Raises ``ValueError`` for invalid inputs or a target that would need a noise
    multiplier above ``MAX_NOISE_MULTIPLIER``. With ``max_batch_size=K`` (needs
    ``sample_size``) the target holds at ``target_delta`` including the truncation term
    of fixed-shape batches (see :func:`compute_epsilon`).

    ``history``: steps already taken, ``[(noise_multiplier, sample_rate, count), ...]`` (a resumed run):
    the result is the noise of the ``steps`` steps still to come, so that all of them together stay
    within the target. (Their truncation term, if they were truncated, is the caller's to take from
    ``target_delta``.)
    """
    name = _check_accountant_name(accountant)
    target = _checks.positive("target_epsilon", target_epsilon)
    q = _checks.sample_rate(sample_rate)
    steps = _check_count(steps, "steps", 1)
    delta = _fixed_shape_delta(_check_delta(target_delta), sample_size, q, max_batch_size, steps)
    if name == "gdp":
        warnings.warn(_GDP_WARNING, GDPApproximationWarning, stacklevel=2)
    prior = [(_check_noise_multiplier(s), _checks.sample_rate(r), _check_count(c, "steps", 0)) for s, r, c in history]
    if prior:
        spent = _epsilon(name, prior, delta)
        if spent >= target:
            raise ValueError(f"target_epsilon={target} at delta={delta} is unreachable: the steps already taken "
                             f"spend epsilon={spent:.4g} at that delta")

    def epsilon(sigma: float) -> float:
        return _epsilon(name, prior + [(sigma, q, steps)], delta) if sigma > 0.0 else math.inf

    def unreachable(sigma: float, sigma_epsilon: float) -> ValueError:
        return ValueError(
            f"target_epsilon={target} at delta={delta} is unreachable with "
            f"sample_rate={q} and steps={steps}: even noise_multiplier={sigma:g} gives "
            f"epsilon={sigma_epsilon:.4g}. Increase target_epsilon, or decrease the "
            f"number of steps or the sample rate (smaller batches)."
        )

    # 1. Bracket the answer, low < sigma* <= high with epsilon(low) > target >=
    # epsilon(high) (epsilon decreases in sigma), starting from the closed-form GDP
    # answer, which is usually within ~20 % of the RDP / PLD one.
    guess = min(max(_gdp_noise_multiplier(target, delta, q, steps, gdp_mu(prior)), 1e-3), MAX_NOISE_MULTIPLIER)
    guess_epsilon = epsilon(guess)
    factor = 1.5
    if guess_epsilon > target:
        low, low_epsilon = guess, guess_epsilon
        while True:
            if low >= MAX_NOISE_MULTIPLIER:
                raise unreachable(low, low_epsilon)
            high = min(low * factor, MAX_NOISE_MULTIPLIER)
            high_epsilon = epsilon(high)
            if high_epsilon <= target:
                break
            low, low_epsilon, factor = high, high_epsilon, factor * factor
    else:
        high, high_epsilon = guess, guess_epsilon
        while True:
            low = high / factor if high / factor > 1e-6 else 0.0  # epsilon(0) is infinite
            low_epsilon = epsilon(low)
            if low_epsilon > target:
                break
            high, high_epsilon, factor = low, low_epsilon, factor * factor

    # 2. Shrink the bracket until epsilon(high) is within 1 % below the target. log(eps)
    # is nearly linear in log(sigma), so regula falsi there (Illinois variant, aimed at
    # the middle of the window) takes 1-3 evaluations; bisection where that is undefined.
    aim = math.log(0.995 * target)
    low_weight = high_weight = 1.0  # Illinois: halve the side that is kept repeatedly
    for _ in range(200):
        if high_epsilon >= 0.99 * target or high - low <= 1e-12 * high:
            break  # the width guard only matters if epsilon(sigma) jumps; high stays valid
        if low > 0.0 and math.isfinite(low_epsilon) and high_epsilon > 0.0:
            f_low = low_weight * (math.log(low_epsilon) - aim)
            f_high = high_weight * (math.log(high_epsilon) - aim)
            log_low, log_high = math.log(low), math.log(high)
            middle = math.exp(log_high - f_high * (log_high - log_low) / (f_high - f_low))
            if not low < middle < high:
                middle = math.sqrt(low * high)
        else:
            middle = 0.5 * (low + high)
        middle_epsilon = epsilon(middle)
        if middle_epsilon > target:
            low, low_epsilon = middle, middle_epsilon
            low_weight, high_weight = 1.0, high_weight * 0.5
        else:
            high, high_epsilon = middle, middle_epsilon
            low_weight, high_weight = low_weight * 0.5, 1.0
    return high


def _gdp_noise_multiplier(target: float, delta: float, q: float, steps: int, prior_mu: float = 0.0) -> float:
    """Closed-form (CLT) noise multiplier for a target, after steps of GDP ``prior_mu``: a starting point only."""
    low, high = 0.0, 1.0
    while gdp_epsilon(high, delta) < target and high < 1e6:
        low, high = high, 2.0 * high
    for _ in range(60):  # mu to ~1e-15 relative; gdp_epsilon costs microseconds
        middle = 0.5 * (low + high)
        low, high = (middle, high) if gdp_epsilon(middle, delta) < target else (low, middle)
    mu = math.sqrt(max(0.0, low * low - prior_mu * prior_mu)) if math.isfinite(prior_mu) else 0.0  # mu^2 compose
    if mu <= 0.0:
        return MAX_NOISE_MULTIPLIER
    # mu = q * sqrt(T * (exp(1/sigma^2) - 1))  <=>  sigma = 1 / sqrt(log1p((mu / q)^2 / T))
    return 1.0 / math.sqrt(math.log1p((mu / q) ** 2 / steps))
