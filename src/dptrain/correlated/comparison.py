"""Correlated noise against DP-SGD at the same epsilon: which leaves less expected error in the trajectory.

A strategy's expected error is ``sigma^2 * kappa^2 * error(A C^{-1})`` per ``R^2`` (the mean over the planned
steps of each step's squared error, ``strategies.strategy_loss``); DP-SGD's is ``sigma_dp^2 * error(A)``. The two
are compared at equal epsilon without a calibration: DP-SGD's noise multiplier of the same expected error,
``sigma_eq``, spends less epsilon than the correlated run exactly when DP-SGD at that epsilon leaves less error
(epsilon decreases in sigma). Two epsilon evaluations (under a second with PLD), so the engine checks every
correlated run it builds.

This is the measure ``bands="auto"`` minimizes (``resolve.choose_bands``). A BLT is not amplified by sampling: with
every unit able to take part at every step (no cyclic groups) its optimizer returns ``C`` close to the identity and
its noise multiplier is that of unsampled Gaussian steps, far above DP-SGD's (docs/correlated-noise.md, "When BLT
fits").
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from .. import accounting
from .privacy import CorrelatedMechanism
from .strategies import BandedToeplitz, strategy_loss

__all__ = ["CorrelatedNoiseWarning", "NoiseComparison", "compare_with_dp_sgd"]

DP_SGD = BandedToeplitz((1.0,))
# The engine's calibration spends between 99 % and 100 % of the target epsilon: DP-SGD's edge below this share of the
# run's epsilon is not one the engine could deliver, and is not warned about.
CALIBRATION_SLACK = 0.01


class CorrelatedNoiseWarning(UserWarning):
    """A correlated-noise run whose expected error is worse than DP-SGD's at the same epsilon."""


@dataclass(frozen=True)
class NoiseComparison:
    """A correlated run of ``steps`` steps and DP-SGD (Poisson sampling at ``inclusion_rate``), at the run's epsilon.

    ``expected_error``: the mean over the steps of the squared error of the trajectory, per ``R^2``;
    ``dp_sgd_epsilon_at_same_error``: what DP-SGD spends when its expected error equals this run's.
    """

    noise: str
    noise_multiplier: float
    steps: int
    epsilon: float
    expected_error: float
    dp_sgd_noise_multiplier_at_same_error: float
    dp_sgd_epsilon_at_same_error: float

    @property
    def worse_than_dp_sgd(self) -> bool:
        """DP-SGD reaches this run's expected error for less epsilon, so at this epsilon it leaves less error."""
        return self.dp_sgd_epsilon_at_same_error < self.epsilon


def compare_with_dp_sgd(mechanism: CorrelatedMechanism, noise_multiplier: float, *, inclusion_rate: float,
                        delta: float, accountant: str = accounting.DEFAULT_ACCOUNTANT,
                        workload_momentum: float = 0.0) -> NoiseComparison:
    """The mechanism's run of ``mechanism.planned_steps`` at ``noise_multiplier`` against DP-SGD at the same delta.

    ``inclusion_rate``: the chance that a unit is in a given step's batch, ``batch_size / sample_size`` (DP-SGD's
    Poisson rate); ``delta``: net of any truncation term of fixed-shape batches (the same for both: a unit is in a
    step's batch with the same probability).
    """
    steps = mechanism.planned_steps
    if noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be > 0 to compare epsilons, got {noise_multiplier}")
    loss = strategy_loss(mechanism.strategy, steps, momentum=workload_momentum)  # kappa^2 error(A C^-1)
    dp_sgd_loss = strategy_loss(DP_SGD, steps, momentum=workload_momentum)
    same_error = noise_multiplier * math.sqrt(loss / dp_sgd_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", accounting.GDPApproximationWarning)  # the engine warns once about gdp
        epsilon = mechanism.epsilon(noise_multiplier, inclusion_rate * mechanism.cyclic_groups, steps, delta,
                                    accountant)
        dp_sgd_epsilon = accounting.epsilon_of_history([(same_error, inclusion_rate, steps)], delta, accountant)
    return NoiseComparison(mechanism.noise, noise_multiplier, steps, epsilon, noise_multiplier**2 * loss,
                           same_error, dp_sgd_epsilon)


def warn_if_worse_than_dp_sgd(mechanism: CorrelatedMechanism, noise_multiplier: float, *, inclusion_rate: float,
                              delta: float, accountant: str, workload_momentum: float, bands_chosen: bool,
                              stacklevel: int) -> NoiseComparison | None:
    """Warn (:class:`CorrelatedNoiseWarning`) when DP-SGD leaves this run's expected error for less epsilon, by more
    than the engine's calibration wastes (``CALIBRATION_SLACK``); returns the comparison warned about, else None.
    Nothing to compare for DP-SGD itself (one band, one group) or without noise."""
    is_dp_sgd = mechanism.strategy == DP_SGD and mechanism.cyclic_groups == 1
    if is_dp_sgd or noise_multiplier == 0:
        return None
    found = compare_with_dp_sgd(mechanism, noise_multiplier, inclusion_rate=inclusion_rate, delta=delta,
                                accountant=accountant, workload_momentum=workload_momentum)
    if not found.dp_sgd_epsilon_at_same_error < (1 - CALIBRATION_SLACK) * found.epsilon:
        return None
    groups = mechanism.cyclic_groups
    if mechanism.noise == "blt":
        per_epoch = max(1, round(1 / inclusion_rate))
        participations = mechanism.participations(found.steps)
        fix = (f"A BLT is not amplified by sampling: here a unit can take part in {participations} of the steps, "
               f"{groups} apart. It fits runs where each unit takes part once or a few times: cyclic_groups close to "
               f"sample_size / batch_size = {per_epoch} (each unit about once per epoch) over one or a few epochs. "
               "Otherwise use noise='gaussian', or noise='bandmf' with bands='auto'")
    elif bands_chosen:
        fix = ("bands='auto' ranks the bands with RDP's calibration; with the engine's accountant DP-SGD is better "
               "here: use noise='gaussian'")
    else:
        assert isinstance(mechanism.strategy, BandedToeplitz)  # (noise "bandmf": CorrelatedMechanism checks it)
        fix = (f"{mechanism.strategy.bands} bands give up more amplification than the correlation saves: use "
               "bands='auto' (which weighs the two, DP-SGD included) or noise='gaussian'")
    warnings.warn(
        f"noise={mechanism.noise!r} with cyclic_groups={groups} is worse than DP-SGD for this run: DP-SGD leaves the "
        f"same expected squared error in the trajectory (noise multiplier "
        f"{found.dp_sgd_noise_multiplier_at_same_error:.4g}, Poisson rate {inclusion_rate:.4g}) for epsilon "
        f"{found.dp_sgd_epsilon_at_same_error:.3g}, where this run spends epsilon {found.epsilon:.3g} (noise "
        f"multiplier {noise_multiplier:.4g}, {found.steps} steps): at this epsilon DP-SGD leaves less. {fix} "
        "(docs/correlated-noise.md, 'When BLT fits')", CorrelatedNoiseWarning, stacklevel=stacklevel)
    return found
