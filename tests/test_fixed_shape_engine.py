"""PrivacyEngine(..., max_batch_size=K): needs the engine change described in the fixed-shape report."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dptrain import PrivacyEngine, accounting
from dptrain.data import masked_losses, poisson_loader

N, B = 1_000, 50
Q = B / N


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _data():
    return TensorDataset(torch.randn(N, 4), torch.randint(0, 3, (N,)))


def test_epsilon_and_report_include_the_truncation_term():
    k = accounting.default_max_batch_size(N, Q, 1e-5, 20)
    model = _model()
    engine = PrivacyEngine(model, batch_size=B, sample_size=N, noise_multiplier=1.0, max_batch_size=k)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = poisson_loader(_data(), batch_size=B, max_batch_size=k, steps=20, generator=torch.Generator().manual_seed(0))
    engine.attach(optimizer, data_loader=loader)
    for (x, y), mask in loader:
        engine.backward(masked_losses(F.cross_entropy(model(x), y, reduction="none"), mask))
        optimizer.step()
        optimizer.zero_grad()
    assert engine.steps_taken == 20 and engine.max_batch_size == k
    expected = accounting.compute_epsilon(1.0, Q, 20, 1e-5, sample_size=N, max_batch_size=k)
    assert engine.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert engine.get_epsilon(1e-5) > accounting.compute_epsilon(1.0, Q, 20, 1e-5)
    report = engine.privacy_report(1e-5)
    assert report["max_batch_size"] == k
    assert report["truncation_delta"] == accounting.truncation_delta(N, Q, k, 20)
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_calibration_leaves_the_truncation_term_out_of_the_accountants_delta():
    k = accounting.default_max_batch_size(N, Q, 1e-5, 100)
    engine = PrivacyEngine(_model(), batch_size=B, sample_size=N, target_epsilon=2.0, steps=100, max_batch_size=k,
                           target_delta=1e-5)
    assert engine.noise_multiplier == accounting.calibrate_noise_multiplier(
        2.0, 1e-5, Q, 100, sample_size=N, max_batch_size=k)
    plain = PrivacyEngine(_model(), batch_size=B, sample_size=N, target_epsilon=2.0, steps=100, target_delta=1e-5)
    assert engine.noise_multiplier >= plain.noise_multiplier


def test_without_max_batch_size_nothing_changes():
    engine = PrivacyEngine(_model(), batch_size=B, sample_size=N, noise_multiplier=1.0)
    assert engine.max_batch_size is None
    report = engine.privacy_report()
    assert report["max_batch_size"] is None and report["truncation_delta"] == 0.0


def test_loader_and_engine_must_agree_on_k():
    data = _data()
    for engine_k, loader_k in [(60, 70), (None, 70), (60, None)]:
        model = _model()
        engine = PrivacyEngine(model, batch_size=B, sample_size=N, noise_multiplier=1.0, max_batch_size=engine_k)
        loader = poisson_loader(data, batch_size=B, max_batch_size=loader_k)
        with pytest.raises(ValueError, match="max_batch_size"):
            engine.attach(torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader)


def test_bad_max_batch_size_values():
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
            PrivacyEngine(_model(), batch_size=B, sample_size=N, noise_multiplier=1.0, max_batch_size=bad)
    with pytest.raises(ValueError, match="truncates too often"):  # calibration: no delta left for the accountant
        PrivacyEngine(_model(), batch_size=B, sample_size=N, target_epsilon=2.0, steps=100, max_batch_size=B)
