"""The accountants: the argument checks, epsilon of a history ``[(sigma, q, count), ...]`` of Poisson-subsampled
Gaussian steps under RDP, PLD (both through ``dp_accounting`` events) and GDP, and :class:`Accountant`, which
records a run's steps and reports their epsilon."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .. import _checks

if TYPE_CHECKING:
    import dp_accounting


ACCOUNTANTS = ("rdp", "pld", "gdp")
DEFAULT_ACCOUNTANT = "pld"

# RDP orders: dp_accounting's defaults (1.1 ... 1024). Orders above 1024 only help when
# epsilon is tiny (roughly < 0.02: large noise, small q), so they are added only then;
# they cost ~0.15 s, more than all the others together.
# (RDP_ORDERS is read from dp_accounting on first use: see __getattr__ in dptrain.accounting.)
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
    return _checks.choice("accountant", name, ACCOUNTANTS)


def _check_noise_multiplier(noise_multiplier: Any) -> float:
    return _checks.non_negative("noise_multiplier", noise_multiplier, "0 means no noise, i.e. infinite epsilon")


def _check_count(value: Any, what: str, minimum: int) -> int:
    # 10.0 is taken (from epochs * steps_per_epoch arithmetic), 10.5 is not
    return _checks.integer(what, value, minimum, integral_floats=True)


def _check_max_batch_size(value: Any) -> int:
    return _checks.positive_int("max_batch_size", value, "the fixed number of rows of every batch, K")


def _check_delta(delta: Any) -> float:
    return _checks.open_unit("delta", delta, "a common choice is default_delta(len(dataset)) = 1 / (10 * len(dataset))")


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
    n = _checks.integer("sample_size", sample_size, 1, "the number of training examples", integral_floats=True)
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
    entries = [(_check_noise_multiplier(sigma), _checks.sample_rate(q), _check_count(count, "steps", 0))
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
        q = _checks.sample_rate(sample_rate)
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
