"""Privacy accounting for DP-SGD with Poisson sampling, and noise calibration.

A training run is a sequence of steps of the Poisson-subsampled Gaussian mechanism:
each step includes every example independently with probability ``q`` (the sample
rate) and adds Gaussian noise of standard deviation ``sigma * C`` to the sum of the
clipped gradients (``sigma`` is the noise multiplier).  An :class:`Accountant` records
these steps as a compact history ``[(sigma, q, count), ...]`` and turns it into an
``(epsilon, delta)`` guarantee under the add/remove-one neighbouring relation (the
relation that Poisson sampling is analysed under).

Accountants (``ACCOUNTANTS``):

``"pld"`` (default)
    Privacy loss distributions (Google's ``dp_accounting.pld``): numerically tight,
    pessimistic (always a valid upper bound).
``"rdp"``
    Rényi DP (``dp_accounting.rdp``) with dp_accounting's tight RDP-to-(ε, δ)
    conversion: a valid upper bound, typically 5-15 % above PLD.
``"gdp"``
    Gaussian DP via the central limit theorem (Bu, Dong, Long & Su 2020). A fast
    *approximation*, not a guarantee: it can under-estimate epsilon for few steps or
    a large sample rate, and warns once per accountant object.

Both ``"pld"`` and ``"rdp"`` are built on ``dp_accounting`` events: the history is
``ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)),
count), ...])``.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import checks

if TYPE_CHECKING:
    import dp_accounting


__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_ACCOUNTANT",
    "MAX_NOISE_MULTIPLIER",
    "Accountant",
    "GDPApproximationWarning",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "create_accountant",
    "default_delta",
    "default_max_batch_size",
    "epsilon_of_history",
    "poisson_delta",
    "small_delta_problem",
    "truncation_delta",
]

ACCOUNTANTS = ("rdp", "pld", "gdp")
DEFAULT_ACCOUNTANT = "pld"

# Calibration refuses targets that would need more noise than this: such a run would
# learn nothing, and the request is almost always a mistake in epsilon, q or steps.
MAX_NOISE_MULTIPLIER = 1e4

# RDP orders: dp_accounting's defaults (1.1 ... 1024). Orders above 1024 only help when
# epsilon is tiny (roughly < 0.02: large noise, small q), so they are added only then;
# they cost ~0.15 s, more than all the others together.
# (RDP_ORDERS is read from dp_accounting on first use: see __getattr__ at the end.)
LARGE_RDP_ORDERS = (2048, 4096, 8192, 16384)
_LARGE_ORDERS_BELOW_EPSILON = 0.1
# Integer orders give a slightly looser but much cheaper bound (fractional orders are
# slow for large q); PLD only uses it to size its grid.
_PLD_SCALE_ORDERS = tuple(range(2, 33)) + (40, 48, 56, 64, 128, 256, 512, 1024)

# PLD grid spacing. Any spacing gives a valid (pessimistic) upper bound; the spacing
# only trades tightness for time and memory. A fixed spacing is either far too coarse
# for small epsilons (1e-3 reports 10x the true epsilon near eps = 3e-4) or needlessly
# slow for large or short runs. Measured on dp_accounting 0.6: the excess over a fine
# grid is ~0.1 % at spacing = 1e-2 * epsilon for short runs, and grows like
# total_steps * spacing^2 for long ones. So the spacing is the largest power of two
# below
#     min(2e-3 * eps_rdp, sqrt(1e-3 * eps_rdp / total_steps))
# where eps_rdp >= epsilon is an RDP upper bound (up to ~3x the PLD epsilon): the PLD
# result is then within ~0.1 % of a fine grid (0.02 % for the MNIST setting) at
# ~0.02-0.4 s per evaluation. Powers of two keep the grid identical for nearby
# histories, so results do not jitter from one step to the next.
PLD_RELATIVE_SPACING = 2e-3
PLD_EXCESS_BUDGET = 1e-3

# One history entry: (noise_multiplier, sample_rate, number_of_steps).
HistoryEntry = tuple[float, float, int]


class GDPApproximationWarning(UserWarning):
    """GDP accounting is a central-limit-theorem approximation, not a DP guarantee."""


_GDP_WARNING = (
    "The 'gdp' accountant uses a central-limit-theorem approximation (Bu, Dong, Long & "
    "Su 2020); it is not a rigorous bound and can under-estimate epsilon when the "
    "number of steps is small or the sample rate is large. Use accountant='pld' "
    "(the default) or 'rdp' for a guaranteed upper bound."
)


# ----------------------------------------------------------------------------- checks


def _check_accountant_name(name: Any) -> str:
    return checks.choice("accountant", name, ACCOUNTANTS)


def _check_noise_multiplier(noise_multiplier: Any) -> float:
    return checks.non_negative("noise_multiplier", noise_multiplier, "0 means no noise, i.e. infinite epsilon")


def _check_count(value: Any, what: str, minimum: int) -> int:
    # 10.0 is taken (from epochs * steps_per_epoch arithmetic), 10.5 is not
    return checks.integer(what, value, minimum, integral_floats=True)


def _check_max_batch_size(value: Any) -> int:
    return checks.positive_int("max_batch_size", value, "the fixed number of rows of every batch, K")


def _check_delta(delta: Any) -> float:
    return checks.open_unit("delta", delta, "a common choice is default_delta(len(dataset)) = 1 / (10 * len(dataset))")


def small_delta_problem(delta: float, sample_size: int, unit: str = "example") -> str | None:
    """What is wrong with ``delta`` for a dataset of ``sample_size`` units, or None when it is below ``1 / sample_size``.

    A mechanism that publishes one randomly chosen record in full (the "name and shame" release) is
    ``(0, 1/n)``-DP, so a guarantee at ``delta >= 1/n`` allows exactly that.
    """
    if delta < 1.0 / sample_size:
        return None
    return (f"delta={delta:.3g} is at least 1/sample_size = 1/{sample_size}: at such a delta, publishing one "
            f"randomly chosen {unit} in full (\"name and shame\") meets the guarantee. Use a delta well below "
            f"1/sample_size, e.g. default_delta(sample_size) = {default_delta(sample_size):.3g}")


def default_delta(sample_size: int) -> float:
    """The default target delta, ``1 / (10 * sample_size)``.

    A meaningful delta must be well below ``1 / sample_size``: a mechanism that
    publishes one random record outright is (0, 1/n)-DP.
    """
    n = checks.integer("sample_size", sample_size, 1, "the number of training examples", integral_floats=True)
    return 1.0 / (10.0 * n)


# ------------------------------------------------------------------ epsilon backends


def _dp_accounting():
    """dp_accounting with its pld and rdp modules, imported on first use: it pulls in scipy
    (about 0.7 s), which a planning call, a non-private run or the CLI's --help never need."""
    import dp_accounting
    import dp_accounting.pld  # noqa: F401  (attributes of the package once imported)
    import dp_accounting.rdp  # noqa: F401

    return dp_accounting


def _rdp_orders() -> tuple[float, ...]:
    return tuple(_dp_accounting().rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def _dp_event(history: Sequence[HistoryEntry]) -> dp_accounting.DpEvent:
    dp_accounting = _dp_accounting()
    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count
        )
        for sigma, q, count in history
    ]
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)


def _rdp_epsilon_for_orders(
    history: Sequence[HistoryEntry], delta: float, orders: Sequence[float]
) -> float:
    dp_rdp = _dp_accounting().rdp
    accountant = dp_rdp.RdpAccountant(orders=list(orders))
    accountant.compose(_dp_event(history))
    epsilon = float(accountant.get_epsilon(delta))
    if epsilon < _LARGE_ORDERS_BELOW_EPSILON:
        # Both are valid upper bounds, so the smaller one is too.
        accountant = dp_rdp.RdpAccountant(orders=list(LARGE_RDP_ORDERS))
        accountant.compose(_dp_event(history))
        epsilon = min(epsilon, float(accountant.get_epsilon(delta)))
    return epsilon


def _rdp_epsilon(history: Sequence[HistoryEntry], delta: float) -> float:
    return _rdp_epsilon_for_orders(history, delta, _rdp_orders())


def pld_value_discretization(epsilon_upper_bound: float, total_steps: int) -> float:
    """PLD grid spacing for a run (see PLD_RELATIVE_SPACING)."""
    spacing = min(
        PLD_RELATIVE_SPACING * epsilon_upper_bound,
        math.sqrt(PLD_EXCESS_BUDGET * epsilon_upper_bound / total_steps),
    )
    return 2.0 ** math.floor(math.log2(spacing))


def _pld_epsilon(history: Sequence[HistoryEntry], delta: float) -> float:
    if any(sigma == 0.0 for sigma, _, _ in history):
        return math.inf
    # The RDP bound is a rigorous upper bound, so the grid it sets is never finer than
    # intended (a too-fine grid can exhaust memory for small noise multipliers).
    epsilon_upper_bound = _rdp_epsilon_for_orders(history, delta, _PLD_SCALE_ORDERS)
    if not math.isfinite(epsilon_upper_bound):
        return math.inf  # only for absurdly small sigma; infinity is still a valid bound
    if epsilon_upper_bound == 0.0:
        return 0.0
    total_steps = sum(count for _, _, count in history)
    accountant = _dp_accounting().pld.PLDAccountant(
        value_discretization_interval=pld_value_discretization(epsilon_upper_bound, total_steps)
    )
    accountant.compose(_dp_event(history))
    return float(accountant.get_epsilon(delta))


def _log_gaussian_tail(x: float) -> float:
    """log Phi(-x) = log P(N(0,1) > x), accurate far into the tail."""
    if x < 30.0:
        return math.log(0.5 * math.erfc(x / math.sqrt(2.0)))
    # erfc underflows near x = 38; the asymptotic series is accurate to ~1e-12 here.
    inv_x2 = 1.0 / (x * x)
    series = 1.0 - inv_x2 * (1.0 - 3.0 * inv_x2 * (1.0 - 5.0 * inv_x2 * (1.0 - 7.0 * inv_x2)))
    return -0.5 * x * x - math.log(x) - 0.5 * math.log(2.0 * math.pi) + math.log(series)


def gdp_mu(history: Sequence[HistoryEntry]) -> float:
    """CLT mu of a history: sqrt(sum_i q_i^2 * T_i * (exp(1 / sigma_i^2) - 1))."""
    total = 0.0
    for sigma, q, count in history:
        if sigma == 0.0:
            return math.inf
        try:
            total += q * q * count * math.expm1(1.0 / (sigma * sigma))
        except OverflowError:
            return math.inf
    return math.sqrt(total)


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(eps) of mu-GDP: Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2)."""
    a = epsilon / mu - mu / 2.0
    b = epsilon / mu + mu / 2.0
    # Log space: exp(eps) overflows long before the product does.
    return math.exp(_log_gaussian_tail(a)) - math.exp(epsilon + _log_gaussian_tail(b))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon with delta_mu(epsilon) <= delta, by bisection (rounded up)."""
    if mu == 0.0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gdp_delta(mu, high) > delta:  # delta(eps) decreases to 0, so this ends
        low, high = high, 2.0 * high
    for _ in range(200):
        if high - low <= 1e-12 * high:
            break
        middle = 0.5 * (low + high)
        if gdp_delta(mu, middle) > delta:
            low = middle
        else:
            high = middle
    return high  # delta(high) <= delta: the conservative end of the bracket


def _gdp_epsilon(history: Sequence[HistoryEntry], delta: float) -> float:
    return gdp_epsilon(gdp_mu(history), delta)


_EPSILON_BACKENDS: dict[str, Callable[[Sequence[HistoryEntry], float], float]] = {
    "rdp": _rdp_epsilon,
    "pld": _pld_epsilon,
    "gdp": _gdp_epsilon,
}


def _epsilon(name: str, history: Sequence[HistoryEntry], delta: float) -> float:
    history = [entry for entry in history if entry[2] > 0]
    if not history:
        return 0.0
    return _EPSILON_BACKENDS[name](history, delta)


def epsilon_of_history(history: Sequence[HistoryEntry], delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Epsilon of the composition of ``history``, ``[(noise_multiplier, sample_rate, steps), ...]``, at ``delta``:
    the steps of a run whose noise or sample rate changed (a resumed run, a schedule). No warning for ``"gdp"``."""
    name = _check_accountant_name(accountant)
    entries = [(_check_noise_multiplier(sigma), checks.sample_rate(q), _check_count(count, "steps", 0))
               for sigma, q, count in history]
    return _epsilon(name, entries, _check_delta(delta))


# ----------------------------------------------------------------------- accountant


class Accountant:
    """Records the DP-SGD steps of one training run and reports their epsilon.

    Call :meth:`step` once per optimizer step (or once with ``num_steps`` for many).
    Consecutive steps with the same ``(noise_multiplier, sample_rate)`` are merged, so
    the history stays short and :meth:`get_epsilon` costs the same after 10 or 10^6
    steps (well under a second for ``"pld"``). Use :func:`create_accountant`.
    """

    def __init__(self, name: str = DEFAULT_ACCOUNTANT):
        self.name = _check_accountant_name(name)
        self._history: list[list] = []  # [sigma, q, count]; lists so counts can grow
        self._warned_gdp = False
        self._cache: tuple[tuple, float, float] | None = None  # (history, delta, eps)

    def __repr__(self) -> str:
        return f"Accountant(name={self.name!r}, steps={self.steps}, history={self.history})"

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps with noise multiplier sigma and sample rate q."""
        sigma = _check_noise_multiplier(noise_multiplier)
        q = checks.sample_rate(sample_rate)
        count = _check_count(num_steps, "num_steps", 1)
        if self._history and self._history[-1][0] == sigma and self._history[-1][1] == q:
            self._history[-1][2] += count
        else:
            self._history.append([sigma, q, count])

    @property
    def history(self) -> list[HistoryEntry]:
        """The recorded steps as ``[(noise_multiplier, sample_rate, count), ...]``."""
        return [(sigma, q, count) for sigma, q, count in self._history]

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(count for _, _, count in self._history)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of all recorded steps at ``delta`` (0.0 before the first step)."""
        delta = _check_delta(delta)
        if self.name == "gdp" and not self._warned_gdp:
            warnings.warn(_GDP_WARNING, GDPApproximationWarning, stacklevel=2)
            self._warned_gdp = True
        history = tuple(self.history)
        if self._cache is not None and self._cache[:2] == (history, delta):
            return self._cache[2]
        epsilon = _epsilon(self.name, history, delta)
        self._cache = (history, delta, epsilon)
        return epsilon

    def state_dict(self) -> dict:
        """Plain-python state (``name`` and ``history``), e.g. for ``torch.save``."""
        return {"name": self.name, "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with one saved by :meth:`state_dict`."""
        if not isinstance(state, dict) or "name" not in state or "history" not in state:
            raise ValueError(
                "Not an accountant state: expected a dict with keys 'name' and 'history' "
                "as returned by Accountant.state_dict()."
            )
        if "mechanism" in state:
            raise ValueError(
                "this state was saved by the accountant of a correlated-noise run (noise='bandmf' or 'blt'), whose "
                "epsilon is not DP-SGD's: resume it with the same noise (PrivacyEngine(..., noise=...))")
        if state["name"] != self.name:
            raise ValueError(
                f"This state was saved by the {state['name']!r} accountant and cannot be "
                f"loaded into the {self.name!r} accountant (their epsilons differ); load it "
                f"into create_accountant({state['name']!r})."
            )
        restored = Accountant(self.name)
        for entry in state["history"]:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(
                    f"Malformed history entry {entry!r}: expected "
                    "(noise_multiplier, sample_rate, count)."
                )
            restored.step(*entry)
        self._history = restored._history
        self._cache = None


def create_accountant(name: str = DEFAULT_ACCOUNTANT) -> Accountant:
    """A new, empty accountant: ``"pld"`` (default), ``"rdp"`` or ``"gdp"``."""
    return Accountant(name)


# ------------------------------------------------------------ fixed-shape batches
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
    n = checks.integer("sample_size", sample_size, 1, "the number of training examples", integral_floats=True)
    q = checks.sample_rate(sample_rate)
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
    n = checks.integer("sample_size", sample_size, 1, "the number of training examples", integral_floats=True)
    q = checks.sample_rate(sample_rate)
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


# ------------------------------------------------------------ one-shot computations


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
    q = checks.sample_rate(sample_rate)
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
    target = checks.positive("target_epsilon", target_epsilon)
    q = checks.sample_rate(sample_rate)
    steps = _check_count(steps, "steps", 1)
    delta = _fixed_shape_delta(_check_delta(target_delta), sample_size, q, max_batch_size, steps)
    if name == "gdp":
        warnings.warn(_GDP_WARNING, GDPApproximationWarning, stacklevel=2)
    prior = [(_check_noise_multiplier(s), checks.sample_rate(r), _check_count(c, "steps", 0)) for s, r, c in history]
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


def _fixed_shape_delta(delta: float, sample_size: Any, q: float, max_batch_size: Any, steps: int) -> float:
    if max_batch_size is None:
        return delta
    if sample_size is None:
        raise ValueError("max_batch_size needs sample_size (the dataset size N): the truncation term is "
                         "steps * P[Binomial(N, q) >= max_batch_size]")
    return poisson_delta(delta, sample_size, q, max_batch_size, steps)


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


def __getattr__(name: str):
    if name == "RDP_ORDERS":  # dp_accounting's defaults (1.1 ... 1024), without importing it at module load
        return _rdp_orders()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
