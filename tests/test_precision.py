"""fp16 training with a GradScaler: the scale is removed before clipping; skipped steps still count."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
import dptrain.testing
from dptrain.testing import attached_engine
from helpers import MODES, SINGLE_BACKWARD_MODES

BATCH, SAMPLES = 6, 60


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 5, 3), nn.Tanh(), nn.Flatten(), nn.Linear(5 * 6, 8), nn.LayerNorm(8),
                         nn.Linear(8, 4))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 3, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(n)]


def _engine(model, mode, **kw):
    return dptrain.PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, max_grad_norm=0.1,
                                 noise_multiplier=0.0, clipping_mode=mode, **kw)


def _scaler(init_scale: float, **kw) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale, **kw)


def _train(mode, batches, scaler=None, plain=False, micro=1):
    """(model, engine) after one step per batch (SGD at lr 0.5), each batch in ``micro`` micro-batches, through
    the scaler if one is given: the trajectories with and without a scale must agree."""
    model = _model()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=0.1, lr=0.5, grad_scaler=scaler, batch_size=BATCH,
                                  sample_size=SAMPLES)
    for x, y in batches:
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            scale = scaler.scale if scaler is not None else (lambda t: t)
            if plain:
                scale(F.cross_entropy(model(xs), ys, reduction="sum")).backward()
            else:
                engine.backward(scale(F.cross_entropy(model(xs), ys, reduction="none")))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return model, engine


@pytest.mark.parametrize("mode", MODES)
def test_the_scale_is_removed_before_clipping(mode):
    # Clipping binds at R = 0.1; clipping the scaled gradients would give a different result.
    batches = _batches(3)
    expected, _ = _train(mode, batches)
    got, engine = _train(mode, batches, scaler=_scaler(2.0**12))
    for p, q in zip(expected.parameters(), got.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert engine.steps_taken == 3


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_scaled_plain_backward_and_micro_batches(mode):
    batches = _batches(2)
    expected, _ = _train(mode, batches)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = _scaler(2.0**8)
    _engine(model, mode, loss_reduction="mean").attach(opt, grad_scaler=scaler)
    for x, y in batches:
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            scaler.scale(F.cross_entropy(model(xs), ys)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    for p, q in zip(expected.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def _overflowing_scaler() -> torch.amp.GradScaler:
    # 2^120 times the gradients overflows their float32 squared norms (the scaled losses themselves stay
    # finite); one back-off brings the scale to 2^7.
    return _scaler(2.0**120, backoff_factor=2.0**-113, growth_interval=1000)


@pytest.mark.parametrize("mode", MODES)
def test_an_overflow_is_run_again_at_a_smaller_scale_without_skipping_the_step(mode):
    batches = _batches(2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = _overflowing_scaler()
    engine = _engine(model, mode).attach(opt, grad_scaler=scaler)
    for x, y in batches:
        engine.backward(scaler.scale(F.cross_entropy(model(x), y, reduction="none")))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**7  # the scale that worked, found on the first batch
    assert engine.steps_taken == 2  # no step skipped, none counted twice
    expected, _ = _train(mode, batches)
    for p, q in zip(expected.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def _plain_overflow_setup(mode="bk-mixopt"):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = _overflowing_scaler()
    return model, opt, scaler, _engine(model, mode, loss_reduction="sum").attach(opt, grad_scaler=scaler)


def _plain_backward(model, scaler, x, y):
    scaler.scale(F.cross_entropy(model(x), y, reduction="sum")).backward()


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_plain_backward_that_overflows_skips_the_step_and_counts_it(mode):
    # loss.backward() cannot be run again by the engine: the scaler skips the step, which counts.
    batches = _batches(2)
    model, opt, scaler, engine = _plain_overflow_setup(mode)
    initial = copy.deepcopy(model.state_dict())
    x, y = batches[0]
    with pytest.warns(UserWarning, match="fp16 overflow"):
        _plain_backward(model, scaler, x, y)
    assert engine.steps_taken == 1  # counted at the overflow: optimizer.step() will not run
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    for k, v in model.state_dict().items():
        assert torch.equal(v, initial[k]), k  # the scaler skipped the step
    assert scaler.get_scale() == 2.0**7
    assert engine.steps_taken == 1
    # The next step runs normally with the reduced scale, and equals a private step from the start.
    x, y = batches[1]
    _plain_backward(model, scaler, x, y)
    scaler.step(opt)
    scaler.update()
    assert engine.steps_taken == 2
    expected, _ = _train(mode, batches[1:])
    for p, q in zip(expected.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert engine.get_epsilon() > 0


def test_overflow_in_one_micro_batch_skips_and_counts_the_logical_step_once():
    model, opt, scaler, engine = _plain_overflow_setup()
    x, y = _batches(1)[0]
    with pytest.warns(UserWarning, match="fp16 overflow"):
        for xs, ys in zip(x.chunk(3), y.chunk(3)):
            _plain_backward(model, scaler, xs, ys)
    assert engine.steps_taken == 1
    before = copy.deepcopy(model.state_dict())
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert engine.steps_taken == 1
    _plain_backward(model, scaler, x, y)
    scaler.step(opt)
    scaler.update()
    assert engine.steps_taken == 2
    assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_optimizer_step_after_an_overflow_applies_nothing_and_counts_once():
    model, opt, scaler, engine = _plain_overflow_setup()
    x, y = _batches(1)[0]
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="fp16 overflow"):
        _plain_backward(model, scaler, x, y)
    opt.step()  # bypasses the scaler: the engine itself drops the overflowed step
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert engine.steps_taken == 1


def test_a_backward_with_a_scale_that_worked_before_keeps_no_graph():
    # The graph is kept (for a run at a smaller scale) only while the scale is above the last one that
    # worked: afterwards a second backward through the same losses fails as in ordinary training.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = _scaler(2.0**4)
    engine = _engine(model, "bk").attach(opt, grad_scaler=scaler)
    x, y = _batches(1)[0]
    engine.backward(scaler.scale(F.cross_entropy(model(x), y, reduction="none")))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    losses = scaler.scale(F.cross_entropy(model(x), y, reduction="none"))
    engine.backward(losses)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        losses.sum().backward()


def test_without_a_scaler_an_overflow_is_an_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = _engine(model, "bk-mixopt").attach(opt)
    x, y = _batches(1)[0]
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        engine.backward(2.0**100 * F.cross_entropy(model(x), y, reduction="none"))


def test_grad_scaler_argument_is_checked():
    model = _model()
    with pytest.raises(TypeError, match="GradScaler"):
        _engine(model, "bk").attach(torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=2.0)


def test_fp16_autocast_with_a_scaler_tracks_the_float64_oracle():
    """fp16 autocast on CPU (the GPU check runs where a device is lent): within fp16 tolerance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(BATCH, 12), torch.randint(0, 4, (BATCH,))
    reference = dptrain.testing.reference_clipped_gradient(
        copy.deepcopy(model).double(), lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"),
        (x.double(), y), max_grad_norm=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = _scaler(2.0**10)
    engine = _engine(model, "bk-mixopt").attach(opt, grad_scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        losses = F.cross_entropy(model(x), y, reduction="none")
    engine.backward(scaler.scale(losses))
    scaler.step(opt)
    scaler.update()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        ref = reference[name].float() / BATCH
        # fp16 keeps 11 significant bits: relative error a few 1e-3 of the largest entry.
        assert float((p.grad - ref).abs().max()) <= 1e-2 * float(ref.abs().max()), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["bk-mixopt", "bk", "ghost", "per-sample"])
def test_cuda_fp16_autocast_with_a_scaler_tracks_the_float64_oracle(mode):
    torch.manual_seed(0)
    model = _model()
    x, y = _batches(1)[0]
    reference = dptrain.testing.reference_clipped_gradient(
        copy.deepcopy(model).double(), lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"),
        (x.double(), y), max_grad_norm=0.1)
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cuda")
    engine = _engine(model, mode).attach(opt, grad_scaler=scaler)
    with torch.autocast("cuda", dtype=torch.float16):
        losses = F.cross_entropy(model(x.cuda()), y.cuda(), reduction="none")
    engine.backward(scaler.scale(losses))
    scaler.step(opt)
    scaler.update()
    assert engine.steps_taken == 1
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        ref = reference[name].float() / BATCH
        assert float((p.grad.cpu() - ref).abs().max()) <= 1e-2 * float(ref.abs().max()), name


@pytest.mark.parametrize("mode", MODES)
def test_fp16_works_from_the_first_step_at_the_default_scale(mode):
    # The reproduction of the CUDA failure on the CPU: at GradScaler's default 2^16, back-propagating the *sum*
    # of 32 scaled losses overflowed fp16, so the first steps were skipped (and charged). The engine
    # back-propagates their mean, as ordinary fp16 training does.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():  # confident, wrong predictions: an output gradient of ~2^16 for some samples
        model[2].weight.mul_(8)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 12, generator=g) * 4, torch.randint(0, 4, (32,), generator=g)
    reference = dptrain.testing.reference_clipped_gradient(
        copy.deepcopy(model).double(), lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"),
        (x.double(), y), max_grad_norm=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    engine = dptrain.PrivacyEngine(model, batch_size=32, sample_size=320, max_grad_norm=0.1, noise_multiplier=0.0,
                                   clipping_mode=mode).attach(opt, grad_scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        losses = F.cross_entropy(model(x), y, reduction="none")
    engine.backward(scaler.scale(losses))
    scaler.step(opt)
    scaler.update()
    assert engine.steps_taken == 1 and scaler.get_scale() == 2.0**16  # nothing skipped, no scale search
    for name, p in model.named_parameters():
        ref = reference[name].float() / 32
        assert float((p.grad - ref).abs().max()) <= 1e-2 * float(ref.abs().max()), name
