"""No private gradient leaves the private model (issue 31): a loss module or a second model outside the model given to
the engine never gets the private batch's raw gradient, and a GAN's generator step through the private discriminator
works as people write it (plainly, with the discriminator frozen, or inside ``engine.paused()``): the generator gets
its exact gradient and the discriminator's private state is left alone. Float64, noise 0.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import attached_engine, neighbour_test
from helpers import MODES, SINGLE_BACKWARD_MODES

R = 1e-3


def _generator():
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))


def _discriminator():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _bce(logits, target: float):
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target), reduction="none").squeeze(1)


# ------------------------------------------------------------------------------------------ loss modules
class MarginHead(nn.Module):
    """An ArcFace-like margin head: class weights of its own, trained by the loss."""

    def __init__(self, dim=5, classes=4):
        super().__init__()
        self.W = nn.Parameter(torch.randn(classes, dim))

    def forward(self, z, y):
        cos = F.normalize(z, dim=1) @ F.normalize(self.W, dim=1).T
        return F.cross_entropy(8 * (cos - 0.2 * F.one_hot(y, cos.shape[1])), y, reduction="none")


@pytest.mark.parametrize("mode", MODES)
def test_a_trainable_loss_module_outside_the_model_is_refused(float64, mode):
    torch.manual_seed(0)
    model, head = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double(), MarginHead().double()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R)
    try:
        x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))
        with pytest.raises(ValueError, match="outside the model given to the engine") as refusal:
            engine.backward(head(model(x), y))
        assert "(4, 5)" in str(refusal.value) and "margin head" in str(refusal.value)
        assert head.W.grad is None and all(p.grad is None for p in model.parameters())
        # the fix the message gives: the head's parameters detached (or the head inside the model)
        W = head.W.detach()
        z = model(x)
        cos = F.normalize(z, dim=1) @ F.normalize(W, dim=1).T
        engine.backward(F.cross_entropy(8 * cos, y, reduction="none"))
        opt.step()
    finally:
        engine.detach()


# ------------------------------------------------------------------------------------------ a GAN
def _generator_step(G, D, engine, z, how):
    """The generator's loss back-propagated through D as the loop writes it (``how``)."""
    if how == "paused":
        with engine.paused():
            _bce(D(G(z)), 1.0).mean().backward()
    elif how == "frozen":
        D.requires_grad_(False)
        try:
            _bce(D(G(z)), 1.0).mean().backward()
        finally:
            D.requires_grad_(True)
    else:
        _bce(D(G(z)), 1.0).mean().backward()


@pytest.mark.parametrize("how", ["plainly", "frozen", "paused"])
@pytest.mark.parametrize("mode", MODES)
def test_the_generator_step_through_the_private_discriminator_is_exact_and_leaves_it_alone(float64, mode, how):
    torch.manual_seed(0)
    G, D = _generator().double(), _discriminator().double()
    reference_G, reference_D = copy.deepcopy(G), copy.deepcopy(D)
    engine, optD = attached_engine(D, mode=mode, max_grad_norm=R)
    try:
        z = torch.randn(8, 3)
        _generator_step(G, D, engine, z, how)
        _bce(reference_D(reference_G(z)), 1.0).mean().backward()
        for p, q in zip(G.parameters(), reference_G.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        assert all(p.grad is None for p in D.parameters())
        optD.step()  # nothing private was back-propagated: the step adds noise (0 here) to nothing
        assert all(p.grad is None or not p.grad.any() for p in D.parameters())
        assert engine.steps_taken == 1
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_the_generator_step_through_engine_backward_is_refused(float64, mode):
    """What the two-pass modes' refusal of a plain backward used to suggest: the generator would get the clipped and
    re-weighted gradients of both passes (1.5 to 1.9 times its own)."""
    torch.manual_seed(0)
    G, D = _generator().double(), _discriminator().double()
    engine, _ = attached_engine(D, mode=mode, max_grad_norm=R)
    try:
        with pytest.raises(ValueError, match="generator's loss plainly"):
            engine.backward(_bce(D(G(torch.randn(8, 3))), 1.0))
        assert all(p.grad is None for p in G.parameters())
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_discriminator_step_on_generated_samples_not_detached_is_refused(float64, mode):
    """D trained on real and generated samples in one plain backward, the generated ones not detached: the model
    call on them would go untrained, silently."""
    torch.manual_seed(0)
    G, D = _generator().double(), _discriminator().double()
    engine, _ = attached_engine(D, mode=mode, max_grad_norm=R)
    try:
        real, fake = torch.randn(8, 4), G(torch.randn(8, 3))
        with pytest.raises(ValueError, match="D\\(fake.detach\\(\\)\\)"):
            (_bce(D(real), 1.0) + _bce(D(fake), 0.0)).mean().backward()
    finally:
        engine.detach()


def _gan_steps(D, G, real, z, mode, how, steps=3):
    """A tiny DP-GAN: D private (noise 0, lr 0.1), G not; the D updates of each step, as one flat vector."""
    engine, optD = attached_engine(D, mode=mode, max_grad_norm=R, lr=0.1)
    optG = torch.optim.SGD(G.parameters(), lr=0.1)
    try:
        for _ in range(steps):
            optD.zero_grad()
            fake = G(z).detach()  # (the discriminator step: the generated samples detached)
            logits = D(torch.cat([real, fake]))
            target = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)])
            engine.backward(F.binary_cross_entropy_with_logits(logits, target, reduction="none").squeeze(1))
            optD.step()
            optG.zero_grad()
            _generator_step(G, D, engine, z, how)
            optG.step()
        return torch.cat([p.detach().flatten() for p in D.parameters()])
    finally:
        engine.detach()


@pytest.mark.parametrize("how", ["plainly", "frozen", "paused"])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_dp_gan_moves_the_discriminator_by_at_most_r_per_step_for_one_real_sample(float64, mode, how):
    """The neighbour test on D's first update: the real batch with and without one sample (the generator's samples
    are not private; G trains on D's output, post-processing)."""
    torch.manual_seed(0)
    G, D = _generator().double(), _discriminator().double()
    real, z = torch.randn(6, 4), torch.randn(6, 3)
    start = torch.cat([p.detach().flatten() for p in D.parameters()])
    full = _gan_steps(copy.deepcopy(D), copy.deepcopy(G), real, z, mode, how, steps=1)
    without = _gan_steps(copy.deepcopy(D), copy.deepcopy(G), real[1:], z, mode, how, steps=1)
    # one private step of lr 0.1: the real sample's clipped gradient moves D by at most 0.1 R; the generated samples
    # are the same in both runs (G is the same before its first step)
    assert float((full - without).norm()) <= 0.1 * R * (1 + 1e-9)
    assert float((full - start).norm()) > 0  # (the step trained D: the test tests something)
    # and the whole loop runs its steps, G's included, in every way of writing the generator step
    _gan_steps(copy.deepcopy(D), copy.deepcopy(G), real, z, mode, how, steps=3)


def test_the_neighbour_test_sees_a_loss_module_refused(float64):
    """The public neighbour test reports the refusal of a step (nothing released) rather than a distance."""
    torch.manual_seed(0)
    model, head = nn.Sequential(nn.Linear(6, 5)).double(), MarginHead().double()
    x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))
    with pytest.raises(ValueError, match="outside the model"):
        neighbour_test(model, lambda m, x, y: head(m(x), y), (x, y), max_grad_norm=R)
    report = neighbour_test(model, lambda m, x, y: head.forward(m(x), y).detach() * 0 + F.cross_entropy(
        m(x)[:, :4], y, reduction="none"), (x, y), max_grad_norm=R)
    assert report.worst <= 1 + 1e-9 and not math.isnan(report.worst)
