"""The engine's accounting, noise calibration, loaders, virtual batches and checkpoints."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import compute_epsilon
from dptrain.data import poisson_loader, split_batches

N, FEATURES, CLASSES = 64, 5, 3


def make_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, FEATURES, generator=g), torch.randint(0, CLASSES, (N,), generator=g))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def train_steps(model, engine, optimizer, batches):
    for x, y in batches:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.step()
        optimizer.zero_grad()


def test_calibrated_engine_spends_at_most_the_target():
    model = make_model()
    engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, target_epsilon=2.0, epochs=3, accountant="rdp")
    steps = engine.planned_steps
    assert steps == 12  # 3 epochs of 1/q = 4 steps
    spent = compute_epsilon(engine.noise_multiplier, 16 / N, steps, engine.target_delta, accountant="rdp")
    assert 0.99 * 2.0 <= spent <= 2.0
    assert engine.target_delta == pytest.approx(1 / (10 * N))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of noise_multiplier or target_epsilon"),
        ({"noise_multiplier": 1.0, "target_epsilon": 3.0, "epochs": 1}, "exactly one of noise_multiplier or target_epsilon"),
        ({"target_epsilon": 3.0}, "epochs or steps"),
        ({"target_epsilon": 3.0, "epochs": 1, "steps": 4}, "epochs or steps"),
        ({"target_epsilon": 0.0, "steps": 10}, "target_epsilon"),
        ({"target_epsilon": 1e-3, "target_delta": 1e-12, "steps": 10_000}, "unreachable"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ],
)
def test_noise_configuration_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dptrain.PrivacyEngine(make_model(), batch_size=16, sample_size=N, **kwargs)


def test_epsilon_counts_every_logical_step_with_the_sigma_used():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=1.3, accountant="rdp", seed=0)
    engine.attach(optimizer)
    x, y = make_data().tensors
    for step in range(3):  # the second step is an empty Poisson batch: it still counts
        batch = slice(0, 0) if step == 1 else slice(0, 16)
        engine.backward(F.cross_entropy(model(x[batch]), y[batch], reduction="none"))
        optimizer.step()
    assert engine.steps_taken == 3 and engine.accountant.history == [(1.3, 16 / N, 3)]
    assert engine.get_epsilon(1e-5) == pytest.approx(compute_epsilon(1.3, 16 / N, 3, 1e-5, accountant="rdp"))
    report = engine.privacy_report(1e-5)
    assert report["steps"] == 3 and report["accountant"] == "rdp" and report["epsilon"] > 0


def test_split_run_equals_unsplit_run_exactly(float64):
    """Virtual batches: a logical Poisson batch cut into physical ones gives the same update (sigma = 0)."""
    dataset = make_data()
    results = []
    for physical in (None, 3):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=0.0)
        loader = poisson_loader(dataset, batch_size=16, generator=torch.Generator().manual_seed(1))
        engine.attach(optimizer, data_loader=loader)
        logical_batches = split_batches(loader, physical) if physical else ([batch] for batch in loader)
        sizes = []
        for logical in logical_batches:
            parts = list(logical)
            sizes.append(len(parts))
            for x, y in parts:
                engine.backward(F.cross_entropy(model(x), y, reduction="none"))
            optimizer.step()
            optimizer.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], engine.steps_taken, sizes))
    (unsplit, steps_a, _), (split, steps_b, sizes) = results
    assert steps_a == steps_b == 4
    assert max(sizes) > 1  # some logical batch really was split
    for a, b in zip(unsplit, split):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reproducible_noise", [False, True])
def test_resumed_run_continues_like_an_uninterrupted_one(tmp_path, reproducible_noise):
    """Same epsilon, steps and batches; the same parameters number for number only when the saved noise
    stream is continued on purpose (reproducible_noise=True); by default the noise after loading is fresh."""
    dataset = make_data()

    def fresh():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=0.8, seed=7)
        loader = poisson_loader(dataset, batch_size=16, steps=6, generator=torch.Generator().manual_seed(3))
        engine.attach(optimizer, data_loader=loader)
        return model, optimizer, engine, loader

    model, optimizer, engine, loader = fresh()
    train_steps(model, engine, optimizer, loader)
    uninterrupted = [p.detach().clone() for p in model.parameters()], engine.get_epsilon()

    model, optimizer, engine, loader = fresh()
    batches = iter(loader)
    train_steps(model, engine, optimizer, (next(batches) for _ in range(2)))
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "engine": engine.state_dict(), "loader": loader.state_dict()}, checkpoint)

    model, optimizer, engine, loader = fresh()
    state = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if reproducible_noise:
        with pytest.warns(UserWarning, match="reproducible_noise=True"):
            engine.load_state_dict(state["engine"], reproducible_noise=True)
    else:
        engine.load_state_dict(state["engine"])
    loader.load_state_dict(state["loader"])
    assert engine.steps_taken == 2
    train_steps(model, engine, optimizer, loader)
    assert engine.steps_taken == 6
    assert engine.get_epsilon() == pytest.approx(uninterrupted[1], rel=1e-12)
    if reproducible_noise:
        for a, b in zip(uninterrupted[0], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    else:  # fresh noise on the same batches: a different run (the noise std is 0.8 R / 16 per coordinate)
        assert all(not torch.equal(a, b.detach()) for a, b in zip(uninterrupted[0], model.parameters()))


def test_secure_rng_refuses_a_seed_and_draws_fresh_noise():
    with pytest.raises(ValueError, match="operating system"):
        dptrain.PrivacyEngine(make_model(), batch_size=16, sample_size=N, noise_multiplier=1.0, secure_rng=True, seed=1)
    grads = []
    for _ in range(2):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=1.0, secure_rng=True)
        engine.attach(optimizer)
        optimizer.step()  # an empty step: pure noise
        grads.append(model[0].weight.grad.clone())
        assert "generators" not in engine.state_dict()["noise"]
    assert not torch.equal(grads[0], grads[1])


def test_secure_noise_combines_independent_streams_and_is_standard_gaussian(monkeypatch):
    from dptrain.noise import GaussianNoise

    # torch's CPU generator keeps 32 bits of a seed: the secure noise must not hinge on one such seed.
    import os

    drawn = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: drawn.append(real(n)) or drawn[-1])
    noise = GaussianNoise(secure=True)
    x = noise.sample(torch.empty(200_000), std=2.0)
    # GaussianNoise's own default seed draw, then one fresh OS seed per stream: 4 x 32 usable bits.
    assert GaussianNoise.SECURE_STREAMS >= 4
    assert len(drawn) >= GaussianNoise.SECURE_STREAMS
    assert len({(int.from_bytes(b, "little") >> 1) % 2**32 for b in drawn[-GaussianNoise.SECURE_STREAMS:]}) == 4
    # N(0, 4): sample std within 1 % (about 3.2 standard errors at n = 200k), mean and kurtosis as a Gaussian's.
    assert abs(float(x.std()) - 2.0) < 0.02
    assert abs(float(x.mean())) < 5 * 2.0 / 200_000**0.5
    kurtosis = float(((x / x.std()) ** 4).mean())
    assert abs(kurtosis - 3.0) < 0.1


def test_shuffling_loader_warns_once_and_mismatched_poisson_loader_is_refused():
    dataset = make_data()
    engine = dptrain.PrivacyEngine(make_model(), batch_size=16, sample_size=N, noise_multiplier=1.0)
    shuffling = DataLoader(dataset, batch_size=16, shuffle=True)
    with pytest.warns(UserWarning, match="Poisson sampling"):
        engine._check_loader(shuffling)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine._check_loader(shuffling)  # said once only
    with pytest.raises(ValueError, match="q=0.5"):
        engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.1), data_loader=poisson_loader(dataset, batch_size=32))
