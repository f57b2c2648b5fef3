"""Correlated noise against DP-SGD at the same epsilon: the engine warns, naming what DP-SGD spends for the same
expected error and the fix, when DP-SGD would leave less expected error (a BLT without cyclic groups, BandMF with too many bands), and stays
silent when the correlation pays (a BLT with one cyclic group per batch of an epoch). The comparison, made without
a calibration, is checked against DP-SGD calibrated the slow way."""
from __future__ import annotations

import warnings

import pytest
from torch import nn

import dptrain
from dptrain import accounting
from dptrain.correlated import CorrelatedNoiseWarning, compare_with_dp_sgd, strategy_loss
from dptrain.correlated.strategies import BandedToeplitz


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTRAIN_CACHE_DIR", str(tmp_path / "strategies"))


def build(**kwargs):
    """(engine, the CorrelatedNoiseWarnings its construction raised)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = dptrain.PrivacyEngine(nn.Linear(3, 2), **kwargs)
    return engine, [w for w in seen if issubclass(w.category, CorrelatedNoiseWarning)]


def error_ratio_by_calibration(engine) -> float:
    """The run's expected error over DP-SGD's, DP-SGD's noise calibrated at the epsilon the run spends."""
    mechanism, sigma = engine.config.mechanism, engine.noise_multiplier
    steps, q = mechanism.planned_steps, engine.batch_size / engine.sample_size
    epsilon = mechanism.epsilon(sigma, engine.sample_rate, steps, engine.target_delta)
    dp_sgd = accounting.calibrate_noise_multiplier(epsilon, engine.target_delta, q, steps)
    return sigma**2 * strategy_loss(mechanism.strategy, steps) / (
        dp_sgd**2 * strategy_loss(BandedToeplitz((1.0,)), steps))


def comparison(engine):
    return compare_with_dp_sgd(engine.config.mechanism, engine.noise_multiplier,
                               inclusion_rate=engine.batch_size / engine.sample_size, delta=engine.target_delta)


def printed(warning, found) -> bool:
    """The warning names DP-SGD's noise multiplier of the same error and both epsilons of the comparison."""
    return (f"(noise multiplier {found.dp_sgd_noise_multiplier_at_same_error:.4g}, Poisson rate" in str(warning.message)
            and f"for epsilon {found.dp_sgd_epsilon_at_same_error:.3g}, where this run spends epsilon "
                f"{found.epsilon:.3g} (noise multiplier {found.noise_multiplier:.4g}" in str(warning.message))


def test_blt_without_cyclic_groups_warns_that_dp_sgd_is_far_better():
    """The issue's run: q 0.05, 12 steps, epsilon 3. Every unit may take part at every step, so the optimized BLT is
    the identity and its noise that of 12 unsampled Gaussian steps."""
    engine, warned = build(batch_size=50, sample_size=1000, noise="blt", target_epsilon=3.0, steps=12)
    assert max(engine.config.mechanism.strategy.scale) < 1e-6  # C = I: no correlation pays for that sensitivity
    (warning,) = warned
    message = str(warning.message)
    assert warning.filename == __file__  # it names the user's PrivacyEngine(...) line
    found = comparison(engine)
    assert found.worse_than_dp_sgd and printed(warning, found)
    assert found.dp_sgd_epsilon_at_same_error < 0.1 * found.epsilon  # DP-SGD: the same error for a tenth of epsilon
    assert error_ratio_by_calibration(engine) > 30  # the slow way: at the run's epsilon, 30 times DP-SGD's error
    assert "a unit can take part in 12 of the steps, 1 apart" in message
    assert "cyclic_groups close to sample_size / batch_size = 20" in message


def test_blt_with_one_group_per_batch_of_an_epoch_beats_dp_sgd_silently():
    engine, warned = build(batch_size=100, sample_size=2000, noise="blt", cyclic_groups=20, target_epsilon=3.0,
                           steps=20)
    assert warned == []
    found = comparison(engine)
    assert not found.worse_than_dp_sgd and found.dp_sgd_epsilon_at_same_error > found.epsilon
    assert error_ratio_by_calibration(engine) < 0.9  # the slow way agrees: less error than DP-SGD's


def test_bandmf_with_too_many_bands_warns_and_one_band_is_dp_sgd_itself():
    engine, warned = build(batch_size=100, sample_size=1000, noise="bandmf", bands=8, target_epsilon=3.0, steps=10)
    (warning,) = warned
    found = comparison(engine)
    assert found.worse_than_dp_sgd and printed(warning, found)
    assert error_ratio_by_calibration(engine) > 1.3
    assert "8 bands give up more amplification than the correlation saves: use bands='auto'" in str(warning.message)
    _, warned = build(batch_size=100, sample_size=1000, noise="bandmf", bands=1, target_epsilon=3.0, steps=10)
    assert warned == []


def test_a_given_noise_multiplier_is_compared_at_the_epsilon_it_spends_and_no_noise_is_not():
    engine, warned = build(batch_size=50, sample_size=1000, noise="blt", noise_multiplier=3.0, steps=12)
    (warning,) = warned
    found = comparison(engine)
    assert found.noise_multiplier == 3.0 and printed(warning, found) and error_ratio_by_calibration(engine) > 1
    _, warned = build(batch_size=50, sample_size=1000, noise="blt", noise_multiplier=0.0, steps=12)
    assert warned == []
    with pytest.raises(ValueError, match="noise_multiplier must be > 0 to compare epsilons, got 0.0"):
        compare_with_dp_sgd(engine.config.mechanism, 0.0, inclusion_rate=0.05, delta=1e-4)


def test_an_edge_within_the_calibrations_slack_is_not_warned_about():
    """Two bands at q 0.25 over 8 steps: DP-SGD reaches the same error for 0.6 % less epsilon, less than the 1 % that
    the engine's calibration may leave unspent, so DP-SGD as the engine runs it is no better: no warning."""
    engine, warned = build(batch_size=250, sample_size=1000, noise="bandmf", bands=2, target_epsilon=3.0, steps=8)
    found = comparison(engine)
    assert found.worse_than_dp_sgd and 0.99 * found.epsilon < found.dp_sgd_epsilon_at_same_error
    assert warned == []
