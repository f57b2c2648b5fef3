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

The parts, one concept per module (every name is imported from ``dptrain.accounting``):

* :mod:`~dptrain.accounting.accountants`: the argument checks, epsilon of a history under each accountant
  (RDP, PLD, GDP), :class:`Accountant` and :func:`create_accountant`.
* :mod:`~dptrain.accounting.fixed_shape`: the delta that truncating Poisson batches to ``max_batch_size`` rows
  adds (:func:`truncation_delta`, :func:`default_max_batch_size`, :func:`poisson_delta`).
* :mod:`~dptrain.accounting.calibration`: one-shot computations: :func:`compute_epsilon` and
  :func:`calibrate_noise_multiplier`.

It imports nothing of dptrain but ``_checks``: everything else that counts epsilon (the run's ledger, correlated
noise) builds on it.
"""

from __future__ import annotations

from .accountants import (  # noqa: F401  (all importable from dptrain.accounting, as before the split)
    _GDP_WARNING,
    _PLD_SCALE_ORDERS,
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    LARGE_RDP_ORDERS,
    PLD_EXCESS_BUDGET,
    PLD_RELATIVE_SPACING,
    Accountant,
    GDPApproximationWarning,
    HistoryEntry,
    _check_delta,
    _epsilon,
    _rdp_orders,
    create_accountant,
    default_delta,
    epsilon_of_history,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    pld_value_discretization,
    small_delta_problem,
)
from .calibration import (
    MAX_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from .fixed_shape import default_max_batch_size, poisson_delta, truncation_delta

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


def __getattr__(name: str):
    if name == "RDP_ORDERS":  # dp_accounting's defaults (1.1 ... 1024), without importing it at module load
        return _rdp_orders()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
