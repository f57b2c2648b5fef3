"""The statistics of the one-run audit: the p-value of a number of right guesses under (epsilon, delta)-DP
(Steinke, Nasr & Jagielski 2023), the lower bound on epsilon from canary scores, and the canaries' scores
(log-likelihood ratios of "included" against "excluded") under the Poisson-subsampled Gaussian and banded
correlated noise."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from .. import _checks

# Numbers of guesses the bound tries (then split between "in" and "out" guesses).
_GUESS_COUNTS = 8
_SMALLEST_GUESS_COUNT = 10


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``correct`` right guesses out of ``guesses`` under (epsilon, delta)-DP.

    Theorem 3.1 of Steinke, Nasr & Jagielski (2023): if each of ``canaries`` canaries is
    included independently with probability 1/2 and the training run is (epsilon, delta)-DP,
    the number ``W`` of right guesses among ``guesses`` guesses satisfies, for every ``v``,

        P[W >= v] <= f(v) + 2 m delta * max_{1 <= i <= v} (f(v - i) - f(v)) / i,

    where ``f(v) = P[Binomial(guesses, e^eps / (1 + e^eps)) >= v]``; the second term is
    the price of delta (with delta = 0 the binomial alone dominates).
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    right = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0  # randomized response's accuracy
    tail = float(scipy.stats.binom.sf(correct - 1, guesses, right))  # f(v)
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    # f(v - i) - f(v) = P[v - i <= W < v], for i = 1..v: cumulative sums of the pmf from v-1 down.
    below = scipy.stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, right)
    slope = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, tail + 2 * canaries * delta * slope)


def _largest_rejected_epsilon(canaries: int, guesses: int, correct: int, delta: float, level: float) -> float:
    """The largest epsilon whose p-value is below ``level`` (0 if none is): bisection, rounded down."""
    if one_run_p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    rejected, kept = 0.0, 1.0
    # Terminates: past epsilon ~ 37, e^eps / (1 + e^eps) rounds to 1 and the p-value is 1.
    while one_run_p_value(canaries, guesses, correct, kept, delta) < level:
        rejected, kept = kept, 2 * kept
    while kept - rejected > 1e-4:
        middle = (rejected + kept) / 2
        if one_run_p_value(canaries, guesses, correct, middle, delta) < level:
            rejected = middle
        else:
            kept = middle
    return rejected


@dataclass
class GuessingBound:
    """The lower bound on epsilon and the guesses that gave it."""

    epsilon: float          # the lower bound (0 when no epsilon > 0 is rejected)
    guesses_in: int         # canaries guessed "included": the highest scores
    guesses_out: int        # canaries guessed "excluded": the lowest scores
    correct: int            # right guesses among them
    tried: int              # (guesses_in, guesses_out) pairs searched; each is tested at (1 - confidence) / tried


def _guess_splits(canaries: int) -> list[tuple[int, int]]:
    """(guesses "in", guesses "out") pairs to try: a few geometric totals, split evenly.

    Few candidates on purpose: each one is tested at (1 - confidence) / len(candidates),
    and at so small a level the delta term of the theorem (2 m delta times a binomial
    probability) soon dominates. Measured on simulated runs of the default audit, 8
    totals from m/100 to m beat 16 or 32 candidates (with all-"in" splits) by 0.05-0.25 in
    the bound; abstaining on all but the most extreme 1-100 % of the scores is where the
    best guesses are.
    """
    smallest = min(canaries, max(_SMALLEST_GUESS_COUNT, canaries // 100))
    totals = sorted({int(round(k)) for k in np.geomspace(smallest, canaries, _GUESS_COUNTS)})
    return [(k - k // 2, k // 2) for k in totals]


def epsilon_lower_bound(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    splits: Sequence[tuple[int, int]] | None = None,
) -> GuessingBound:
    """A lower bound on epsilon, valid with probability ``confidence``, from canary scores.

    Canaries are guessed "included" for the ``k+`` highest ``scores`` and "excluded" for
    the ``k-`` lowest; the rest abstain. Each pair ``(k+, k-)`` of ``splits`` (default:
    8 geometric totals from m/100 to m, half "in" and half "out") is tested at level
    ``(1 - confidence) / len(splits)`` (a union bound over the search), and the largest
    epsilon rejected by any of them is returned. ``included`` are the canaries' true
    coins, each drawn independently with probability 1/2 and independent of the order of
    the canaries (ties in scores are broken by that order).
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape:
        raise ValueError(f"scores and included must be 1-d and of the same length, got shapes "
                         f"{scores.shape} and {included.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores must be finite")
    confidence = _checks.open_unit("confidence", confidence)
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    m = len(scores)
    splits = list(_guess_splits(m) if splits is None else splits)
    for k_in, k_out in splits:
        if k_in < 0 or k_out < 0 or k_in + k_out > m or k_in + k_out == 0:
            raise ValueError(f"a split (guesses in, guesses out) = ({k_in}, {k_out}) needs 0 < k_in + k_out <= {m}")
    best = GuessingBound(0.0, 0, 0, 0, len(splits))
    if m == 0:
        return best
    order = np.argsort(-scores, kind="stable")
    right_in = np.concatenate([[0], np.cumsum(included[order])])           # right among the top k
    right_out = np.concatenate([[0], np.cumsum(~included[order[::-1]])])   # right among the bottom k
    level = (1 - confidence) / len(splits)
    for k_in, k_out in splits:
        correct = int(right_in[k_in] + right_out[k_out])
        eps = _largest_rejected_epsilon(m, k_in + k_out, correct, delta, level)
        if eps > best.epsilon:
            best = GuessingBound(eps, k_in, k_out, correct, len(splits))
    return best


def subsampled_gaussian_scores(
    observations: np.ndarray, *, contribution: float, noise_std: float, sample_rate: float
) -> np.ndarray:
    """Per-canary log-likelihood ratio of "included" vs "excluded", summed over steps.

    ``observations[t, i]`` is the noisy gradient sum on canary ``i``'s coordinate after
    step ``t``: ``N(0, s^2)`` if the canary is out, and ``mu + N(0, s^2)`` with probability
    ``q`` (else ``N(0, s^2)``) if it is in, with ``mu = contribution``, ``s = noise_std``,
    ``q = sample_rate``. The score is ``sum_t log((1 - q) + q exp((2 x mu - mu^2) / (2 s^2)))``:
    the Neyman-Pearson statistic for one canary, which does not know when it was sampled.
    """
    x = np.asarray(observations, dtype=np.float64)
    if not (contribution > 0 and noise_std > 0 and 0 < sample_rate <= 1):
        raise ValueError(f"need contribution > 0, noise_std > 0 and sample_rate in (0, 1], got {contribution}, "
                         f"{noise_std}, {sample_rate}")
    shift = np.log(sample_rate) + (2 * x * contribution - contribution**2) / (2 * noise_std**2)
    if sample_rate == 1:
        return shift.sum(0)
    return np.logaddexp(math.log1p(-sample_rate), shift).sum(0)


def banded_scores(observations: np.ndarray, coefficients, groups: np.ndarray, *, contribution: float,
                  noise_std: float, sample_rate: float) -> np.ndarray:
    """Per-canary log-likelihood ratios for banded correlated noise with cyclic Poisson sampling.

    ``observations[t, i]`` is ``x[t, i] + noise_std (C^{-1} z)[t, i]`` for the b-banded Toeplitz ``C`` of
    ``coefficients`` (unit norm). The auditor applies ``C`` (post-processing): ``C y = C x + noise_std z``, white.
    Canary ``i`` can only be sampled at the steps ``s`` of its group, ``s mod b = groups[i]``, each time with
    probability ``q``, adding ``contribution * c`` to rows ``s .. s + b - 1`` of ``C x``: those blocks are disjoint
    for one canary, so its participations are independent observations. The projection of block ``s`` on ``c``
    (its rows before the end of the run) is ``N(0, s^2)`` or, if sampled, ``N(mu_s, s^2)`` with
    ``mu_s = contribution * ||c_kept||``: the subsampled Gaussian's ratio, summed over the canary's steps.
    """
    y = np.asarray(observations, dtype=np.float64)
    c = np.asarray(coefficients, dtype=np.float64)
    steps, bands = y.shape[0], len(c)
    column = np.zeros(steps)
    column[: min(bands, steps)] = c[:steps]
    whitened = np.zeros_like(y)
    for lag in range(min(bands, steps)):  # C y: lower-triangular Toeplitz, c_lag on the lag-th subdiagonal
        whitened[lag:] += column[lag] * y[: steps - lag]
    scores = np.zeros(y.shape[1])
    for start in range(steps):
        kept = c[: min(bands, steps - start)]
        norm = float(np.linalg.norm(kept))
        projection = kept @ whitened[start: start + len(kept)] / norm
        terms = subsampled_gaussian_scores(projection[None, :], contribution=contribution * norm,
                                           noise_std=noise_std, sample_rate=sample_rate)
        scores += np.where(groups == start % bands, terms, 0.0)
    return scores
