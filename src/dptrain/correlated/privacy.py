"""The privacy of correlated-noise mechanisms: what one run of ``T`` steps spends, and noise calibration.

Both mechanisms release ``C x + sigma R kappa z`` (``z`` standard Gaussian, ``kappa`` the largest column norm
of ``C`` over the planned ``n`` steps, so that ``sigma`` is the noise multiplier one participation sees, as in
DP-SGD and jax_privacy's ``BandMFConfig``); the optimizer sees ``x + sigma R kappa C^{-1} z``, post-processing.
Units are split into ``g`` cyclic groups (:mod:`dptrain.data.cyclic`): unit ``u`` can only be sampled at the steps
``t`` with ``t mod g = group(u)``, each time with probability ``q`` (Poisson, within its group).

``noise="bandmf"`` (amplified banded matrix factorization; Choquette-Choo et al. 2023b, Theorems 1, 4 and 5)
    ``C`` has ``b <= g`` bands, so the columns of a unit's steps, ``g >= b`` apart, touch disjoint rows of
    ``C x``: the run is the composition of ``ceil(T / g)`` Poisson-subsampled Gaussian mechanisms with rate
    ``q`` and noise multiplier ``sigma`` (each column has norm at most ``kappa``). dp_accounting's events:
    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), ceil(T / g))``, jax_privacy's
    ``amplified_bandmf_event``. With ``b = g = 1`` this is DP-SGD, exactly.
``noise="blt"`` (no amplification; Choquette-Choo et al. 2023a, multi-epoch; McMahan, Xu & Zhang 2024)
    ``C x`` is one Gaussian mechanism whose L2 sensitivity is that of ``C`` when a unit takes part at most
    ``ceil(T / g)`` times, ``g`` steps apart (``toeplitz.minsep_sensitivity_squared``, exact for the positive,
    non-increasing BLT columns); the Poisson coins only remove participations, which the bound covers, so
    they are not used: ``GaussianDpEvent(sigma kappa / sensitivity_T)``. Linear releases of adaptively chosen
    inputs through a lower-triangular ``C`` keep the Gaussian mechanism's guarantee (Denisov et al. 2022).

References and the derivations in full: docs/correlated-noise.md.

Both are add/remove-one guarantees, as dptrain's DP-SGD accounting, with the same accountants
(``accounting.ACCOUNTANTS``) on these events.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .. import _checks, accounting
from . import toeplitz
from .strategies import BandedToeplitz, BufferedToeplitz, Strategy, strategy_from_dict

__all__ = ["CORRELATED_NOISES", "CorrelatedAccountant", "CorrelatedMechanism"]

CORRELATED_NOISES = ("bandmf", "blt")


@dataclass(frozen=True)
class CorrelatedMechanism:
    """A strategy, the cyclic groups it is sampled with, and the run length it was built for.

    ``planned_steps`` (``n``) fixes ``kappa`` (:attr:`noise_scale`); a run may go longer (the banded recurrence and
    the BLT buffers are streaming), and epsilon then counts the steps taken.
    """

    noise: str
    strategy: Strategy
    cyclic_groups: int
    planned_steps: int

    def __post_init__(self):
        _checks.choice("noise", self.noise, CORRELATED_NOISES)
        expected = BandedToeplitz if self.noise == "bandmf" else BufferedToeplitz
        if not isinstance(self.strategy, expected):
            raise ValueError(f"noise={self.noise!r} takes a {expected.__name__} strategy, got "
                             f"{type(self.strategy).__name__}")
        _checks.positive_int("cyclic_groups", self.cyclic_groups)
        _checks.positive_int("planned_steps", self.planned_steps)
        if self.noise == "bandmf" and self.strategy.bands > self.cyclic_groups:
            raise ValueError(
                f"a {self.strategy.bands}-banded strategy is amplified only when a unit's steps are at least "
                f"{self.strategy.bands} apart: cyclic_groups must be >= bands, got cyclic_groups="
                f"{self.cyclic_groups} (sample with poisson_loader(..., cyclic_groups={self.strategy.bands}))")

    @property
    def noise_scale(self) -> float:
        """``kappa``: the noise of a step is ``sigma R kappa (C^{-1} z)_t``."""
        return self.strategy.max_column_norm(self.planned_steps)

    @property
    def buffers(self) -> int:
        """Model-sized buffers the streaming noise keeps."""
        return self.strategy.buffers

    def participations(self, steps: int) -> int:
        """The most steps of a run of ``steps`` in which one unit can be sampled: those of group 0."""
        return math.ceil(steps / self.cyclic_groups)

    def sensitivity(self, steps: int) -> float:
        """``sensitivity(C) / kappa`` for a run of ``steps`` steps, every participation at most ``g`` apart."""
        column = torch.as_tensor(self.strategy.column(steps), dtype=toeplitz.DTYPE)
        squared = toeplitz.minsep_sensitivity_squared(column, steps, self.cyclic_groups, self.participations(steps))
        return math.sqrt(float(squared)) / self.noise_scale

    def history(self, noise_multiplier: float, sample_rate: float, steps: int) -> list[accounting.HistoryEntry]:
        """The run as DP-SGD history entries ``(sigma, q, count)`` for dptrain's accountants (``accounting``)."""
        if steps == 0:
            return []
        if self.noise == "bandmf":
            return [(noise_multiplier, sample_rate, self.participations(steps))]
        return [(noise_multiplier / self.sensitivity(steps), 1.0, 1)]  # one Gaussian mechanism, no sampling

    def epsilon(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                accountant: str = accounting.DEFAULT_ACCOUNTANT) -> float:
        """Epsilon at ``delta`` after ``steps`` steps (``delta`` already net of any truncation term)."""
        return accounting._epsilon(accountant, self.history(noise_multiplier, sample_rate, steps), delta)

    def calibrate(self, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                  accountant: str = accounting.DEFAULT_ACCOUNTANT) -> float:
        """The smallest noise multiplier whose epsilon after ``steps`` steps is at most ``target_epsilon``
        (within 1 %, from below: ``accounting.calibrate_noise_multiplier`` on the mechanism's event)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", accounting.GDPApproximationWarning)  # warned once by the engine
            if self.noise == "bandmf":
                return accounting.calibrate_noise_multiplier(target_epsilon, delta, sample_rate,
                                                             self.participations(steps), accountant=accountant)
            per_sensitivity = accounting.calibrate_noise_multiplier(target_epsilon, delta, 1.0, 1,
                                                                    accountant=accountant)
        return per_sensitivity * self.sensitivity(steps)

    def as_dict(self) -> dict:
        return {"noise": self.noise, "strategy": self.strategy.as_dict(), "cyclic_groups": self.cyclic_groups,
                "planned_steps": self.planned_steps}

    @classmethod
    def from_dict(cls, state: dict) -> CorrelatedMechanism:
        return cls(state["noise"], strategy_from_dict(state["strategy"]), int(state["cyclic_groups"]),
                   int(state["planned_steps"]))


class CorrelatedAccountant(accounting.Accountant):
    """The engine's accountant for a correlated-noise run: records its steps as DP-SGD's does (``step(sigma, q)``
    once per step), and turns them into epsilon with the mechanism's own event (:meth:`CorrelatedMechanism.
    epsilon`). Its state names the mechanism, so that a checkpoint resumes only into the same one."""

    def __init__(self, name: str, mechanism: CorrelatedMechanism):
        super().__init__(name)
        self.mechanism = mechanism

    def __repr__(self) -> str:
        return f"CorrelatedAccountant(name={self.name!r}, noise={self.mechanism.noise!r}, steps={self.steps})"

    def get_epsilon(self, delta: float) -> float:
        delta = accounting._check_delta(delta)
        history = tuple(self.history)
        if len(history) > 1:
            raise ValueError(
                f"this {self.mechanism.noise} run recorded steps with different (noise_multiplier, sample_rate) "
                f"{[entry[:2] for entry in history]}: the correlated mechanism is analysed for one of each; resume "
                "a checkpoint with the noise multiplier and sample rate it was saved with")
        if self._cache is not None and self._cache[:2] == (history, delta):
            return self._cache[2]
        if self.name == "gdp" and not self._warned_gdp:
            warnings.warn(accounting._GDP_WARNING, accounting.GDPApproximationWarning, stacklevel=2)
            self._warned_gdp = True
        epsilon = self.mechanism.epsilon(*history[0], delta, self.name) if history else 0.0
        self._cache = (history, delta, epsilon)
        return epsilon

    def state_dict(self) -> dict:
        return {**super().state_dict(), "mechanism": self.mechanism.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("mechanism") if isinstance(state, dict) else None
        if saved is None:
            raise ValueError(
                f"this accountant state was saved by a run with independent Gaussian noise (DP-SGD); it cannot "
                f"be resumed with noise={self.mechanism.noise!r}: build the engine as the saved run was built")
        if CorrelatedMechanism.from_dict(saved) != self.mechanism:
            raise ValueError(
                f"this accountant state was saved by a run with the correlated mechanism {saved}, but this engine "
                f"runs {self.mechanism.as_dict()}: the privacy of the steps taken depends on the mechanism that took "
                "them. Build the engine with the saved noise, strategy, cyclic_groups and planned steps")
        super().load_state_dict({key: value for key, value in state.items() if key != "mechanism"})
