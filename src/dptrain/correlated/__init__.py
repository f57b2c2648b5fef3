"""Correlated noise: matrix-factorization mechanisms (banded Toeplitz with amplification, BLT) for the engine.

``PrivacyEngine(..., noise="bandmf", bands=b)`` or ``noise="blt"``; see docs/correlated-noise.md.

* :mod:`~dptrain.correlated.toeplitz`: lower-triangular Toeplitz algebra (inverse, errors, sensitivities).
* :mod:`~dptrain.correlated.strategies`: the strategies, their optimization and the on-disk cache.
* :mod:`~dptrain.correlated.privacy`: what a run spends (dp_accounting events), calibration, the accountant.
* :mod:`~dptrain.correlated.streaming`: the engine's noise source (per-parameter buffers) and ``plan_noise``.
* :mod:`~dptrain.correlated.resolve`: the engine's noise arguments, checked and built into a mechanism.
* :mod:`~dptrain.correlated.comparison`: a run's expected error against DP-SGD's at the same epsilon (the engine
  warns when DP-SGD is better).

It may import ``accounting`` and ``_checks``, nothing of the engine: the engine builds its noise source from this
package (and gives it its i.i.d. Gaussian draws), not the other way round.
"""
from __future__ import annotations

from .comparison import CorrelatedNoiseWarning, NoiseComparison, compare_with_dp_sgd
from .privacy import CORRELATED_NOISES, CorrelatedAccountant, CorrelatedMechanism
from .strategies import (
                         BandedToeplitz,
                         BufferedToeplitz,
                         banded_strategy,
                         blt_strategy,
                         cache_dir,
                         optimize_banded,
                         optimize_blt,
                         strategy_loss,
)
from .streaming import CorrelatedNoise, NoisePlan, plan_noise

__all__ = [
    "CORRELATED_NOISES",
    "BandedToeplitz",
    "BufferedToeplitz",
    "CorrelatedAccountant",
    "CorrelatedMechanism",
    "CorrelatedNoise",
    "CorrelatedNoiseWarning",
    "NoiseComparison",
    "NoisePlan",
    "banded_strategy",
    "blt_strategy",
    "cache_dir",
    "compare_with_dp_sgd",
    "optimize_banded",
    "optimize_blt",
    "plan_noise",
    "strategy_loss",
]
