"""Correlated noise in the engine: its covariance, its exact stream, DP-SGD as one band, resume, the cyclic
loader's step check, every clipping mode at noise 0, calibration, budget, user-level units and data parallelism."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dptrain
from dptrain import accounting
from dptrain.core.noise import GaussianNoise
from dptrain.correlated import plan_noise
from dptrain.correlated import toeplitz as T
from dptrain.correlated.strategies import BandedToeplitz, BufferedToeplitz
from dptrain.data import poisson_loader

BANDED = BandedToeplitz(tuple(np.array([0.8, 0.5, 0.33]) / np.linalg.norm([0.8, 0.5, 0.33])))
BLT = BufferedToeplitz((0.9, 0.5), (0.25, 0.3))
N, FEATURES, CLASSES = 96, 6, 3


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTRAIN_CACHE_DIR", str(tmp_path / "strategies"))


def make_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, FEATURES, generator=g), torch.randint(0, CLASSES, (N,), generator=g))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def noise_only_engine(model, strategy, steps, seed, **kwargs):
    """An engine whose steps take no backward: each p.grad is the step's noise (batch size 1, sigma R = 1)."""
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=64, noise=strategy, noise_multiplier=1.0,
                                   steps=steps, seed=seed, cyclic_groups=4, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no loader to check
        engine.attach(optimizer)
    return engine, optimizer


def expected_covariance(strategy, n):
    """kappa^2 C^{-1} C^{-T}: the noise of step t is kappa (C^{-1} z)_t."""
    column = torch.as_tensor(strategy.column(n))
    inverse = T.materialize(T.series_inverse(column, n))
    return float(column.norm()) ** 2 * (inverse @ inverse.T)


def assert_covariance(samples: torch.Tensor, expected: torch.Tensor):
    """Every entry of the empirical covariance of ``samples`` [N, n] within 5 standard errors of ``expected``
    (Var of a sample covariance: (S_ii S_jj + S_ij^2) / N for Gaussian vectors)."""
    count = samples.shape[0]
    empirical = samples.T @ samples / count  # mean zero by construction
    diag = torch.diagonal(expected)
    stderr = torch.sqrt((diag[:, None] * diag[None, :] + expected**2) / count)
    z = (empirical - expected).abs() / stderr
    assert float(z.max()) < 5.0, (empirical, expected)


@pytest.mark.parametrize("strategy", [BANDED, BLT], ids=["banded", "blt"])
@pytest.mark.parametrize("resume_at", [None, 3])
def test_noise_has_the_covariance_of_the_strategy(strategy, resume_at):
    """Each coordinate's noise over the steps is kappa C^{-1} z: its n x n covariance is kappa^2 C^{-1} C^{-T}.
    A resume in the middle (fresh i.i.d. draws, the buffers restored) keeps it: the steps after the resume are
    still correlated with those before."""
    n, samples = 6, []
    for seed in range(4):
        model = nn.Linear(40, 50)  # 2050 coordinates, each an independent draw of the n-step noise
        engine, optimizer = noise_only_engine(model, strategy, n, seed)
        steps = []
        for t in range(n):
            if t == resume_at:
                state = engine.state_dict()
                engine.detach()
                engine, optimizer = noise_only_engine(model, strategy, n, seed + 100)
                engine.load_state_dict(state)
            optimizer.step()
            steps.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
        samples.append(torch.stack(steps, 1))
    samples = torch.cat(samples)  # [8200, n]
    assert_covariance(samples, expected_covariance(strategy, n))
    # and it is not white: the correlation the strategy implies is there (C^{-1} of a decaying C is negative off
    # the diagonal)
    assert float((samples[:, 1] * samples[:, 0]).mean()) < -0.1


def test_noise_is_row_t_of_the_inverse_applied_to_the_draws_and_restarts_where_a_parameter_skipped_a_step():
    """The exact stream: the same seeded draws through C^{-1}, per parameter, in the optimizer's order. The bias of
    the first layer is frozen at step 2: it draws nothing there, and its stream restarts at step 3."""
    model, n = make_model(), 6
    engine, optimizer = noise_only_engine(model, BANDED, n, seed=11)
    got: dict[str, list] = {name: [] for name, _ in model.named_parameters()}
    for t in range(n):
        model[0].bias.requires_grad_(t != 2)
        optimizer.step()
        for name, p in model.named_parameters():
            got[name].append(None if p.grad is None else p.grad.clone())
        optimizer.zero_grad()
    reference = GaussianNoise(seed=11)
    draws: dict[str, list] = {name: [] for name in got}
    for t in range(n):
        for name, p in model.named_parameters():
            if not (name == "0.bias" and t == 2):
                draws[name].append((t, reference.sample(p.detach(), 1.0)))
    assert got["0.bias"][2] is None  # frozen at step 2: no gradient at all
    inverse = T.series_inverse(torch.as_tensor(BANDED.column(n)), n).float()
    for name, stream in draws.items():
        gaps = [i for i in range(1, len(stream)) if stream[i][0] != stream[i - 1][0] + 1]
        bounds = [0, *gaps, len(stream)]
        for begin, end in zip(bounds, bounds[1:]):  # each run of consecutive steps is one stream of C^{-1}
            segment = stream[begin:end]
            for i, (t, _) in enumerate(segment):
                expected = sum(inverse[i - j] * segment[j][1] for j in range(i + 1))
                torch.testing.assert_close(got[name][t], expected, rtol=1e-5, atol=1e-6)
    assert len(draws["0.bias"]) == 5 and [t for t, _ in draws["0.bias"]] == [0, 1, 3, 4, 5]


def step(model, engine, optimizer, x, y, record=None):
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    optimizer.step()
    if record is not None:
        record.append([p.grad.clone() for p in model.parameters()])
    optimizer.zero_grad()


def train(model, engine, optimizer, loader, steps, record=None):
    while engine.steps_taken < steps:
        for x, y in loader:
            step(model, engine, optimizer, x, y, record)
            if engine.steps_taken == steps:
                break


def setup(noise="gaussian", groups=None, seed=3, steps=12, **kwargs):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    privacy = {} if "target_epsilon" in kwargs else {"noise_multiplier": 0.8}  # (a calibration costs ~1 s)
    engine = dptrain.PrivacyEngine(model, batch_size=12, sample_size=N, noise=noise, cyclic_groups=groups,
                                   steps=steps, seed=seed, **privacy, **kwargs)
    loader = poisson_loader(make_data(), batch_size=12, cyclic_groups=groups,
                            generator=torch.Generator().manual_seed(5))
    engine.attach(optimizer, data_loader=loader)
    return model, optimizer, engine, loader


def test_one_band_is_dp_sgd_exactly():
    """noise='bandmf' with bands=1 (and one group): the same noise multiplier, epsilon and private gradients, draw
    for draw, as noise='gaussian'."""
    runs = []
    for noise, kwargs in (("gaussian", {"target_epsilon": 3.0}), ("bandmf", {"bands": 1, "target_epsilon": 3.0})):
        model, optimizer, engine, loader = setup(noise, **kwargs)
        grads = []
        train(model, engine, optimizer, loader, 12, grads)
        runs.append((engine, grads))
    (dp_sgd, g0), (band, g1) = runs
    assert band.noise_multiplier == dp_sgd.noise_multiplier
    assert band.get_epsilon() == dp_sgd.get_epsilon()
    for a, b in zip(g0, g1):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_banded_noise_is_correlated_beyond_the_bands():
    """C has b bands, not the noise: C^{-1} is dense, so steps b and more apart still correlate (the docs' example:
    the optimized 4-banded strategy of a 12-step run correlates steps 1 and 5 by +0.18)."""
    from dptrain.correlated import banded_strategy

    covariance = expected_covariance(banded_strategy(12, 4), 12)
    scale = torch.diagonal(covariance).sqrt()
    correlation = covariance / scale[:, None] / scale[None, :]
    assert round(float(correlation[4, 0]), 2) == 0.18
    assert float(correlation[8, :5].abs().min()) > 0.02  # step 9 and each step 4 to 8 before it: still correlated


@pytest.mark.parametrize("noise,groups,kwargs", [("bandmf", 3, {"bands": 3}), ("blt", 3, {"buffers": 2})])
def test_resume_mid_run_continues_the_correlated_stream(tmp_path, noise, groups, kwargs):
    """Seeded and reproducible_noise=True: the resumed run is the uninterrupted one, number for number (the
    buffers, the step count and the loader's groups and position come back)."""
    model, optimizer, engine, loader = setup(noise, groups, **kwargs)
    train(model, engine, optimizer, loader, 12)
    uninterrupted = [p.detach().clone() for p in model.parameters()], engine.get_epsilon()

    model, optimizer, engine, loader = setup(noise, groups, **kwargs)
    batches = iter(loader)
    for _ in range(5):
        step(model, engine, optimizer, *next(batches))
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "engine": engine.state_dict(),
                  "loader": loader.state_dict()}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # plain data
    assert state["engine"]["noise"]["streams"]  # the buffers are in it

    model, optimizer, engine, loader = setup(noise, groups, seed=99, **kwargs)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    with pytest.warns(UserWarning, match="reproducible_noise=True"):
        engine.load_state_dict(state["engine"], reproducible_noise=True)
    loader.load_state_dict(state["loader"])
    train(model, engine, optimizer, loader, 12)
    assert engine.get_epsilon() == pytest.approx(uninterrupted[1], rel=1e-12)
    for a, b in zip(uninterrupted[0], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_a_step_must_train_on_the_cyclic_loaders_batch_of_that_step():
    model, optimizer, engine, loader = setup("bandmf", 4, bands=4)
    batches = iter(loader)
    for _ in range(2):
        step(model, engine, optimizer, *next(batches))
    next(batches)  # a batch skipped: step 2 would train on group 3
    x, y = next(batches)
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="step 2 .* must train on the loader's batch 2"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing applied
    assert engine.steps_taken == 2

    model, optimizer, engine, loader = setup("bandmf", 4, bands=4)
    with pytest.raises(RuntimeError, match="no batch from it yet"):
        optimizer.step()


def test_loader_and_engine_must_agree_on_the_groups():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=12, sample_size=N, noise=BANDED, noise_multiplier=1.0, steps=8)
    assert engine.cyclic_groups == 3 and engine.sample_rate == pytest.approx(12 * 3 / N)
    with pytest.raises(ValueError, match="cyclic_groups=1 but the engine .* cyclic_groups=3"):
        engine.attach(optimizer, data_loader=poisson_loader(make_data(), batch_size=12))
    with pytest.raises(ValueError, match="cyclic_groups=3 but the engine .* cyclic_groups=1"):
        dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, noise_multiplier=1.0).attach(
            torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=poisson_loader(make_data(), batch_size=12, cyclic_groups=3))
    with pytest.warns(UserWarning, match="no data_loader was given"):
        engine.attach(optimizer)


@pytest.mark.parametrize("kwargs,message", [
    ({"noise": "bandmf"}, "needs bands=b"),
    ({"noise": "bandmf", "bands": 4, "cyclic_groups": 2}, "cyclic_groups=2 is below bands=4"),
    ({"noise": "gaussian", "bands": 2}, "bands applies to correlated noise"),
    ({"noise": "gaussian", "cyclic_groups": 2}, "cyclic_groups applies to correlated noise"),
    ({"noise": "blt", "bands": 2}, "bands applies to noise='bandmf'"),
    ({"noise": "bandmf", "bands": 2, "buffers": 2}, "buffers applies to noise='blt'"),
    ({"noise": "bandmf", "bands": 9}, "batch_size \\* cyclic_groups <= sample_size"),
    ({"noise": "tree"}, "unknown noise 'tree'"),
    ({"noise": "blt", "workload_momentum": 1.0}, "workload_momentum must be in \\[0, 1\\)"),
])
def test_bad_noise_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, noise_multiplier=1.0, steps=8, **kwargs)


def test_correlated_noise_needs_the_planned_length():
    with pytest.raises(ValueError, match="needs the planned length of training"):
        dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, noise="bandmf", bands=2,
                              noise_multiplier=1.0)


def test_checkpoints_resume_only_into_the_same_mechanism():
    model, optimizer, engine, loader = setup("bandmf", 3, bands=3)
    train(model, engine, optimizer, loader, 2)
    state = engine.state_dict()
    gaussian = dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, target_epsilon=3.0, steps=12)
    with pytest.raises(ValueError, match="correlated noise"):
        gaussian.load_state_dict(state)
    other = dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, noise="bandmf", bands=2,
                                  cyclic_groups=3, target_epsilon=3.0, steps=12)
    with pytest.raises(ValueError, match="saved by the mechanism"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="independent Gaussian noise"):
        setup("bandmf", 3, bands=3)[2].load_state_dict(gaussian.state_dict())


@pytest.mark.parametrize("mode", dptrain.CLIPPING_MODES)
def test_noise_zero_leaves_every_clipping_mode_exact(mode):
    """At noise 0 the correlated source is never asked: the private gradient is the clipped sum, as DP-SGD's."""
    x, y = make_data().tensors
    grads = []
    for noise, kwargs in (("gaussian", {}), ("bandmf", {"bands": 2, "steps": 4})):
        model = make_model()
        reference = dptrain.testing.reference_clipped_gradient(
            model, lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"), (x[:10], y[:10]), max_grad_norm=0.1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = dptrain.PrivacyEngine(model, batch_size=10, sample_size=N, noise=noise, noise_multiplier=0.0,
                                       max_grad_norm=0.1, clipping_mode=mode, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.attach(optimizer)
        engine.backward(F.cross_entropy(model(x[:10]), y[:10], reduction="none"))
        optimizer.step()
        grads.append({n: p.grad * 10 for n, p in model.named_parameters()})
        for name, value in reference.items():
            torch.testing.assert_close(grads[-1][name], value.float(), rtol=1e-5, atol=1e-7)
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name])


def test_calibration_budget_and_fixed_shapes_with_cyclic_sampling():
    """target_epsilon is met after the planned steps; the truncation term of fixed-shape batches uses the
    per-step inclusion rate batch_size / N (each unit is in a step's batch with probability q / g); a strict
    budget refuses the step past the target."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=12, sample_size=N, noise=BANDED, target_epsilon=4.0, steps=12,
                                   max_batch_size=30, budget="strict", seed=0)
    loader = poisson_loader(make_data(), batch_size=12, cyclic_groups=3, max_batch_size=30,
                            generator=torch.Generator().manual_seed(1))
    engine.attach(optimizer, data_loader=loader)
    steps = 0
    with pytest.raises(dptrain.engine.PrivacyBudgetExceeded):
        while True:
            for (x, y), mask in loader:
                assert len(x) == 30
                engine.backward(F.cross_entropy(model(x), y, reduction="none"), mask=mask)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    report = engine.privacy_report()
    assert report["steps"] >= 12 and 0.99 * 4.0 <= engine.get_epsilon() <= 4.0
    assert report["truncation_delta"] == accounting.truncation_delta(N, 12 / N, 30, report["steps"])
    delta = accounting.poisson_delta(report["delta"], N, 12 / N, 30, report["steps"])
    assert engine.get_epsilon() == engine.config.mechanism.epsilon(engine.noise_multiplier, 12 * 3 / N,
                                                                   report["steps"], delta)
    assert report["noise"] == "bandmf" and report["cyclic_groups"] == 3
    assert report["strategy"] == BANDED.as_dict()


def test_user_level_units_with_cyclic_groups():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, FEATURES, generator=g), torch.randint(0, CLASSES, (120,), generator=g)
    users = torch.arange(120) // 3  # 40 users of 3 examples
    loader = poisson_loader(TensorDataset(x, y), batch_size=4, users=users, cyclic_groups=2,
                            generator=torch.Generator().manual_seed(2))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=40, privacy_unit="user", noise="bandmf",
                                   bands=2, target_epsilon=5.0, steps=8, seed=0)
    engine.attach(optimizer, data_loader=loader)
    sampler = loader.batch_sampler
    while engine.steps_taken < 8:
        for (bx, by), batch_users in loader:
            group = engine.steps_taken % 2
            assert all(int(sampler.group_of[u]) == group for u in batch_users.tolist())  # (ids are positions here)
            engine.backward(F.cross_entropy(model(bx), by, reduction="none"), users=batch_users)
            optimizer.step()
            optimizer.zero_grad()
            if engine.steps_taken == 8:
                break
    assert engine.get_epsilon() <= 5.0


def test_the_engine_state_holds_a_copy_of_the_buffers():
    """The buffers change in place at every step; a state taken before a step keeps the values of its time (on the
    CPU: no second copy on an accelerator)."""
    model = make_model()
    engine, optimizer = noise_only_engine(model, BANDED, 4, seed=0)
    optimizer.step()
    state = engine.state_dict()["noise"]["streams"]
    before = {name: s["values"].clone() for name, s in state.items()}
    optimizer.step()
    assert all(torch.equal(s["values"], before[name]) and s["values"].device.type == "cpu"
               for name, s in state.items())
    now = engine.state_dict()["noise"]["streams"]
    assert any(not torch.equal(s["values"], before[name]) for name, s in now.items())


def test_plan_noise_reports_the_buffers_the_engine_keeps():
    model = make_model()
    numbers = sum(p.numel() for p in model.parameters())
    assert plan_noise(model).bytes == 0
    banded = plan_noise(model, "bandmf", bands=3)
    assert (banded.buffers, banded.numbers_per_buffer, banded.bytes) == (2, numbers, 2 * 4 * numbers)
    assert plan_noise(model, "blt").buffers == 4 and plan_noise(model, "blt", buffers=2).bytes == 8 * numbers
    for strategy, plan in ((BANDED, banded), (BLT, plan_noise(model, "blt", buffers=2))):
        engine, optimizer = noise_only_engine(model, strategy, 4, seed=0)
        optimizer.step()
        assert engine._noise.memory_bytes() == plan.bytes
        engine.detach()
    with pytest.raises(ValueError, match="needs bands"):
        plan_noise(model, "bandmf")


def test_optimized_strategies_are_built_for_the_run():
    engine = dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, noise="bandmf", bands=3,
                                   target_epsilon=3.0, epochs=2)
    mechanism = engine.config.mechanism
    assert engine.planned_steps == mechanism.planned_steps == 16  # 2 epochs of round(96 / 12) steps
    assert mechanism.strategy.bands == 3 and mechanism.cyclic_groups == 3
    assert mechanism.strategy == dptrain.correlated.banded_strategy(16, 3)  # the cached optimum
    momentum = dptrain.PrivacyEngine(make_model(), batch_size=12, sample_size=N, noise="bandmf", bands=3,
                                     target_epsilon=3.0, epochs=2, workload_momentum=0.9)
    assert momentum.config.mechanism.strategy == dptrain.correlated.banded_strategy(16, 3, momentum=0.9)
    assert momentum.config.mechanism.strategy != mechanism.strategy
    # with cyclic groups the epsilon of the same noise multiplier is smaller than without amplification
    assert mechanism.epsilon(1.0, 12 * 3 / N, 16, 1e-5) < accounting.compute_epsilon(1.0, 1.0, 16, 1e-5)
    assert math.isfinite(engine.noise_multiplier)


def test_bands_auto_picks_dp_sgd_for_a_short_run_at_a_large_rate_and_bands_for_a_long_one(monkeypatch):
    """sigma_b^2 * error(C_b) at the target: b = 1 (DP-SGD) when amplification matters most, several bands when
    correlation does (the choice the engine then uses, with as many cyclic groups)."""
    from dptrain.correlated import resolve
    from dptrain.correlated.resolve import choose_bands

    monkeypatch.setattr(resolve, "AUTO_BAND_CANDIDATES", (1, 2))  # each costs an RDP calibration (~1 s)
    assert choose_bands(20, 25, 100, 2.0, 1e-5) == 1  # q = 0.25, 20 steps
    monkeypatch.setattr(resolve, "AUTO_BAND_CANDIDATES", (1, 4))
    engine = dptrain.PrivacyEngine(make_model(), batch_size=10, sample_size=300, noise="bandmf", bands="auto",
                                   target_epsilon=8.0, target_delta=1e-5, steps=60)  # q = 1 / 30, 60 steps
    assert engine.cyclic_groups == 4 == engine.config.mechanism.strategy.bands
    with pytest.raises(ValueError, match="bands='auto' chooses the bands for a target"):
        dptrain.PrivacyEngine(make_model(), batch_size=10, sample_size=300, noise="bandmf", bands="auto",
                              noise_multiplier=1.0, steps=60)
