"""The private step (dptrain.core.step): what a step means, and the step's own state.

What a step means: closures (``optimizer.step(closure)``), ``zero_grad()`` between a backward and the step,
and optimizers other than the attached one. Each case is checked against the one-sample-at-a-time oracle (float64,
clipping binding) in every mode and on both backward paths, and at batch size 1 with noise 0, where the applied
update must have norm <= R.

The step's own state: the clipped sums' precision, the noise generator across a checkpoint, and what feeds the
count of samples per step (the sampling check itself: tests/test_sampling_check.py). Low precision: with bf16 parameters or under bf16 autocast the clipped sums are
float32 until the noise is added; one sample's contribution (every other sample's loss weighted 0, noise 0) has
norm <= R up to float32 rounding in every mode and on both backward paths.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
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
    """docs/engine.md's way for augmented views: one model call per view, one loss per sample (their sum)."""
    model = _model()
    x, y = _data(4, seed=15)
    batch = (x, x + 0.1 * torch.randn_like(x), y)
    reference = reference_clipped_gradient(model, _two_view_losses, batch, max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    losses = _two_view_losses(model, *batch)
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    assert_matches(_grads(model), reference, what="two views, two model calls")


# ---------------------------------------------------------------------------------------- the step's own state
BF16 = torch.bfloat16
R_PRECISION = 0.5  # the bound of the low-precision tests
# float32 rounding of a norm formed from float32 products of a few hundred terms: 16 unit roundoffs
FLOAT32_MARGIN = 2.0 ** -20
# bf16 keeps 8 significant bits: rounding to nearest moves each entry by at most 2^-8 of itself, so the
# rounded gradient's norm is at most (1 + 2^-8) times the float32 one
BF16_ROUNDING = 2.0 ** -8


class TokenMLP(nn.Module):
    """Linear -> tanh -> Linear on [B, 3, 12] (T = 3: the ghost norm is a Gram product)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 24), nn.Linear(24, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class SmallConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def one_sample_case(kind: str, seed: int, autocast: bool):
    """(model, inputs, per-sample losses fn): losses scaled up so that the chosen sample is clipped."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    B = 4
    if kind == "tokens":
        model, x = TokenMLP(), torch.randn(B, 3, 12, generator=g)
        y = torch.randint(0, 5, (B, 3), generator=g)
    else:
        model, x = SmallConv(), torch.randn(B, 3, 4, 4, generator=g)
        y = torch.randint(0, 5, (B,), generator=g)
    if not autocast:
        model, x = model.to(BF16), x.to(BF16)

    def losses(m):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = m(x)
        per_token = F.cross_entropy(out.reshape(-1, 5).float(), y.reshape(-1), reduction="none")
        return 10.0 * per_token.reshape(B, -1).sum(1)

    return model, losses


def contribution_of_one_sample(kind, seed, autocast, mode, path):
    """(the step's float32 sums after one sample's backward, their dtypes) with every other loss weighted 0."""
    model, losses_fn = one_sample_case(kind, seed, autocast)
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, max_grad_norm=R_PRECISION,
                                   noise_multiplier=0.0, clipping_mode=mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    try:
        losses = losses_fn(model)
        only = torch.zeros(losses.shape[0], dtype=losses.dtype)
        only[seed % losses.shape[0]] = 1.0
        if path == "engine.backward":
            engine.backward(losses * only)
        else:
            (losses * only).sum().backward()
        sums = list(engine._sums.sums.values())  # before the step: what the noise is added to
        return torch.sqrt(sum(t.double().square().sum() for t in sums)).item(), {t.dtype for t in sums}
    finally:
        engine.detach()


PRECISION_PATHS = [(m, "engine.backward") for m in MODES] + [(m, "loss.backward") for m in SINGLE_BACKWARD_MODES]


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-parameters", "bf16-autocast"])
@pytest.mark.parametrize("mode,path", PRECISION_PATHS)
@pytest.mark.parametrize("kind", ["tokens", "conv"])
def test_one_sample_contributes_at_most_R_in_float32_before_the_cast(kind, mode, path, autocast):
    """Before: bf16 sums, bf16 2b(C) products and the second pass's bf16 re-derivation let one sample
    contribute up to 1.003 R (measured on these models); now <= R up to float32 rounding."""
    for seed in range(4):
        norm, dtypes = contribution_of_one_sample(kind, seed, autocast, mode, path)
        assert dtypes == {torch.float32}, dtypes
        assert norm <= R_PRECISION * (1 + FLOAT32_MARGIN), (
            f"seed {seed}: ||contribution|| / R - 1 = {norm / R_PRECISION - 1:.3g}")
        assert norm >= R_PRECISION * (1 - 2.0 ** -6), f"seed {seed}: the sample was not clipped (norm {norm:.4g})"


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-parameters", "bf16-autocast"])
@pytest.mark.parametrize("mode", MODES)
def test_batch_of_one_update_is_bounded_by_R_times_lr(mode, autocast):
    """One Linear layer initialised at zero, SGD with lr 1, batch_size 1: the update is exactly -p.grad, so its
    norm is that of the float32 sum rounded once to the parameter's dtype: <= R (1 + 2^-8) for bf16 parameters
    (each entry rounded to nearest moves by at most 2^-8 of itself), <= R for float32 ones (autocast)."""
    lr = 1.0
    bound = R_PRECISION * lr * (1 + (BF16_ROUNDING if not autocast else 0.0)) * (1 + FLOAT32_MARGIN)
    for seed in range(4):
        torch.manual_seed(seed)
        model = nn.Linear(12, 5)
        nn.init.zeros_(model.weight)
        nn.init.zeros_(model.bias)
        x = torch.randn(1, 12, generator=torch.Generator().manual_seed(seed)) * 10
        if not autocast:
            model, x = model.to(BF16), x.to(BF16)
        engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, max_grad_norm=R_PRECISION,
                                       noise_multiplier=0.0, clipping_mode=mode)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        engine.attach(optimizer)
        try:
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                out = model(x)
            engine.backward(F.cross_entropy(out.float(), torch.tensor([seed % 5]), reduction="none"))
            optimizer.step()
        finally:
            engine.detach()
        update = math.sqrt(sum(p.detach().double().square().sum().item() for p in model.parameters()))
        assert update <= bound, f"seed {seed}: ||update|| / (R lr) - 1 = {update / (R_PRECISION * lr) - 1:.3g}"
        assert update >= R_PRECISION * lr * (1 - BF16_ROUNDING), "the sample was not clipped"


def test_noise_is_drawn_and_added_in_float32_for_bf16_parameters():
    model = TokenMLP().to(BF16)
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, max_grad_norm=R_PRECISION,
                                   noise_multiplier=1.0, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    drawn = []
    sample = engine._noise.sample
    engine._noise.sample = lambda like, std: drawn.append(like.dtype) or sample(like, std)
    try:
        engine.backward(model(torch.randn(4, 3, 12).to(BF16)).float().square().flatten(1).sum(1))
        optimizer.step()
    finally:
        engine.detach()
    assert drawn and set(drawn) == {torch.float32}
    assert all(p.grad.dtype == BF16 for p in model.parameters())


@pytest.mark.parametrize("noise", ["gaussian", "bandmf"])
def test_the_noise_is_the_same_draw_for_draw_whatever_the_buckets_it_is_added_in(noise, monkeypatch):
    """The step draws each parameter's noise in the parameters' order and adds a bucket's at once
    (step.NOISE_BUCKET_BYTES): a bucket per parameter gives the very same gradients as one bucket for all, step after
    step (correlated noise keeps its per-parameter streams), and the noise has the calibrated standard deviation."""
    import dptrain.core.step

    def run(bucket_bytes: int) -> list[torch.Tensor]:
        monkeypatch.setattr(dptrain.core.step, "NOISE_BUCKET_BYTES", bucket_bytes)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 20))
        extra = {"bands": 2, "steps": 4} if noise == "bandmf" else {}
        engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=3.0,
                                       max_grad_norm=1.0, noise=noise, seed=11, **extra)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine.attach(optimizer)
        grads = []
        try:
            for _ in range(3):
                x = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
                engine.backward(model(x).square().sum(1))
                optimizer.step()
                grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))
                optimizer.zero_grad()
        finally:
            engine.detach()
        return grads

    one, each = run(1 << 30), run(1)
    assert all(torch.equal(a, b) for a, b in zip(one, each))
    if noise == "gaussian":  # (the clipped sum is at most R = 1, the noise's std 3 per coordinate, over B = 4)
        spread = torch.stack(one).std() * 4
        assert 2.7 < float(spread) < 3.3


# --------------------------------------------------------------------------- the noise across a checkpoint
def noise_engine(**kwargs):
    model = nn.Linear(6, 3)
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=1.0, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    return engine, model, optimizer


def noise_of_steps(engine, model, optimizer, steps: int) -> list[torch.Tensor]:
    """The noise of empty steps (no backward: p.grad is the noise alone)."""
    drawn = []
    for _ in range(steps):
        optimizer.step()
        drawn.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))
        optimizer.zero_grad()
    return drawn


def test_noise_after_load_is_fresh_never_the_saved_stream():
    engine, model, optimizer = noise_engine(seed=3)
    noise_of_steps(engine, model, optimizer, 2)
    checkpoint = engine.state_dict()
    assert "generators" in checkpoint["noise"]  # kept for the reproducible mode only
    saved_stream = noise_of_steps(engine, model, optimizer, 3)  # what steps 3..5 drew in the first run
    resumes = []
    for _ in range(2):  # the same checkpoint resumed twice: each resume draws its own noise
        engine, model, optimizer = noise_engine(seed=3)
        engine.load_state_dict(checkpoint)
        assert engine.steps_taken == 2
        resumes.append(noise_of_steps(engine, model, optimizer, 3))
    for resumed in resumes:
        assert not any(torch.equal(a, b) for a in saved_stream for b in resumed)
    assert not any(torch.equal(a, b) for a in resumes[0] for b in resumes[1])
    # and not the stream a fresh engine with the same seed starts with either
    engine, model, optimizer = noise_engine(seed=3)
    from_seed = noise_of_steps(engine, model, optimizer, 5)
    assert not any(torch.equal(a, b) for a in from_seed for b in resumes[0])


def test_reproducible_noise_continues_the_saved_stream_and_says_so():
    engine, model, optimizer = noise_engine(seed=3)
    noise_of_steps(engine, model, optimizer, 2)
    checkpoint = engine.state_dict()
    saved_stream = noise_of_steps(engine, model, optimizer, 3)
    engine, model, optimizer = noise_engine(seed=3)
    with pytest.warns(UserWarning, match="same noise to different data"):
        engine.load_state_dict(checkpoint, reproducible_noise=True)
    for a, b in zip(saved_stream, noise_of_steps(engine, model, optimizer, 3)):
        assert torch.equal(a, b)


def test_secure_noise_is_never_saved_nor_continued():
    engine, model, optimizer = noise_engine(secure_rng=True)
    noise_of_steps(engine, model, optimizer, 1)
    checkpoint = engine.state_dict()
    assert checkpoint["noise"] == {"secure": True}
    engine, model, optimizer = noise_engine(secure_rng=True)
    with pytest.raises(ValueError, match="cannot be continued"):
        engine.load_state_dict(checkpoint, reproducible_noise=True)
    assert engine.steps_taken == 0  # refused before anything was restored
    engine.load_state_dict(checkpoint)
    assert engine.steps_taken == 1
    a, b = noise_of_steps(engine, model, optimizer, 1)[0], noise_of_steps(*noise_engine(secure_rng=True), 1)[0]
    assert not torch.equal(a, b)


# --------------------------------------------------------------------------- samples per step
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_every_completed_backward_tells_its_samples_on_both_paths(mode, monkeypatch):
    """What the engine feeds SamplesPerStep.add_backward: each completed backward's batch (Backward.batch),
    from engine.backward's losses and from a plain loss.backward()'s model call alike."""
    from dptrain.core.runner import BackwardRunner

    seen = []
    done = BackwardRunner._done
    monkeypatch.setattr(BackwardRunner, "_done", lambda self, backward: seen.append(backward.batch) or done(self, backward))
    model = nn.Linear(6, 3)
    engine = dptrain.PrivacyEngine(model, batch_size=8, sample_size=100, noise_multiplier=0.0, clipping_mode=mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    try:
        engine.backward(model(torch.randn(5, 6)).square().sum(1))
        if not dptrain.RECIPES[mode].two_pass:
            model(torch.randn(3, 6)).square().sum(1).mean().backward()
        optimizer.step()
    finally:
        engine.detach()
    assert seen == ([5] if dptrain.RECIPES[mode].two_pass else [5, 3])
