"""What the engine accounts for is what happened: the ledger of the steps as they ran, resumes, the budget, delta.

A resumed engine whose noise multiplier, sample rate, sample size or max_batch_size differs from the checkpoint's
goes on with its own values, and epsilon and the budget are the composition of the steps as they ran (checked
against dp_accounting's composition of the same events); a checkpoint of another privacy unit is refused; an older
checkpoint loads with a warning. The budget is checked on both backward paths. delta >= 1/n warns, or is refused.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dptrain
from dptrain import accounting
from dptrain.data import poisson_loader
from dptrain.engine import PrivacyBudgetExceeded

N, B = 400, 40  # q = 0.1 (where several epsilons are computed: 4000 examples, q = 0.01, as RDP is slow at q = 0.1)


def _dataset(n=N):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _engine(**kw):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("batch_size", B)
    kw.setdefault("sample_size", N)
    engine = dptrain.PrivacyEngine(model, **kw)
    engine.attach(optimizer)
    return model, optimizer, engine


def _steps(engine, model, optimizer, count, path="engine", seed=0):
    """``count`` steps on Poisson batches (the sampling check stays quiet)."""
    loader = poisson_loader(_dataset(engine.sample_size), batch_size=engine.batch_size, steps=count,
                            generator=torch.Generator().manual_seed(seed))
    for x, y in loader:
        losses = F.cross_entropy(model(x), y, reduction="none")
        engine.backward(losses) if path == "engine" else losses.sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _resume(state, **kw):
    """A new engine built with ``kw``, the checkpoint loaded: (model, optimizer, engine, load warnings)."""
    model, optimizer, engine = _engine(**kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_state_dict(state)
    return model, optimizer, engine, [str(w.message) for w in caught]


# --------------------------------------------------------------------------- the row
@pytest.mark.slow
@pytest.mark.parametrize("path", ["engine", "plain"])
def test_a_plan_extended_at_resume_keeps_a_strict_budget(path):
    """target_epsilon=2 for 20 steps, run; a new engine planned for 40 (sigma re-calibrated, larger) loads the
    checkpoint: the composition already spends the target, so the 21st step is refused and epsilon stays <= 2."""
    model, optimizer, engine = _engine(target_epsilon=2.0, steps=20, clipping_mode="bk-mixopt")
    _steps(engine, model, optimizer, 20, path)
    sigma_1, state = engine.noise_multiplier, engine.state_dict()
    model, optimizer, engine, said = _resume(state, target_epsilon=2.0, steps=40, budget="strict")
    assert engine.noise_multiplier > sigma_1
    assert len(said) == 1
    assert f"noise_multiplier {sigma_1:.6g} -> {engine.noise_multiplier:.6g}" in said[0]
    assert "at most 20 steps in all fit (0 more), not the planned 40" in said[0]
    assert "budget='strict' refuses the steps past the target" in said[0]
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _dataset()[:B]
    losses = F.cross_entropy(model(x), y, reduction="none")
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    with pytest.raises(PrivacyBudgetExceeded, match=r"step 21 would spend.*run so far holds 20 steps at "
                                                     r"noise_multiplier=.*nothing was applied"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert engine.steps_taken == 20 and engine.get_epsilon() <= 2.0


@pytest.mark.slow
@pytest.mark.parametrize("path,budget", [("engine", "strict"), ("plain", "warn")])
def test_after_a_resume_the_budget_is_the_composition_of_the_steps_as_they_ran(path, budget):
    """10 of 20 planned steps, then an engine planned for 40: the steps that fit are exactly those whose composition
    (10 at sigma_1, k at sigma_2) stays within the target, checked here with dp_accounting's composition."""
    n, target = 4000, 0.5  # (sigma about 1.7: RDP is slow for sigma below 1)
    delta = accounting.default_delta(n)
    model, optimizer, engine = _engine(target_epsilon=target, steps=20, accountant="rdp", sample_size=n)
    _steps(engine, model, optimizer, 10, path)
    sigma_1 = engine.noise_multiplier
    model, optimizer, engine, said = _resume(engine.state_dict(), target_epsilon=target, steps=40, accountant="rdp",
                                             sample_size=n, budget=budget)
    sigma_2, q = engine.noise_multiplier, B / n

    def spent(*segments):
        return accounting.epsilon_of_history([(sigma_1, q, 10), *segments], delta, "rdp")
    fit = int(said[0].split("at most ")[1].split(" steps in all fit")[0]) - 10
    assert 0 < fit < 30 and spent((sigma_2, q, fit)) <= target < spent((sigma_2, q, fit + 1))
    assert f"({fit} more), not the planned 40" in said[0]
    suggested = float(said[0].split("build the engine with noise_multiplier=")[1].split(" ")[0])
    assert 0.99 * target <= spent((suggested, q, 30)) <= target * 1.0005  # (printed to 4 digits)
    _steps(engine, model, optimizer, fit, path, seed=1)
    assert engine.get_epsilon() == pytest.approx(spent((sigma_2, q, fit)), rel=1e-9)
    x, y = _dataset()[:B]
    losses = F.cross_entropy(model(x), y, reduction="none")
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    if budget == "strict":
        with pytest.raises(PrivacyBudgetExceeded, match=f"step {11 + fit} would spend"):
            optimizer.step()
        assert engine.steps_taken == 10 + fit
    else:
        past = spent((sigma_2, q, fit + 1))
        with pytest.warns(UserWarning, match=f"step {11 + fit} would spend epsilon = {past:.4g}"):
            optimizer.step()
        assert engine.get_epsilon() == pytest.approx(past, rel=1e-9)


def test_noise_calibrated_after_a_history_fits_the_target_within_one_percent():
    prior = [(1.1, 0.02, 30)]
    sigma = accounting.calibrate_noise_multiplier(3.0, 1e-5, 0.05, 100, accountant="rdp", history=prior)
    spent = accounting.epsilon_of_history(prior + [(sigma, 0.05, 100)], 1e-5, "rdp")
    assert 0.99 * 3.0 <= spent <= 3.0
    with pytest.raises(ValueError, match="steps already taken spend"):
        accounting.calibrate_noise_multiplier(0.5, 1e-5, 0.05, 100, accountant="rdp", history=prior)


def test_an_identical_resume_says_nothing_and_keeps_the_uninterrupted_budget():
    model, optimizer, engine = _engine(target_epsilon=1.0, steps=12, accountant="rdp", budget="strict")
    _steps(engine, model, optimizer, 5)
    model, optimizer, resumed, said = _resume(engine.state_dict(), target_epsilon=1.0, steps=12, accountant="rdp",
                                              budget="strict")
    assert said == []
    _steps(resumed, model, optimizer, 7)  # the rest of the plan
    uninterrupted = accounting.compute_epsilon(resumed.noise_multiplier, B / N, 12, resumed.target_delta, "rdp")
    assert resumed.get_epsilon() == pytest.approx(uninterrupted, rel=1e-12)
    limit = resumed._budget.limit()
    if limit > 12:
        _steps(resumed, model, optimizer, limit - 12, seed=2)
    with pytest.raises(PrivacyBudgetExceeded, match=f"step {limit + 1} would spend"):
        _steps(resumed, model, optimizer, 1, seed=3)
    assert resumed.get_epsilon() <= 1.0


# --------------------------------------------------------------------------- other values at resume
def test_resuming_into_another_sample_size_says_what_it_did():
    model, optimizer, engine = _engine(noise_multiplier=1.0, accountant="rdp")
    _steps(engine, model, optimizer, 6)
    model, optimizer, resumed, said = _resume(engine.state_dict(), noise_multiplier=1.0, sample_size=2 * N,
                                              accountant="rdp")
    assert len(said) == 1
    assert "sample_size 400 -> 800" in said[0] and "sample_rate 0.1 -> 0.05" in said[0]
    assert ("The dataset size changed from 400 to 800: the checkpoint's steps stay accounted at their q = 0.1, "
            "the next ones at q = batch_size / sample_size = 0.05") in said[0]
    _steps(resumed, model, optimizer, 4)
    delta = resumed.target_delta
    assert resumed.get_epsilon() == pytest.approx(
        accounting.epsilon_of_history([(1.0, 0.1, 6), (1.0, 0.05, 4)], delta, "rdp"), rel=1e-12)
    history = resumed.privacy_report()["history"]
    assert [(h["sample_size"], h["sample_rate"], h["steps"]) for h in history] == [(400, 0.1, 6), (800, 0.05, 4)]


def test_resuming_into_another_max_batch_size_pays_each_segments_truncation():
    model, optimizer, engine = _engine(noise_multiplier=1.0, max_batch_size=70, accountant="rdp")
    _steps_fixed_shape(engine, model, optimizer, 5, 70)
    model, optimizer, resumed, said = _resume(engine.state_dict(), noise_multiplier=1.0, max_batch_size=66,
                                              accountant="rdp")
    assert len(said) == 1 and "max_batch_size 70 -> 66" in said[0]
    _steps_fixed_shape(resumed, model, optimizer, 3, 66)
    truncation = accounting.truncation_delta(N, 0.1, 70, 5) + accounting.truncation_delta(N, 0.1, 66, 3)
    assert truncation > 1e-9  # (not negligible: the test tells the segments apart)
    assert truncation != pytest.approx(accounting.truncation_delta(N, 0.1, 66, 8), rel=1e-3)
    report = resumed.privacy_report()
    assert report["truncation_delta"] == pytest.approx(truncation, rel=1e-12)
    assert report["epsilon"] == pytest.approx(
        accounting.compute_epsilon(1.0, 0.1, 8, resumed.target_delta - truncation, "rdp"), rel=1e-12)


def _steps_fixed_shape(engine, model, optimizer, count, k):
    loader = poisson_loader(_dataset(), batch_size=B, steps=count, max_batch_size=k,
                            generator=torch.Generator().manual_seed(0))
    for (x, y), mask in loader:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"), mask=mask)
        optimizer.step()
        optimizer.zero_grad()


def test_a_checkpoint_of_another_privacy_unit_is_refused_and_changes_nothing():
    model, optimizer, engine = _engine(noise_multiplier=1.0, accountant="rdp")
    _steps(engine, model, optimizer, 3)
    model, optimizer, users = _engine(noise_multiplier=1.0, accountant="rdp", batch_size=10, sample_size=100,
                                      privacy_unit="user")
    with pytest.raises(ValueError, match=r"privacy_unit='example'.*do not compose.*privacy_unit='example'"):
        users.load_state_dict(engine.state_dict())
    assert users.steps_taken == 0 and users.accountant.history == [] and users.get_epsilon() == 0.0


def test_an_older_checkpoint_loads_with_this_engines_values_and_says_so():
    model, optimizer, engine = _engine(noise_multiplier=1.0, accountant="rdp")
    _steps(engine, model, optimizer, 4)
    state = engine.state_dict()
    del state["ledger"]  # written before the ledger existed
    model, optimizer, resumed, said = _resume(state, noise_multiplier=1.0, accountant="rdp")
    assert len(said) == 1 and "older dptrain" in said[0] and "its 4 steps are taken as this engine's" in said[0]
    assert resumed.get_epsilon() == engine.get_epsilon() and resumed.steps_taken == 4
    _steps(resumed, model, optimizer, 2)
    assert resumed.get_epsilon() == pytest.approx(
        accounting.compute_epsilon(1.0, 0.1, 6, resumed.target_delta, "rdp"), rel=1e-12)


def test_a_ledger_that_disagrees_with_its_accountant_is_refused():
    model, optimizer, engine = _engine(noise_multiplier=1.0, accountant="rdp")
    _steps(engine, model, optimizer, 4)
    state = engine.state_dict()
    state["ledger"]["segments"][0][-1] = 3
    model, optimizer, resumed = _engine(noise_multiplier=1.0, accountant="rdp")
    with pytest.raises(ValueError, match="not a consistent dptrain engine state"):
        resumed.load_state_dict(state)
    assert resumed.steps_taken == 0 and resumed.accountant.history == []


# --------------------------------------------------------------------------- delta
def test_a_delta_of_at_least_one_over_n_warns_or_is_refused():
    with pytest.warns(UserWarning, match=r"target_delta=0.5 is at least 1/sample_size = 1/400.*name and shame"):
        _engine(noise_multiplier=1.0, target_delta=0.5)
    with pytest.raises(ValueError, match=r"target_delta=0.0025 is at least 1/sample_size.*budget='strict'"):
        _engine(target_epsilon=1.0, steps=10, target_delta=1 / N, budget="strict")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = _engine(target_epsilon=1.0, steps=10, target_delta=0.99 / N, budget="strict")[2]
    with pytest.warns(UserWarning, match="delta=0.01 is at least 1/sample_size"):
        engine.get_epsilon(0.01)
    with pytest.warns(UserWarning, match="publishing one randomly chosen user in full"):
        _engine(noise_multiplier=1.0, batch_size=10, sample_size=100, privacy_unit="user", target_delta=0.02)
