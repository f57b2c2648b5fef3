"""Is the sampling that happens the sampling the accountant assumes? A test of the samples counted at each step.

The accountant's epsilon assumes Poisson sampling with rate ``q = batch_size / sample_size``: every unit
(example, or user) is in a step's batch independently with probability q, so the number of units of a step
is ``Binomial(sample_size, q)`` — ``min(Binomial, K)`` with fixed-shape batches of ``max_batch_size=K`` —
independently from step to step. The engine counts the units of every step (``SamplesPerStep``) and tests
that hypothesis every ``CHECK_EVERY`` steps, over windows of the last 10, 20, 40, ..., 1280 steps:

* **the mean**: the window's total far above (or below) what Poisson sampling gives — a loader with another
  batch size than the engine's, micro-batches accumulated per step with the micro-batch size given as
  ``batch_size``, a step after every micro-batch;
* **the variance**: the squared differences of consecutive steps' counts, ``(B_2t - B_2t+1)^2``, whose mean
  is ``2 B (1 - q)`` under Poisson sampling, far below it — fixed-size batches (a shuffling ``DataLoader``),
  whatever their size.

Each test rejects only where the Chernoff bound of its tail under the hypothesis, computed from the exact
distribution of one step's count (``step_count_distribution``), is at most ``ALPHA = 1e-9`` — a Gaussian's
tail at 6 standard deviations, but rigorous for any batch size, small ones included. An honest run's
probability of any false warning is therefore at most ``3 x len(WINDOWS) x ALPHA`` per check, 2.4e-9 per
step: 0.24 % over a million steps.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 1e-9  # the tail probability of a standard Gaussian beyond 6.0 standard deviations is 9.9e-10
WINDOWS = (10, 20, 40, 80, 160, 320, 640, 1280)
CHECK_EVERY = 10


class SamplingMismatch(RuntimeError):
    """``budget="strict"``: the batches are not the Poisson samples the accountant's epsilon assumes."""


def _logsumexp(a: np.ndarray) -> float:
    top = float(a.max())
    return top + math.log(float(np.exp(a - top).sum()))


def step_count_distribution(sample_size: int, sample_rate: float,
                            max_batch_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, log_probabilities)``: the distribution of one step's count under Poisson sampling,
    ``Binomial(sample_size, sample_rate)`` (truncated at ``max_batch_size``), on the counts within 40 standard
    deviations + 200 of the mode (the mass left out is below 1e-100: Bernstein's inequality)."""
    n, q = sample_size, sample_rate
    if q >= 1.0:
        counts, logp = np.array([float(n)]), np.array([0.0])
    else:
        mode = min(n, math.floor((n + 1) * q))
        spread = 40.0 * math.sqrt(n * q * (1.0 - q)) + 200.0
        low, high = max(0, math.floor(mode - spread)), min(n, math.ceil(mode + spread))
        log_mode = (math.lgamma(n + 1) - math.lgamma(mode + 1) - math.lgamma(n - mode + 1)
                    + mode * math.log(q) + (n - mode) * math.log1p(-q))
        log_odds = math.log(q) - math.log1p(-q)
        up = np.arange(mode, high, dtype=np.float64)  # log pmf(j + 1) - log pmf(j) = log((n - j) / (j + 1)) + log odds
        down = np.arange(mode - 1, low - 1, -1, dtype=np.float64)  # log pmf(j) - log pmf(j + 1)
        above = log_mode + np.cumsum(np.log(n - up) - np.log(up + 1) + log_odds)
        below = log_mode + np.cumsum(np.log(down + 1) - np.log(n - down) - log_odds)
        counts = np.arange(low, high + 1, dtype=np.float64)
        logp = np.concatenate([below[::-1], [log_mode], above])
    if max_batch_size is not None and counts[-1] >= max_batch_size:
        kept = counts < max_batch_size
        lumped = _logsumexp(logp[~kept])  # a draw of K or more keeps K
        counts = np.append(counts[kept], float(max_batch_size))
        logp = np.append(logp[kept], lumped)
    logp = logp - _logsumexp(logp)
    return counts, logp


def _difference_distribution(counts: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distribution of ``B1 - B2`` for two independent counts (values, probabilities).

    ``counts`` are consecutive integers (a truncated count is the last one), so the differences are too: the
    probabilities are a convolution. Tails below 1e-40 of the mode are left out (a squared difference's lower
    tail, the one tested, does not feel them) and FFT rounding is clipped at 0.
    """
    p = np.exp(logp)
    keep = p > 1e-40 * p.max()  # (a contiguous range: the distribution is unimodal)
    p = p[keep]
    if len(p) <= 4096:
        diff = np.convolve(p, p[::-1])
    else:
        size = 1 << (2 * len(p) - 1).bit_length()
        diff = np.fft.irfft(np.fft.rfft(p, size) * np.fft.rfft(p[::-1], size), size)[: 2 * len(p) - 1]
    values = np.arange(-(len(p) - 1), len(p), dtype=np.float64)
    diff = np.clip(diff, 0.0, None)
    return values, diff / diff.sum()


def chernoff_threshold(values: np.ndarray, probabilities: np.ndarray, terms: int, alpha: float,
                       upper: bool) -> float | None:
    """A threshold ``t`` with ``P[sum of `terms` independent draws >= t] <= alpha`` (``upper``), or ``<= t``
    (lower): ``terms * a(lambda)`` where the tilted mean ``a`` and the rate ``lambda a - log M(lambda)`` reach
    ``log(1/alpha) / terms`` (Chernoff: the probability is at most ``exp(-terms * rate)``). None when no sum can
    be that unlikely (the rate stays below it even at the extreme value)."""
    keep = probabilities > 0.0
    values, probabilities = values[keep], probabilities[keep]
    logp = np.log(probabilities)
    target = math.log(1.0 / alpha) / terms
    spread = math.sqrt(max(float((probabilities * (values - (probabilities * values).sum()) ** 2).sum()), 1e-12))
    sign = 1.0 if upper else -1.0

    def tilted(lam: float) -> tuple[float, float]:
        w = logp + sign * lam * values
        log_m = _logsumexp(w)
        a = float((np.exp(w - log_m) * values).sum())
        return a, sign * lam * a - log_m

    low, high = 0.0, 1.0 / spread
    while tilted(high)[1] < target:
        low, high = high, 2.0 * high
        if high > 1e6 / spread:
            return None  # even the most extreme sum is not that unlikely
    for _ in range(100):
        middle = 0.5 * (low + high)
        if tilted(middle)[1] < target:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return terms * tilted(high)[0]  # the rate at `high` reaches the target: the bound holds


@dataclass(frozen=True)
class Finding:
    """A window of steps whose counts Poisson sampling explains with probability below ``ALPHA``."""

    kind: str  # "mean-high", "mean-low", "variance-low" or "rows-beyond-max-batch-size"
    steps: int  # the window
    mean: float  # the window's mean count per step
    variance: float  # estimated from consecutive steps' differences
    expected_mean: float
    expected_variance: float

    @property
    def understates_epsilon(self) -> bool:
        """Larger batches than accounted, or not sampled independently: the reported epsilon is too small."""
        return self.kind != "mean-low"


class PoissonTest:
    """The tests of the module docstring for one configuration; thresholds per window, computed once."""

    def __init__(self, sample_size: int, sample_rate: float, max_batch_size: int | None = None,
                 alpha: float = ALPHA):
        self.sample_size, self.sample_rate, self.max_batch_size, self.alpha = (
            sample_size, sample_rate, max_batch_size, alpha)
        self.counts, self._logp = step_count_distribution(sample_size, sample_rate, max_batch_size)
        self.probabilities = np.exp(self._logp)
        self.mean = float((self.probabilities * self.counts).sum())
        self.variance = float((self.probabilities * (self.counts - self.mean) ** 2).sum())
        self._differences: tuple[np.ndarray, np.ndarray] | None = None
        self._thresholds: dict[int, tuple[float | None, float | None, float | None]] = {}

    def thresholds(self, window: int) -> tuple[float | None, float | None, float | None]:
        """(highest total, lowest total, lowest sum of squared differences) that Poisson sampling explains."""
        if window not in self._thresholds:
            if self._differences is None:
                values, probabilities = _difference_distribution(self.counts, self._logp)
                self._differences = (values**2, probabilities)
            squares, probabilities = self._differences
            merged, inverse = np.unique(squares, return_inverse=True)
            square_probabilities = np.bincount(inverse, weights=probabilities)
            self._thresholds[window] = (
                chernoff_threshold(self.counts, self.probabilities, window, self.alpha, upper=True),
                chernoff_threshold(self.counts, self.probabilities, window, self.alpha, upper=False),
                chernoff_threshold(merged, square_probabilities, window // 2, self.alpha, upper=False),
            )
        return self._thresholds[window]

    def verdict(self, counts: Sequence[float] | np.ndarray, low_mean: bool = True) -> Finding | None:
        """What Poisson sampling does not explain in the last steps' ``counts``: first a window (the shortest)
        whose batches are larger or vary less than Poisson sampling's (epsilon understated), else (``low_mean``)
        one whose batches are smaller."""
        values = np.asarray(counts, dtype=np.float64)
        findings = []
        for window in WINDOWS:
            if window > len(values):
                break
            recent = values[len(values) - window:]
            high, low, low_squares = self.thresholds(window)
            total = float(recent.sum())
            squares = float(np.square(recent[0::2] - recent[1::2]).sum())
            for kind, found in (("mean-high", high is not None and total >= high),
                                ("variance-low", low_squares is not None and squares <= low_squares),
                                ("mean-low", low_mean and low is not None and total <= low)):
                if found:
                    findings.append(Finding(kind, window, total / window, squares / window, self.mean, self.variance))
        findings.sort(key=lambda f: not f.understates_epsilon)  # (stable: the shortest window first)
        return findings[0] if findings else None


class SamplesPerStep:
    """The units each step received, tested against Poisson sampling at the accounted rate (``PoissonTest``).

    Fed by the engine with each completed backward's number of samples (``add_backward``, a Python int: no
    host-device synchronisation; users with ``privacy_unit="user"``), with the real number of a fixed-shape
    batch's samples where the engine sees its mask (``real_count``), and with each step (``end_step``), which
    tests every ``CHECK_EVERY`` steps and returns the first ``Finding``.

    ``ranks``: processes among which a step's samples are split, each counting its own; ``end_step(total=...)``
    sums the ranks' counts (one collective every ``CHECK_EVERY`` steps), so every rank reaches the same verdict.
    ``max_batch_size``: fixed-shape batches of K rows. Without their masks the engine counts K rows per batch,
    padding included, and cannot test the sampling: such steps are only checked to hold at most K rows per
    rank (more means several batches per step).
    """

    def __init__(self, batch_size: int, sample_rate: float, *, max_batch_size: int | None = None, ranks: int = 1,
                 sample_size: int | None = None):
        self.batch_size, self.sample_rate, self.max_batch_size, self.ranks = (
            batch_size, sample_rate, max_batch_size, ranks)
        self.sample_size = sample_size if sample_size is not None else round(batch_size / sample_rate)
        self._test: PoissonTest | None = None
        self._rows, self._real, self._known = 0, 0, True  # this step's
        self._override: int | None = None
        self._local: list[tuple[int, int, bool]] = []  # (rows, real, known) of the steps since the last check
        self._counts: collections.deque[float] = collections.deque(maxlen=WINDOWS[-1])  # nan: not known
        self._steps = 0
        self.finding: Finding | None = None  # the first finding that epsilon is understated: the tests stop
        self._low_found = False  # batches smaller than accounted were reported (once)

    @property
    def warned(self) -> bool:
        return self.finding is not None or self._low_found

    @property
    def test(self) -> PoissonTest:
        if self._test is None:
            self._test = PoissonTest(self.sample_size, self.sample_rate, self.max_batch_size)
        return self._test

    def real_count(self, count: int | None):
        """A context for one backward whose ``count`` samples are real (a fixed-shape batch's mask), not its rows."""
        return _RealCount(self, count)

    def add_backward(self, samples: int) -> None:
        """A backward of ``samples`` samples (rows, or users) completed: its clipped sums joined the step's."""
        self._rows += samples
        if self._override is not None:
            self._real += self._override
        else:
            self._real += samples
            self._known = self._known and self.max_batch_size is None

    def discard_step(self) -> None:
        """The backwards so far in this step were discarded (``zero_grad()``), or the step was refused."""
        self._rows, self._real, self._known = 0, 0, True

    def end_step(self, total: Callable[[list[float]], list[float]] | None = None) -> Finding | None:
        """The step was taken. Every ``CHECK_EVERY`` steps the test runs (``total``: sums values over the ranks,
        the same on every rank) and returns its finding; after the first, no more tests (nor collectives)."""
        self._local.append((self._rows, self._real, self._known))
        self.discard_step()
        self._steps += 1
        if self._steps % CHECK_EVERY or self.finding is not None:
            return None
        local, self._local = self._local, []
        values = [float(v) for rows, real, known in local for v in (rows, real, not known)]
        if total is not None:
            values = total(values)
        found = None
        for k in range(0, len(values), 3):
            rows, real, unknown = values[k:k + 3]
            self._counts.append(math.nan if unknown else real)
            if (unknown and found is None and self.max_batch_size is not None  # (a count is unknown only with K)
                    and rows > self.max_batch_size * self.ranks):
                # K rows per batch and rank, padding included: more is certainly several batches per step
                found = Finding("rows-beyond-max-batch-size", 1, rows, math.nan, self.max_batch_size * self.ranks,
                                math.nan)
        if found is None:
            known = _known_tail(self._counts)
            found = self.test.verdict(known, low_mean=not self._low_found) if len(known) >= WINDOWS[0] else None
        if found is not None:
            if found.understates_epsilon:
                self.finding = found
            else:
                self._low_found = True
        return found


def _known_tail(counts: collections.deque[float]) -> np.ndarray:
    """The last counts up to the most recent unknown one (nan)."""
    values = np.fromiter(counts, dtype=np.float64, count=len(counts))
    unknown = np.flatnonzero(np.isnan(values))
    return values[unknown[-1] + 1:] if len(unknown) else values


class _RealCount:
    def __init__(self, counter: SamplesPerStep, count: int | None):
        self.counter, self.count = counter, count

    def __enter__(self):
        self.counter._override = self.count

    def __exit__(self, *exc):
        self.counter._override = None


def describe(finding: Finding, batch_size: int, sample_size: int, unit: str = "example") -> str:
    """The warning (or, with ``budget="strict"``, the error) for a finding: both numbers and the fix."""
    units = "users" if unit == "user" else "samples"
    f = finding
    accounted = (f"Poisson sampling at the accounted rate q = batch_size / sample_size = {batch_size}/{sample_size} "
                 f"gives {f.expected_mean:.1f} ± {math.sqrt(f.expected_variance):.1f}")
    fix = (f"draw the batches with dptrain.data.poisson_loader(dataset, batch_size={batch_size}) and pass the "
           "loader to engine.attach(optimizer, data_loader=loader), which checks its rate")
    if f.kind == "mean-high":
        return (f"the last {f.steps} steps received {f.mean:.1f} {units} per step on average, but {accounted}: the "
                f"accounted q is about {f.mean / f.expected_mean:.2f}x too small and epsilon is understated. Likely "
                f"causes: a loader with a larger batch size than batch_size={batch_size} (a new loader), or the "
                "micro-batch size given as batch_size while several micro-batches are accumulated per optimizer "
                f"step. Fix: give batch_size as the expected number of {units} per optimizer.step(), and {fix}")
    if f.kind == "mean-low":
        return (f"the last {f.steps} steps received {f.mean:.1f} {units} per step on average, but {accounted}: each "
                f"step is divided by batch_size={batch_size} and the accounted q is about "
                f"{f.expected_mean / max(f.mean, 1e-9):.2f}x larger than the batches drawn. Likely causes: "
                "optimizer.step() after every micro-batch of a logical batch, or a loader whose batches are smaller "
                f"than batch_size. Fix: give batch_size as the expected number of {units} per optimizer.step(), and {fix}")
    if f.kind == "variance-low":
        return (f"the batch sizes of the last {f.steps} steps vary far less than Poisson sampling's: their variance "
                f"is {f.variance:.3g} (from consecutive steps' differences; mean {f.mean:.1f} per step), where "
                f"{accounted}, variance B(1 - q) = {f.expected_variance:.3g}. Fixed-size batches (an ordinary "
                "shuffling DataLoader) are not Poisson samples, and the accountant's epsilon assumes Poisson sampling: "
                f"it does not hold for them. Fix: {fix}")
    return (f"a step received {f.mean:.0f} rows, more than max_batch_size={f.expected_mean:.0f} rows per process: "
            "several fixed-shape batches were back-propagated into one optimizer step, so q = batch_size / "
            "sample_size understates the sampling. Fix: one fixed-shape batch per optimizer.step() (cut it with "
            "dptrain.data.split_batches if it does not fit), or give batch_size as the expected number of samples "
            "per step")
