"""What a step means: closures (``optimizer.step(closure)``), ``zero_grad()`` between a backward and the step,
and optimizers other than the attached one.

Each case is checked against the one-sample-at-a-time oracle (float64, clipping binding) in every mode and on
both backward paths, and at batch size 1 with noise 0, where the applied update must have norm <= R.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import attached_engine, reference_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, assert_matches, update_norm

R = 0.3
PATHS = [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (B,), generator=g)


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _backward(engine, model, batch, path):
    if path == "engine":
        engine.backward(_losses(model, *batch))
    else:
        _losses(model, *batch).sum().backward()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------- closures
@pytest.mark.parametrize("mode, path", PATHS)
def test_a_closure_step_applies_the_closures_batch_once(float64, mode, path):
    model = _model()
    batch = _data(5, seed=1)
    reference = reference_clipped_gradient(model, _losses, batch, max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")

    def closure():
        opt.zero_grad()
        _backward(engine, model, batch, path)
        return torch.zeros(())

    opt.step(closure)
    assert_matches(_grads(model), reference, what="step(closure)")
    assert engine.steps_taken == 1
    opt.step(closure)  # the next step evaluates it again: one batch per step
    assert_matches(_grads(model), reference, what="the second step(closure)")
    assert engine.steps_taken == 2


@pytest.mark.parametrize("mode, path", PATHS)
def test_one_sample_through_a_closure_moves_the_model_at_most_r(float64, mode, path):
    model = _model()
    before = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    sample = _data(1, seed=2)

    def closure():
        opt.zero_grad()
        _backward(engine, model, sample, path)
        return torch.zeros(())

    opt.step(closure)
    norm = update_norm(before, model)
    assert 0 < norm <= R * (1 + 1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_lbfgs_with_one_evaluation_per_step_is_exact(float64, mode):
    model = _model()
    batch = _data(4, seed=3)
    reference = reference_clipped_gradient(model, _losses, batch, max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum",
                                  optimizer=torch.optim.LBFGS(model.parameters(), lr=0.0, max_iter=1))

    def closure():
        opt.zero_grad()
        engine.backward(_losses(model, *batch))
        return torch.zeros((), dtype=torch.float64)

    opt.step(closure)
    assert_matches(_grads(model), reference, what="LBFGS(max_iter=1)")
    assert engine.steps_taken == 1


def test_an_optimizer_that_evaluates_the_closure_twice_is_refused_after_one_counted_update(float64):
    model = _model()
    before = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum",
                                  optimizer=torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=5))
    batch = _data(4, seed=4)

    def closure():
        opt.zero_grad()
        engine.backward(_losses(model, *batch))
        return _losses(model, *batch).sum().detach()

    with pytest.raises(RuntimeError, match="evaluated its closure a second time.*max_iter=1"):
        opt.step(closure)
    assert engine.steps_taken == 1  # the first evaluation's update, applied and counted
    assert update_norm(before, model) > 0


# ---------------------------------------------------------------------------------------- zero_grad
ZERO_GRADS = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer-set_to_none=False": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model": lambda model, opt: model.zero_grad(),
}


@pytest.mark.parametrize("how", list(ZERO_GRADS))
@pytest.mark.parametrize("mode, path", PATHS)
def test_zero_grad_between_backward_and_step_discards_the_batches_before_it(float64, mode, path, how):
    model = _model()
    kept = _data(5, seed=6)
    reference = reference_clipped_gradient(model, _losses, kept, max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    _backward(engine, model, _data(5, seed=5), path)  # discarded
    ZERO_GRADS[how](model, opt)
    _backward(engine, model, kept, path)
    opt.step()
    assert_matches(_grads(model), reference, what=f"zero_grad ({how}) before the kept batch")
    assert engine.steps_taken == 1


@pytest.mark.parametrize("mode, path", PATHS)
def test_the_same_sample_twice_across_zero_grad_moves_the_model_at_most_r(float64, mode, path):
    model = _model()
    before = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    sample = _data(1, seed=7)
    _backward(engine, model, sample, path)
    opt.zero_grad()
    _backward(engine, model, sample, path)
    opt.step()
    norm = update_norm(before, model)
    assert 0 < norm <= R * (1 + 1e-9)  # both applied: 2 R


@pytest.mark.parametrize("mode, path", PATHS)
def test_zero_grad_between_forward_and_backward_keeps_the_batch(float64, mode, path):
    """The usual loop order `out = model(x); opt.zero_grad(); loss.backward(); opt.step()`."""
    model = _model()
    batch = _data(5, seed=8)
    reference = reference_clipped_gradient(model, _losses, batch, max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    losses = _losses(model, *batch)
    opt.zero_grad()
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    assert_matches(_grads(model), reference, what="zero_grad between forward and backward")


@pytest.mark.parametrize("mode, path", PATHS)
def test_gradient_clipping_by_the_user_before_the_step_discards_nothing(float64, mode, path):
    """torch's clip_grad_norm_ between backward and step scales the marker gradient in place: no zero_grad."""
    model = _model()
    batches = [_data(3, seed=9), _data(3, seed=10)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    reference = reference_clipped_gradient(model, _losses, (x, y), max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    for batch in batches:
        _backward(engine, model, batch, path)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    opt.step()
    assert_matches(_grads(model), reference, what="clip_grad_norm_ between micro-batches")


def test_no_gradient_is_left_after_detach(float64):
    model = _model()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=0.1)
    engine.backward(_losses(model, *_data(3, seed=11)))
    engine.detach()
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------------------- other optimizers
@pytest.mark.parametrize("mode, path", PATHS)
def test_an_optimizer_built_after_attach_is_refused_before_it_applies_anything(float64, mode, path):
    model = _model()
    before = copy.deepcopy(model)
    reference = reference_clipped_gradient(before, _losses, _data(4, seed=12), max_grad_norm=R)
    engine, attached = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    later = torch.optim.SGD(model.parameters(), lr=1.0)
    _backward(engine, model, _data(4, seed=12), path)
    with pytest.raises(RuntimeError, match="not the optimizer this PrivacyEngine is attached to.*Nothing was applied"):
        later.step()
    assert update_norm(before, model) == 0 and engine.steps_taken == 0
    attached.step()  # still applies exactly that batch
    assert_matches({n: (q - p).detach() for (n, p), q in zip(model.named_parameters(), before.parameters())},
                   reference, what="the attached optimizer after a refused one")
    assert engine.steps_taken == 1


def test_an_optimizer_of_another_model_steps_freely(float64):
    model, other = _model(), _model()
    engine, _ = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=1.0)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    _losses(other, *_data(4, seed=13)).mean().backward()
    before = copy.deepcopy(other)  # (not attached: an ordinary copy)
    opt.step()
    assert update_norm(before, other) > 0
    engine.detach()


def test_after_detach_any_optimizer_steps_freely(float64):
    model = _model()
    engine, _ = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=1.0)
    engine.detach()
    later = torch.optim.SGD(model.parameters(), lr=0.1)
    _losses(model, *_data(4, seed=14)).mean().backward()
    before = copy.deepcopy(model)
    later.step()
    assert update_norm(before, model) > 0


# ---------------------------------------------------------------------------------------- two views of a sample
def _two_view_losses(model, x, x_aug, y):
    return F.cross_entropy(model(x), y, reduction="none") + F.cross_entropy(model(x_aug), y, reduction="none")


@pytest.mark.parametrize("mode, path", PATHS)
def test_two_views_of_each_sample_in_two_model_calls_are_clipped_together(float64, mode, path):
    """The README's way for augmented views: one model call per view, one loss per sample (their sum)."""
    model = _model()
    x, y = _data(4, seed=15)
    batch = (x, x + 0.1 * torch.randn_like(x), y)
    reference = reference_clipped_gradient(model, _two_view_losses, batch, max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    losses = _two_view_losses(model, *batch)
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    assert_matches(_grads(model), reference, what="two views, two model calls")
