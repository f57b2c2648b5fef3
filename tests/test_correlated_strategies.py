"""Correlated noise, the mathematics: Toeplitz algebra, sensitivities, optimized strategies against known values
from the literature, the on-disk cache, and the accounting against dp_accounting and jax_privacy's numbers."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from dptrain import accounting
from dptrain.correlated import strategies as S
from dptrain.correlated import toeplitz as T
from dptrain.correlated.privacy import CorrelatedAccountant, CorrelatedMechanism


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTRAIN_CACHE_DIR", str(tmp_path / "strategies"))


def _dense_inverse_column(c, n):
    return torch.linalg.inv(T.materialize(torch.as_tensor(c, dtype=torch.float64), n))[:, 0]


# ----------------------------------------------------------------------------------------- Toeplitz algebra


@pytest.mark.parametrize("n", [1, 7, 64, 65, 200])
def test_series_inverse_and_products_match_the_matrices(n):
    g = torch.Generator().manual_seed(n)
    # |c_0| > sum_k |c_k|: no root of c(x) in the unit disc, a well-conditioned inverse to compare with
    c = (torch.rand(n, generator=g, dtype=torch.float64) + 0.2) * 0.5 ** torch.arange(n, dtype=torch.float64)
    c[0] = 1.5
    torch.testing.assert_close(T.series_inverse(c, n), _dense_inverse_column(c, n), rtol=1e-10, atol=1e-12)
    a = torch.randn(n, generator=g, dtype=torch.float64)
    torch.testing.assert_close(T.multiply(a, c, n), (T.materialize(a) @ T.materialize(c))[:, 0], rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_per_query_error_is_the_row_norms_of_A_C_inverse(momentum):
    n = 70  # past the direct-convolution length: the FFT path
    c = torch.as_tensor(S.fhu_coefficients(5), dtype=torch.float64)
    workload = T.workload_coefficients(n, momentum)
    A = T.materialize(workload)
    if momentum:  # heavy ball: theta_t sums g_s with weights (1 - beta^(t-s+1)) / (1 - beta)
        t, s = 9, 3
        assert A[t, s] == pytest.approx(sum(momentum ** k for k in range(t - s + 1)))
    B = A @ torch.linalg.inv(T.materialize(c, n))
    expected = (B * B).sum(1)
    got = T.per_query_error(strategy=c, n=n, workload=None if momentum == 0 else workload)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)


def _brute_sensitivity_squared(c, n, min_sep, k, signs=(1,)):
    """max over participation sets S (|S| <= k, min_sep apart) and aligned contributions of +-1 of ||C u||^2."""
    C = T.materialize(torch.as_tensor(c, dtype=torch.float64), n).numpy()
    best = 0.0
    for size in range(1, k + 1):
        for steps in itertools.combinations(range(n), size):
            if any(b - a < min_sep for a, b in zip(steps, steps[1:])):
                continue
            for sign in itertools.product(signs, repeat=size):
                best = max(best, float(np.sum((C[:, list(steps)] @ np.array(sign)) ** 2)))
    return best


@pytest.mark.parametrize("min_sep,k", [(1, 1), (1, 9), (2, 3), (3, 2), (4, None)])
def test_minsep_sensitivity_is_exact_for_positive_decreasing_columns(min_sep, k):
    n = 9
    for c in (S.fhu_coefficients(n), S.BufferedToeplitz((0.8, 0.3), (0.2, 0.3)).column(n), np.array([1.0])):
        got = float(T.minsep_sensitivity_squared(c, n, min_sep, k))
        assert got == pytest.approx(_brute_sensitivity_squared(c, n, min_sep, k or n), rel=1e-12)


def test_minsep_sensitivity_bounds_any_column():
    """Negative or increasing coefficients: an upper bound on every participation set and sign pattern."""
    n, c = 7, np.array([1.0, -0.6, 0.9, 0.1, -0.4])
    for min_sep, k in [(1, 3), (2, 2), (3, 3)]:
        bound = float(T.minsep_sensitivity_squared(c, n, min_sep, k))
        assert bound >= _brute_sensitivity_squared(c, n, min_sep, k, signs=(1, -1)) - 1e-12


# ---------------------------------------------------------------------------------- strategies, known values


@pytest.mark.parametrize("n", [8, 16])
def test_banded_optimizer_finds_the_square_root_factorization_for_max_error(n):
    """Fichtenberger, Henzinger & Upadhyay (2023): C = A^(1/2), c_k = binom(2k, k) / 4^k, is the optimal Toeplitz
    strategy for the worst step's error (Dvijotham et al. 2024), of loss (sum_k c_k^2)^2. Found from a flat start."""
    fhu = S.fhu_coefficients(n)
    A = torch.tril(torch.ones(n, n, dtype=torch.float64))
    torch.testing.assert_close(T.materialize(fhu) @ T.materialize(fhu), A, rtol=0, atol=1e-12)
    found = S.optimize_banded(n, n, error="max", initial=np.ones(n))
    np.testing.assert_allclose(found.coefficients, fhu / np.linalg.norm(fhu), atol=1e-6)
    assert S.strategy_loss(found, n, error="max") == pytest.approx(np.sum(fhu**2) ** 2, rel=1e-9)


def test_one_band_is_dp_sgd_and_more_bands_lower_the_error():
    n = 64
    dp_sgd = S.strategy_loss(S.BandedToeplitz((1.0,)), n)
    assert dp_sgd == pytest.approx((n + 1) / 2)  # mean over t of t + 1 unit variances
    losses = [S.strategy_loss(S.banded_strategy(n, b), n) for b in (1, 2, 4, 8)]
    assert losses[0] == pytest.approx(dp_sgd)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    assert losses[-1] < 0.3 * dp_sgd
    for b in (2, 8):  # what the mechanism needs: unit norm, positive leading coefficient, a stable inverse
        strategy = S.banded_strategy(n, b)  # (from the cache)
        assert np.linalg.norm(strategy.coefficients) == pytest.approx(1.0)
        S.check_noising_stable(strategy, 10 * n)


@pytest.mark.parametrize("n,buffers,ratio", [(100, 2, 1.03), (1000, 2, 1.04)])
def test_blt_optimizer_is_within_the_published_factor_of_the_optimum(n, buffers, ratio):
    """jax_privacy's test of its BLT optimizer: sqrt(max loss) within `ratio` of 1 + ln(n) / pi, the tight up to
    constants bound on the optimal Toeplitz loss (Mathias 1993, Cor. 3.5; Dvijotham et al. 2024, eq. 2.8)."""
    blt = S.optimize_blt(n, buffers, error="max")
    loss = S.strategy_loss(blt, n, min_sep=1, max_participations=1, error="max")
    assert math.sqrt(loss) <= ratio * (1 + math.log(n) / math.pi)
    column = blt.column(n)
    assert column[0] == 1 and np.all(column > 0) and np.all(np.diff(column) <= 0)  # sensitivity exact


def test_jax_privacys_golden_blt_is_a_stationary_point_of_our_loss():
    """jax_privacy's golden BLT for n = 100000, 2 buffers, max error, one participation (its
    test_optimize_single_participation_golden): our loss has a vanishing gradient there, so the two losses agree
    (our optimizer reproduces it to 1e-8: benchmarks/results/correlated-notes.md)."""
    n = 100_000
    decay = torch.tensor([0.9999528892, 0.9857068667], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.0122853238, 0.1878393665], dtype=torch.float64, requires_grad=True)
    c = S._blt_column(decay, scale, n)
    errors = T.per_query_error(noising=S._blt_inverse_column(decay, scale, n), n=n)
    loss = torch.log(errors[-1] * torch.dot(c, c))
    loss.backward()
    # d log(loss) / d log(1 - decay) and d log(loss) / d log(scale): the golden values are rounded to 1e-10, a
    # relative change of ~2e-6 of 1 - decay; away from our optimum these derivatives would be of order one
    assert float((decay.grad * (1 - decay.detach())).abs().max()) < 1e-4
    assert float((scale.grad * scale.detach()).abs().max()) < 1e-4
    far = S.BufferedToeplitz((0.999, 0.9), (0.02, 0.2))  # and it is far better than a nearby guess
    assert S.strategy_loss(far, n, min_sep=1, max_participations=1, error="max") > 1.01 * math.exp(float(loss.detach()))


def test_blt_inverse_in_closed_form_matches_the_series_inverse():
    decay = torch.tensor([0.95, 0.6, 0.2], dtype=torch.float64)
    scale = torch.tensor([0.1, 0.3, 0.2], dtype=torch.float64)
    c = S._blt_column(decay, scale, 150)
    torch.testing.assert_close(S._blt_inverse_column(decay, scale, 150), T.series_inverse(c, 150), rtol=1e-9,
                               atol=1e-12)


def test_unstable_strategies_are_refused():
    with pytest.raises(ValueError, match="unstable inverse"):
        S.check_noising_stable(S.BandedToeplitz((0.5, 1.0)), 100)  # root of c(x) at x = -1/2: inside the disc
    with pytest.raises(ValueError, match="c\\[0\\] > 0"):
        S.BandedToeplitz((0.0, 1.0))


# -------------------------------------------------------------------------------------------------- cache


def test_strategies_are_cached_on_disk_by_their_parameters(tmp_path, monkeypatch):
    first = S.banded_strategy(32, 3)
    files = list((tmp_path / "strategies").glob("banded-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["bands"] == 3

    def no_optimization(*args, **kwargs):
        raise AssertionError("optimized again")

    monkeypatch.setattr(S, "optimize_banded", no_optimization)
    assert S.banded_strategy(32, 3) == first  # read back
    with pytest.raises(AssertionError, match="optimized again"):
        S.banded_strategy(32, 3, momentum=0.5)  # other parameters: another entry
    files[0].write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("DPTRAIN_CACHE_DIR", str(tmp_path / "strategies"))
    with pytest.warns(UserWarning, match="unreadable cached strategy"):
        assert S.banded_strategy(32, 3) == first  # recomputed (deterministic) and rewritten
    assert S.banded_strategy(32, 3) == first


# ---------------------------------------------------------------------------------------------- accounting


def _dp_accounting_pld(event, delta):
    import dp_accounting

    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    return accountant.compose(event).get_epsilon(delta)


def test_amplified_bandmf_is_dp_sgd_over_the_rounds_of_one_group():
    """Choquette-Choo et al. (2023) Thm 1 / jax_privacy's amplified_bandmf_event: b-banded, g >= b cyclic groups,
    n steps = ceil(n / g) Poisson-subsampled Gaussians of the within-group rate q."""
    import dp_accounting

    mechanism = CorrelatedMechanism("bandmf", S.BandedToeplitz((0.8, 0.6)), cyclic_groups=3, planned_steps=100)
    sigma, q, delta = 1.3, 0.2, 1e-6
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 34)  # ceil(100 / 3)
    assert mechanism.epsilon(sigma, q, 100, delta, "pld") == pytest.approx(_dp_accounting_pld(event, delta), rel=3e-3)
    assert mechanism.epsilon(sigma, q, 100, delta, "rdp") == pytest.approx(
        accounting.compute_epsilon(sigma, q, 34, delta, "rdp"), rel=1e-12)


def test_bandmf_epsilon_matches_jax_privacys_published_numbers():
    """jax_privacy's accounting docstring: DP-SGD with sigma 3, 512 steps, q = 0.1 spends epsilon 3.77 at
    delta 1e-6 (PLD), and epsilon 1 needs sigma 9.66. amplified_bandmf_event(n, b) is that event with ceil(n / b)
    steps: a 4-banded run of 2048 steps."""
    mechanism = CorrelatedMechanism("bandmf", S.BandedToeplitz((0.7, 0.5, 0.4, 0.3)), 4, 2048)
    assert round(mechanism.epsilon(3.0, 0.1, 2048, 1e-6, "pld"), 2) == 3.77
    assert round(mechanism.epsilon(9.66, 0.1, 2048, 1e-6, "pld"), 2) == 1.0
    sigma = mechanism.calibrate(1.0, 1e-6, 0.1, 2048, "pld")  # never above the target, at most 1 % below
    assert 9.66 <= sigma <= 9.66 * 1.01
    assert 0.99 <= mechanism.epsilon(sigma, 0.1, 2048, 1e-6, "pld") <= 1.0


def test_one_band_one_group_is_dp_sgd_exactly():
    mechanism = CorrelatedMechanism("bandmf", S.BandedToeplitz((1.0,)), 1, 50)
    for name in accounting.ACCOUNTANTS:
        assert mechanism.epsilon(0.9, 0.05, 50, 1e-5, name) == accounting._epsilon(name, [(0.9, 0.05, 50)], 1e-5)


def test_blt_epsilon_is_the_gaussian_mechanism_at_its_sensitivity():
    """No amplification: one Gaussian mechanism of noise sigma kappa over the (k, g) sensitivity of C; the
    Gaussian mechanism is exactly (1 / sigma_eff)-GDP, whose epsilon is analytic (Balle & Wang 2018)."""
    import dp_accounting

    blt = S.BufferedToeplitz((0.9, 0.4), (0.2, 0.3))
    mechanism = CorrelatedMechanism("blt", blt, cyclic_groups=5, planned_steps=40)
    kappa = blt.max_column_norm(40)
    sensitivity = math.sqrt(float(T.minsep_sensitivity_squared(blt.column(40), 40, 5, 8)))
    assert mechanism.sensitivity(40) == pytest.approx(sensitivity / kappa)
    sigma_eff = 6.0 / mechanism.sensitivity(40)
    exact = accounting.gdp_epsilon(1 / sigma_eff, 1e-5)
    assert mechanism.epsilon(6.0, 0.3, 40, 1e-5, "pld") == pytest.approx(exact, rel=2e-3)
    assert mechanism.epsilon(6.0, 0.3, 40, 1e-5, "pld") >= exact  # a pessimistic bound
    assert _dp_accounting_pld(dp_accounting.GaussianDpEvent(sigma_eff), 1e-5) == pytest.approx(exact, rel=2e-3)
    # fewer steps, fewer participations: less spent
    assert mechanism.epsilon(6.0, 0.3, 20, 1e-5, "pld") < mechanism.epsilon(6.0, 0.3, 40, 1e-5, "pld")
    sigma = mechanism.calibrate(2.0, 1e-5, 0.3, 40, "pld")
    assert 0.99 * 2.0 <= mechanism.epsilon(sigma, 0.3, 40, 1e-5, "pld") <= 2.0


def test_blt_without_correlation_is_dp_sgd_without_amplification():
    """A BLT of vanishing scale is the identity: k participations of noise sigma compose to sigma / sqrt(k)."""
    mechanism = CorrelatedMechanism("blt", S.BufferedToeplitz((0.5,), (1e-12,)), cyclic_groups=4, planned_steps=40)
    assert mechanism.sensitivity(40) == pytest.approx(math.sqrt(10), rel=1e-9)
    assert mechanism.epsilon(3.0, 0.5, 40, 1e-5, "rdp") == pytest.approx(
        accounting.compute_epsilon(3.0, 1.0, 10, 1e-5, "rdp"), rel=1e-6)


def test_bandmf_needs_at_least_as_many_groups_as_bands():
    with pytest.raises(ValueError, match="cyclic_groups must be >= bands"):
        CorrelatedMechanism("bandmf", S.BandedToeplitz((0.8, 0.6)), cyclic_groups=1, planned_steps=10)


def test_correlated_and_dp_sgd_accountant_states_do_not_mix():
    mechanism = CorrelatedMechanism("bandmf", S.BandedToeplitz((0.8, 0.6)), 2, 10)
    correlated = CorrelatedAccountant("pld", mechanism)
    correlated.step(1.0, 0.5, num_steps=4)
    plain = accounting.create_accountant("pld")
    plain.step(1.0, 0.5, num_steps=4)
    with pytest.raises(ValueError, match="correlated-noise run"):
        accounting.create_accountant("pld").load_state_dict(correlated.state_dict())
    with pytest.raises(ValueError, match="independent Gaussian noise"):
        CorrelatedAccountant("pld", mechanism).load_state_dict(plain.state_dict())
    other = CorrelatedMechanism("bandmf", S.BandedToeplitz((0.6, 0.8)), 2, 10)
    with pytest.raises(ValueError, match="correlated mechanism"):
        CorrelatedAccountant("pld", other).load_state_dict(correlated.state_dict())
    resumed = CorrelatedAccountant("pld", mechanism)
    resumed.load_state_dict(correlated.state_dict())
    assert resumed.get_epsilon(1e-5) == correlated.get_epsilon(1e-5) == mechanism.epsilon(1.0, 0.5, 4, 1e-5)
