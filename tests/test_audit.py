"""The one-run audit: the lower-bound statistics on mechanisms whose epsilon is known, the canaries
against the float64 oracle in every clipping mode, small audits (honest and broken) and `dptrain audit`."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats
import torch

import dptrain
from dptrain.audit import (
    CANARY_NORM_OVER_R,
    CanaryModel,
    canary_losses,
    epsilon_lower_bound,
    format_report,
    one_run_p_value,
    run_audit,
    subsampled_gaussian_scores,
)
from dptrain.cli import main
from dptrain.models.build import build_image_model
from dptrain.testing import reference_clipped_gradient

MODES = tuple(dptrain.CLIPPING_MODES)


def randomized_response(m, epsilon, seed, leak=0.0):
    """Coins and scores of an (epsilon, leak)-DP guessing game with a known answer.

    Each canary is in with probability 1/2; its score is +-1 with the right sign with
    probability e^eps / (1 + e^eps) (randomized response, epsilon-DP), except that with
    probability ``leak`` its score reveals the coin (+-100): (epsilon, leak)-DP.
    """
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    sign = np.where(included, 1.0, -1.0)
    truthful = rng.random(m) < math.exp(epsilon) / (1 + math.exp(epsilon))
    scores = np.where(truthful, sign, -sign)
    scores = np.where(rng.random(m) < leak, 100 * sign, scores)
    return scores + 1e-3 * rng.random(m), included  # the jitter orders ties independently of the coins


# ====================================================================== the statistics


def test_p_value_of_two_guesses_matches_the_theorem_by_hand():
    # m = 5 canaries, 2 guesses, both right, eps = 1, delta = 0.01. With p = e/(1+e),
    # f(2) = p^2; the delta term is 2 m delta max(P[W=1] / 1, (P[W=1] + P[W=0]) / 2).
    p = math.e / (1 + math.e)
    w1, w0 = 2 * p * (1 - p), (1 - p) ** 2
    expected = p**2 + 2 * 5 * 0.01 * max(w1, (w1 + w0) / 2)
    assert one_run_p_value(5, 2, 2, 1.0, 0.01) == pytest.approx(expected, rel=1e-12)
    assert one_run_p_value(5, 2, 2, 1.0, 0.0) == pytest.approx(p**2, rel=1e-12)
    assert one_run_p_value(5, 2, 0, 1.0, 0.01) == 1.0  # "at least 0 right" is certain


def test_p_value_is_the_binomial_tail_without_delta_and_grows_with_epsilon_and_delta():
    for eps in (0.0, 0.3, 2.0):
        p = 1 / (1 + math.exp(-eps))
        assert one_run_p_value(1000, 300, 200, eps, 0.0) == pytest.approx(scipy.stats.binom.sf(199, 300, p))
    values = [one_run_p_value(1000, 300, 200, eps, 1e-5) for eps in np.linspace(0, 3, 13)]
    assert values == sorted(values)
    assert one_run_p_value(1000, 300, 200, 0.5, 1e-4) > one_run_p_value(1000, 300, 200, 0.5, 1e-6)


def test_bound_on_randomized_response_is_below_epsilon_at_the_stated_rate_and_tight():
    epsilon = 1.0
    above = [epsilon_lower_bound(*randomized_response(600, epsilon, seed), delta=0.0).epsilon > epsilon
             for seed in range(120)]
    assert sum(above) <= 0.05 * 120  # the theorem: at most 1 - confidence of the runs
    # With many canaries the bound approaches the true epsilon (guessing every canary is optimal here).
    bound = epsilon_lower_bound(*randomized_response(40_000, epsilon, seed=0), delta=0.0)
    assert 0.9 * epsilon < bound.epsilon <= epsilon
    assert bound.guesses_in + bound.guesses_out == 40_000


def test_delta_correction_keeps_the_bound_valid_when_a_few_canaries_leak():
    # (0.5, 0.03)-DP: about 30 of 1000 canaries reveal their coin. Treating the run as
    # pure 0.5-DP (delta = 0) "proves" far more than 0.5; the corrected bound does not.
    for seed in range(5):
        scores, included = randomized_response(1000, 0.5, seed, leak=0.03)
        assert epsilon_lower_bound(scores, included, delta=0.0).epsilon > 1.0
        assert epsilon_lower_bound(scores, included, delta=0.03).epsilon <= 0.5


def test_bound_uses_the_top_and_bottom_scores_and_corrects_for_the_search():
    scores = np.arange(100.0)
    included = scores >= 50  # a perfect ranking
    one = epsilon_lower_bound(scores, included, delta=0.0, splits=[(50, 50)])
    assert (one.guesses_in, one.guesses_out, one.correct, one.tried) == (50, 50, 100, 1)
    # All 100 right at level 0.05: p^100 = 0.05 exactly at the bound.
    assert 1 / (1 + math.exp(-one.epsilon)) == pytest.approx(0.05 ** (1 / 100), abs=1e-5)
    searched = epsilon_lower_bound(scores, included, delta=0.0, splits=[(50, 50)] + [(k, 0) for k in range(1, 10)])
    assert searched.tried == 10 and searched.epsilon < one.epsilon  # each split tested at 0.05 / 10
    reversed_ = epsilon_lower_bound(-scores, included, delta=0.0, splits=[(50, 50)])
    assert reversed_.correct == 0 and reversed_.epsilon == 0.0


def test_bound_rejects_bad_input_with_a_clear_message():
    with pytest.raises(ValueError, match="same length"):
        epsilon_lower_bound([1.0, 2.0], [True], delta=1e-5)
    with pytest.raises(ValueError, match="confidence must be in"):
        epsilon_lower_bound([1.0, 2.0], [True, False], delta=1e-5, confidence=1.0)
    with pytest.raises(ValueError, match="finite"):
        epsilon_lower_bound([1.0, math.nan], [True, False], delta=1e-5)
    with pytest.raises(ValueError, match="split"):
        epsilon_lower_bound([1.0, 2.0], [True, False], delta=1e-5, splits=[(2, 1)])


def test_scores_are_the_subsampled_gaussian_likelihood_ratio():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6))
    mu, s, q = 1.0, 2.0, 0.3
    included = q * scipy.stats.norm.pdf(x, mu, s) + (1 - q) * scipy.stats.norm.pdf(x, 0, s)
    expected = np.log(included / scipy.stats.norm.pdf(x, 0, s)).sum(0)
    np.testing.assert_allclose(subsampled_gaussian_scores(x, contribution=mu, noise_std=s, sample_rate=q), expected,
                               rtol=1e-12)
    full = subsampled_gaussian_scores(x, contribution=mu, noise_std=s, sample_rate=1.0)  # the Gaussian LLR
    np.testing.assert_allclose(full, ((2 * x * mu - mu**2) / (2 * s**2)).sum(0), rtol=1e-12)
    far = subsampled_gaussian_scores(np.array([[1e6]]), contribution=1.0, noise_std=0.1, sample_rate=0.01)
    assert np.isfinite(far).all()  # no overflow where exp() would


# ====================================================================== canaries through the engine


@pytest.mark.parametrize("mode", MODES)
def test_canaries_through_the_engine_match_the_oracle_and_stay_orthogonal(mode, float64):
    torch.manual_seed(0)
    audited = CanaryModel(build_image_model("cnn", 1, 10, 8).model, canaries=5)
    x = torch.randn(7, 1, 8, 8)
    y = torch.randint(0, 10, (7,))
    canary_id = torch.tensor([-1, 3, -1, -1, 0, -1, 4])
    R = 0.5

    def losses_fn(model, x, y, canary_id):
        return canary_losses(*model(x, canary_id), y, canary_id, CANARY_NORM_OVER_R * R)

    reference = reference_clipped_gradient(audited, losses_fn, (x, y, canary_id), max_grad_norm=R)
    optimizer = torch.optim.SGD(audited.parameters(), lr=0.0)
    engine = dptrain.PrivacyEngine(audited, batch_size=1, sample_size=100, max_grad_norm=R, noise_multiplier=0.0,
                                   clipping_mode=mode)
    engine.attach(optimizer)
    try:
        engine.backward(losses_fn(audited, x, y, canary_id))
        optimizer.step()
        for name, p in audited.named_parameters():
            torch.testing.assert_close(p.grad, reference[name], rtol=1e-10, atol=1e-12)
    finally:
        engine.detach()
    # Each canary adds exactly R on its own coordinate and nothing elsewhere; the padding row
    # that real samples read never moves.
    expected = torch.zeros(6)
    expected[[3, 0, 4]] = R
    torch.testing.assert_close(audited.probe.weight.grad[:, 0], expected, rtol=0, atol=1e-15)
    # The real parameters get exactly the clipped gradient of the real samples alone.
    real = canary_id < 0
    real_only = reference_clipped_gradient(audited, losses_fn, (x[real], y[real], canary_id[real]), max_grad_norm=R)
    for name, p in audited.named_parameters():
        if not name.startswith("probe"):
            torch.testing.assert_close(p.grad, real_only[name], rtol=1e-10, atol=1e-12)


def test_canary_model_rejects_a_bad_canary_count():
    with pytest.raises(ValueError, match="canaries must be a positive integer"):
        CanaryModel(torch.nn.Linear(2, 2), canaries=0)


# ====================================================================== small audits

SMALL = dict(canaries=300, steps=2, seed=0)


@pytest.fixture(scope="module")
def default_mode_audit():
    return run_audit(**SMALL)


@pytest.mark.parametrize("mode", MODES)
def test_small_honest_audit_runs_in_every_mode_and_finds_the_same_picture(mode, default_mode_audit):
    result = run_audit(clipping_mode=mode, **SMALL)
    assert result.clipping_mode == mode and result.canaries == 300 and result.steps == 2
    assert result.epsilon == pytest.approx(2.0, rel=0.02) and result.epsilon <= 2.0
    assert 0 <= result.epsilon_lower_bound <= result.epsilon
    assert result.consistent
    # Same coins, batches and noise: every mode clips each canary to exactly R, so the
    # auditor sees the same noisy gradients and makes the same guesses.
    assert result.correct_guesses == default_mode_audit.correct_guesses
    assert result.epsilon_lower_bound == default_mode_audit.epsilon_lower_bound


def test_small_audit_catches_a_run_with_a_tenth_of_its_noise():
    result = run_audit(noise_scale=0.1, canaries=1000, steps=4, seed=0)
    assert result.epsilon_lower_bound > result.epsilon
    assert not result.consistent
    report = format_report(result)
    assert report.count("DELIBERATELY BREAKS ITS PRIVACY PROMISE") == 2 and "PROMISE BROKEN" in report


def test_small_audit_catches_a_run_whose_clipping_is_switched_off():
    # Every clipping factor 1: each sampled canary adds 64 R to its coordinate where the
    # promise allows R (the noise and the epsilon claimed stay those of clipping at R).
    result = run_audit(canaries=1000, steps=4, seed=0, clipping_off=True)
    honest = run_audit(canaries=1000, steps=4, seed=0)
    assert (result.epsilon, result.noise_multiplier) == (honest.epsilon, honest.noise_multiplier)
    assert result.epsilon_lower_bound > result.epsilon


def test_same_seed_same_audit_and_a_new_seed_new_coins(default_mode_audit):
    again = run_audit(**SMALL)
    assert (again.epsilon_lower_bound, again.correct_guesses, again.included_canaries) == (
        default_mode_audit.epsilon_lower_bound, default_mode_audit.correct_guesses,
        default_mode_audit.included_canaries)
    other = run_audit(**{**SMALL, "seed": 1})
    assert other.included_canaries != default_mode_audit.included_canaries
    assert other.sample_rate == default_mode_audit.sample_rate  # q is fixed before the coins are flipped


def test_audit_of_your_own_model_and_data_leaves_your_model_alone():
    torch.manual_seed(0)
    inputs, labels = torch.randn(200, 6), torch.randint(0, 3, (200,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = run_audit(model=model, data=(inputs, labels), canaries=300, steps=2, seed=0)
    assert result.model == "Sequential" and result.data == "custom data" and result.train_size == 200
    assert 0 <= result.epsilon_lower_bound <= result.epsilon
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert "Sequential on custom data (200 samples)" in format_report(result)


def test_audit_rejects_bad_options_with_a_clear_message():
    with pytest.raises(ValueError, match="confidence must be in"):
        run_audit(confidence=1.5)
    with pytest.raises(ValueError, match="noise_scale must be a finite number >= 0"):
        run_audit(noise_scale=-1.0)
    with pytest.raises(ValueError, match="clipping_mode"):
        run_audit(clipping_mode="fast", **SMALL)
    with pytest.raises(ValueError, match="class labels"):
        run_audit(data=(torch.zeros(5, 3), torch.zeros(5)), **SMALL)
    with pytest.raises(ValueError, match="built for images"):
        run_audit(data=(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long)), **SMALL)


# ====================================================================== dptrain audit

JSON_KEYS = {"epsilon", "delta", "epsilon_lower_bound", "confidence", "canaries", "steps", "clipping_mode",
             "noise_scale"}


def test_cli_audit_json(capsys):
    status = main(["audit", "--canaries", "300", "--steps", "2", "--seed", "0", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert JSON_KEYS <= set(report)
    assert report["canaries"] == 300 and report["steps"] == 2 and report["noise_scale"] == 1.0
    assert report["clipping_mode"] == "bk-mixopt" and report["confidence"] == 0.95 and report["delta"] == 1e-5
    assert report["epsilon_lower_bound"] <= report["epsilon"] <= 2.0


def test_cli_audit_text_explains_both_numbers_and_warns_loudly_when_broken(capsys):
    status = main(["audit", "--canaries", "300", "--steps", "2", "--seed", "0", "--epsilon", "1",
                   "--clipping-mode", "ghost", "--noise-scale", "0.1"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "claimed:  epsilon = " in out and "measured: epsilon >= " in out
    assert "DELIBERATELY BREAKS ITS PRIVACY PROMISE" in out and "DELIBERATELY BREAKS ITS PRIVACY PROMISE" in err
    assert "clipping ghost" in out


def test_cli_audit_bad_value_is_one_line(capsys):
    status = main(["audit", "--confidence", "2"])
    _, err = capsys.readouterr()
    assert status == 2 and err.count("\n") == 1 and "--confidence" in err


def test_cli_help_states_the_library_defaults(capsys):
    from dptrain.audit import AUDIT_DEFAULTS

    assert main(["audit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for key in ("epsilon", "delta", "canaries", "steps", "sample_rate", "confidence", "noise_scale", "bands"):
        assert f"(default {AUDIT_DEFAULTS[key]:g})" in text, key
    assert f"(default {AUDIT_DEFAULTS['clipping_mode']})" in text
    assert f"default {AUDIT_DEFAULTS['noise']})" in text


# ------------------------------------------------------------------------------------ correlated noise (bandmf)


def test_banded_scores_with_one_band_are_the_subsampled_gaussian_scores():
    from dptrain.audit import banded_scores

    rng = np.random.default_rng(0)
    observations = rng.normal(size=(5, 40))
    np.testing.assert_allclose(
        banded_scores(observations, [1.0], np.zeros(40, dtype=int), contribution=1.0, noise_std=2.0,
                      sample_rate=0.3),
        subsampled_gaussian_scores(observations, contribution=1.0, noise_std=2.0, sample_rate=0.3), rtol=1e-12)


def test_banded_scores_of_the_ideal_mechanism_give_a_valid_bound_and_catch_too_little_noise():
    """Simulated BandMF (C^{-1} noise, canaries in cyclic groups, Poisson within a group): honest runs audit below
    the amplified epsilon, a run with a third of its noise above it."""
    from dptrain.audit import banded_scores
    from dptrain.correlated import CorrelatedMechanism, banded_strategy, toeplitz

    steps, bands, q, m = 12, 3, 0.5, 4000
    strategy = banded_strategy(steps, bands)
    mechanism = CorrelatedMechanism("bandmf", strategy, bands, steps)
    sigma = mechanism.calibrate(2.0, 1e-5, q, steps)
    inverse = toeplitz.materialize(toeplitz.series_inverse(torch.tensor(strategy.column(steps)), steps)).numpy()
    bounds = {}
    for scale in (1.0, 1 / 3):
        rng = np.random.default_rng(1)
        included = rng.random(m) < 0.5
        groups = np.arange(m) % bands
        sampled = (rng.random((steps, m)) < q) & (np.arange(steps)[:, None] % bands == groups[None, :])
        x = (sampled & included[None, :]).astype(float)
        y = x + scale * sigma * inverse @ rng.normal(size=(steps, m))
        scores = banded_scores(y, strategy.coefficients, groups, contribution=1.0, noise_std=sigma, sample_rate=q)
        bounds[scale] = epsilon_lower_bound(scores, included, delta=1e-5).epsilon
    assert bounds[1.0] <= mechanism.epsilon(sigma, q, steps, 1e-5) < bounds[1 / 3]


def test_small_bandmf_audit_is_consistent_and_catches_a_tenth_of_its_noise():
    """The engine's own BandMF run (a small model on 200 samples: the canaries are what the audit measures)."""
    torch.manual_seed(0)
    small = {"model": torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)),
             "data": (torch.randn(200, 6), torch.randint(0, 3, (200,))), "noise": "bandmf", "bands": 2,
             "canaries": 1000, "steps": 8, "seed": 0}
    honest = run_audit(**small)
    assert honest.noise == "bandmf" and honest.bands == 2
    assert 0 <= honest.epsilon_lower_bound <= honest.epsilon <= 2.0 and honest.consistent
    assert "within 2 cyclic groups, banded correlated noise (bandmf)" in format_report(honest)
    broken = run_audit(**small, noise_scale=0.1)
    assert broken.epsilon == honest.epsilon and broken.epsilon_lower_bound > broken.epsilon
    with pytest.raises(ValueError, match="BLT noise is not amplified"):
        run_audit(noise="blt")
    with pytest.raises(ValueError, match="bands applies to noise='bandmf'"):
        run_audit(bands=2)
