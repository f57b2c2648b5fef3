"""A model call, its gradient and the model object each have one meaning (issue 20).

State written outside the private gradient during a training forward (buffers, frozen rows renormalised in place),
user tensor hooks on a layer's output, gradient penalties, copies and saved models of an attached model, and
inputs whose batch is not a plain tensor dimension (PackedSequence, EmbeddingBag's bags). Each is exact against the
one-sample-at-a-time oracle (float64, clipping binding) or refused with a message that says what to do, in every
clipping mode and on both backward paths; and with one sample, noise 0 and SGD at lr 1, the update has norm <= R.

A layer input modified in place after the layer ran must raise, not give a wrong gradient.
"""
from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import dptrain
from dptrain.rows import RowsMixSamples
from dptrain.testing import attached_engine, clipped_gradient, per_sample_gradients, reference_clipped_gradient
from helpers import (
    MODES,
    SINGLE_BACKWARD_MODES,
    Case,
    assert_matches,
    engine_clipped_sum,
    one_sample_update,
    with_oracle,
)

PATHS = [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES]
R = 0.5  # the bound of the one-sample tests


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _data(B, d=6, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, d, generator=g, dtype=torch.float64) * 3, torch.randint(0, classes, (B,), generator=g)


def _engine(model, mode, **kw):
    return dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, max_grad_norm=R, noise_multiplier=0.0,
                                 clipping_mode=mode, loss_reduction="sum", **kw)


def _exact(case: Case, R_split: float, ref: dict, mode: str, path: str, model: nn.Module | None = None) -> None:
    got = engine_clipped_sum(case, model, quiet=True, mode=mode, max_grad_norm=R_split,
                             path="engine" if path == "engine" else "sum")
    assert_matches(got, ref, what=f"{mode}/{path}")


def _backward(engine, losses, path):
    if path == "engine":
        engine.backward(losses)
    else:
        losses.sum().backward()


def _assert_bounded(model, mode, path, losses_fn, batch) -> None:
    """One SGD step (lr 1, noise 0, batch_size 1) on a batch of one sample whose gradient is larger than R moves the
    model by at most R."""
    unclipped = per_sample_gradients(model, losses_fn, batch)
    assert math.sqrt(sum(float(g.square().sum()) for g in unclipped.values())) > 2 * R, "the sample is not clipped"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's)
        update = one_sample_update(model, losses_fn, batch, mode=mode, max_grad_norm=R,
                                   path="engine" if path == "engine" else "sum")
    assert update <= R * (1 + 1e-9)


# ---------------------------------------------------------------------------------------- user tensor hooks
class HooksItsOutput(nn.Linear):
    """A layer whose own forward hooks its output (before the engine's hook). It has no rule: the per-sample
    fallback, which replays the forward, would apply that hook twice, and refuses."""

    def forward(self, x):
        out = super().forward(x)
        if out.requires_grad:
            out.register_hook(lambda g: 3 * g)
        return out


def test_a_fallback_layer_that_hooks_its_own_output_is_refused(float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), HooksItsOutput(8, 3)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's)
        engine = _engine(model, "bk-mixopt")
        engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
        with pytest.raises(ValueError, match="apply twice"):
            model(_data(4)[0])


class UserHooks(nn.Module):
    """User hooks on covered layers' outputs that scale or shift the gradient reaching the layer. The first layer's
    input needs no gradient: its output is the engine's origin tensor."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 8))

    def forward(self, x):
        h = self.a(x)
        if self.how == "scale before another hook":  # (the engine's reads the gradient after both)
            h.register_hook(lambda g: 3 * g)
            h.register_hook(lambda g: g - 0.25 * g.flip(-1))
        elif self.how == "scale":
            h.register_hook(lambda g: 3 * g)
        elif self.how == "add":  # (linear in the gradient, as any hook of a gradient must be)
            h.register_hook(lambda g: g + g.flip(-1) * self.shift)
        elif self.how == "add a constant":
            h.register_hook(lambda g: g + self.shift)
        elif self.how == "both layers":
            h.register_hook(lambda g: -2 * g)
        out = self.b(torch.tanh(h))
        if self.how == "both layers":
            out.register_hook(lambda g: 0.5 * g)
        return out


def _hooks_case(how):
    def build():
        torch.manual_seed(0)
        return Case(UserHooks(how), _losses, _data(5))
    return build


@pytest.mark.parametrize("how", ["scale", "add", "scale before another hook", "both layers"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_user_hooks_on_a_layer_output_are_exact(float64, mode, path, how):
    case, R_split, ref = with_oracle(_hooks_case(how))  # the oracle runs the same hooks
    _exact(case, R_split, ref, mode, path)


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_user_hook_that_adds_a_constant_is_refused(float64, mode, path):
    # g + c is not linear in the gradient: no loss has it as its gradient, and sum_i C_i L_i (the two-pass modes)
    # would add c once, unscaled. The tag pass sees rows that do not scale with their sample's tag.
    torch.manual_seed(0)
    model = UserHooks("add a constant").double()
    engine, _ = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    with pytest.raises(RowsMixSamples, match="mix the gradients of several samples"):
        _backward(engine, _losses(model, *_data(4)), path)


@pytest.mark.parametrize("mode,path", PATHS)
def test_user_hooks_on_a_layer_output_bound_one_sample(float64, mode, path):
    torch.manual_seed(0)
    x, y = _data(1)
    _assert_bounded(UserHooks("scale").double(), mode, path, _losses, (x, y))


# ---------------------------------------------------------------------------------------- gradient penalties
def _penalised(model, engine, x, y, forward="training"):
    """Cross entropy plus the squared input gradient, that gradient taken with create_graph=True under paused()
    (of the training forward's loss, or of a forward of its own under paused())."""
    x = x.clone().requires_grad_(True)
    ce = _losses(model, x, y)
    with engine.paused():
        gx, = torch.autograd.grad((ce if forward == "training" else _losses(model, x, y)).sum(), x, create_graph=True)
    return ce + gx.square().sum(1)


@pytest.mark.parametrize("forward", ["training", "paused"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_gradient_penalty_is_refused(float64, mode, path, forward):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="gradient penalties are not supported"):
        _backward(engine, _penalised(model, engine, *_data(1), forward=forward), path)
    opt.step()  # nothing of the refused backward is applied (noise 0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    x, y = _data(4)
    plain = copy.deepcopy(model)  # (a copy is not attached: the oracle's backwards stay its own)
    assert_matches(_run(model, engine, opt, x, y, path), reference_clipped_gradient(plain, _losses, (x, y),
                                                                                     max_grad_norm=R),
                   what="the step after a refused penalty")


def _run(model, engine, opt, x, y, path, losses_fn=_losses):
    opt.zero_grad(set_to_none=True)
    for group in opt.param_groups:
        group["lr"] = 0.0
    _backward(engine, losses_fn(model, x, y), path)
    opt.step()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _adversarial(pause):
    """Losses on inputs moved along their (detached) gradient, taken with create_graph=True under ``pause()``."""
    def losses_fn(model, x, y):
        x = x.clone().requires_grad_(True)
        with pause():
            gx, = torch.autograd.grad(_losses(model, x, y).sum(), x, create_graph=True)
        return _losses(model, x.detach() + 0.1 * gx.detach(), y)
    return losses_fn


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_differentiable_input_gradient_not_used_in_the_loss_is_exact(float64, mode, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = _data(5)
    reference = reference_clipped_gradient(model, _adversarial(contextlib.nullcontext), (x, y), max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    assert_matches(_run(model, engine, opt, x, y, path, _adversarial(engine.paused)), reference,
                   what="create_graph under paused, used detached")


@pytest.mark.parametrize("mode,path", PATHS)
def test_second_input_derivatives_under_paused_are_exact(float64, mode, path):
    """d/dx of |dL/dx|^2 under paused() (both derivatives), then a training step: both as without the engine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    plain = copy.deepcopy(model)
    x, y = _data(5)

    def second(m, pause):
        xi = x.clone().requires_grad_(True)
        ce = _losses(m, xi, y)
        with pause():
            gx, = torch.autograd.grad(ce.sum(), xi, create_graph=True)
            return torch.autograd.grad(gx.square().sum(), xi)[0]

    expected = second(plain, contextlib.nullcontext)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    torch.testing.assert_close(second(model, engine.paused), expected, rtol=1e-10, atol=0)
    reference = reference_clipped_gradient(plain, _losses, (x, y), max_grad_norm=R)
    assert_matches(_run(model, engine, opt, x, y, path), reference, what="the step after")


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_refused_gradient_penalty_bounds_one_sample(float64, mode, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    before = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    with pytest.raises(RuntimeError, match="gradient penalties"):
        _backward(engine, _penalised(model, engine, *_data(1)), path)
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))


# ---------------------------------------------------------------------------------------- state written in a forward
class RunningMean(nn.Module):
    """No parameters; in training keeps a running mean of what it sees: in place, by replacing its buffer, or in a
    buffer it registers at its first call."""

    def __init__(self, d, how="in place"):
        super().__init__()
        self.how = how
        if how != "registered":
            self.register_buffer("mean", torch.zeros(d))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                if self.how == "replaced":
                    self.mean = 0.9 * self.mean + 0.1 * h.mean(0)
                elif self.how == "registered":
                    self.register_buffer("mean", h.mean(0))
                else:
                    self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return h


class Writes(nn.Module):
    """A frozen embedding (``max_norm`` renormalises the rows it looks up, in place), a running mean, a frozen
    BatchNorm, and two trainable layers; ``kind`` picks what the forward uses."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(10, 6, max_norm=1.0 if kind == "max_norm" else None)
        self.emb.requires_grad_(False)
        how = {"replaced buffer": "replaced", "registered buffer": "registered"}.get(kind, "in place")
        self.run = RunningMean(8, how)
        self.bn = nn.BatchNorm1d(8)
        self.bn.requires_grad_(False)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.a(self.emb(ids).mean(1) * 3)
        if self.kind in ("running mean", "replaced buffer", "registered buffer"):
            h = self.run(h)
        if self.kind == "frozen batchnorm":
            h = self.bn(h)
        return self.b(torch.tanh(h))


def _ids(B, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (B, 3), generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("kind,written", [("max_norm", "'emb.weight'"), ("running mean", "'run.mean'"),
                                          ("replaced buffer", "'run.mean'"), ("registered buffer", "'run.mean'")])
@pytest.mark.parametrize("mode,path", PATHS)
def test_state_written_in_a_training_forward_is_refused(float64, mode, path, kind, written):
    torch.manual_seed(0)
    model = Writes(kind).double()
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine = _engine(model, mode)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    engine.attach(opt)
    with pytest.raises(RuntimeError, match="written during a training forward") as refusal:
        _backward(engine, _losses(model, *_ids(1)), path)
    assert written in str(refusal.value) and "already modified" in str(refusal.value)
    opt.step()  # (noise 0) the refused call contributes nothing: the trainable weights stay where they were
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if p.requires_grad)
    # The same module out of the training forward is fine: evaluation, and a call under paused().
    with torch.no_grad():
        model(_ids(4)[0])
    with engine.paused():
        model(_ids(4)[0])


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_frozen_batchnorm_in_eval_mode_is_exact(float64, mode, path):
    def build():
        torch.manual_seed(0)
        model = Writes("frozen batchnorm")
        with torch.no_grad():  # statistics of its own, not the initial ones
            model.bn.running_mean.normal_()
            model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.eval()
        return Case(model, _losses, _ids(5))

    case, R_split, ref = with_oracle(build)
    _exact(case, R_split, ref, mode, path)


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_frozen_batchnorm_in_eval_mode_bounds_one_sample(float64, mode, path):
    torch.manual_seed(0)
    model = Writes("frozen batchnorm").double()
    model.bn.eval()
    with torch.no_grad():
        model.a.weight.mul_(20)
    _assert_bounded(model, mode, path, _losses, _ids(1))


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_module_fixed_after_a_refused_forward_is_exact(float64, mode, path):
    def build():
        torch.manual_seed(0)
        return Case(Writes("running mean"), _losses, _ids(5))

    case, R_split, ref = with_oracle(build)  # (the oracle runs the model as it is: its buffer is not read)
    model = copy.deepcopy(case.model)
    engine, _ = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    with pytest.raises(RuntimeError, match="'run.mean'"):
        model(case.batch[0])
    engine.detach()
    model.run.eval()
    _exact(case, R_split, ref, mode, path, model=model)


# ---------------------------------------------------------------------------------------- copies and saved models
def _small(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_a_deep_copy_is_a_plain_model(float64):
    model = _small()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=1.0)
    copied = copy.deepcopy(model)
    plain = _small()
    x, y = _data(4)
    for m in (copied, plain):
        F.cross_entropy(m(x), y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(copied.parameters(), plain.parameters()))
    torch.optim.SGD(copied.parameters(), lr=1.0).step()
    assert not torch.equal(copied[0].weight, model[0].weight)  # the copy moved, with its own optimizer
    assert all(p.grad is None for p in model.parameters())  # and the original saw nothing of it


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_an_engine_attached_to_a_copy_is_exact_and_the_original_too(float64, mode, path, how):
    case, R_split, ref = with_oracle(lambda: Case(_small(), _losses, _data(5)))
    original = copy.deepcopy(case.model)
    engine = dptrain.PrivacyEngine(original, batch_size=1, sample_size=100, max_grad_norm=R_split,
                                   noise_multiplier=0.0, clipping_mode=mode, loss_reduction="sum")
    opt = torch.optim.SGD(original.parameters(), lr=0.0)
    engine.attach(opt)
    if how == "deepcopy":
        copied = copy.deepcopy(original)
    else:
        buffer = io.BytesIO()
        torch.save(original, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    _exact(case, R_split, ref, mode, path, model=copied)  # a second engine, on the copy
    _backward(engine, case.losses(original), path)  # the original's engine goes on as before
    opt.step()
    assert_matches({n: p.grad for n, p in original.named_parameters()}, ref, what="the original")


@pytest.mark.parametrize("mode,path", PATHS)
def test_an_engine_attached_to_a_copy_bounds_one_sample(float64, mode, path):
    model = _small()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    with torch.no_grad():
        model[0].weight.mul_(5)
    copied = copy.deepcopy(model)
    _assert_bounded(copied, mode, path, _losses, _data(1))


def test_a_saved_attached_model_loads_as_the_same_plain_model(float64):
    model = _small()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=1.0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x, _ = _data(3)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), model.parameters()))


def test_the_audit_runs_on_an_attached_model(float64):
    model = _small()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=1.0)
    x, y = _data(40)
    result = dptrain.audit.run_audit(model=model.float(), data=(x.float(), y), steps=2, canaries=2, seed=0)
    assert result is not None


# ---------------------------------------------------------------------------------------- batches of other shapes
class PackedInput(nn.Module):
    """An LSTM fed a PackedSequence by the caller: the model's input holds the tokens of every sequence."""

    def __init__(self):
        super().__init__()
        self.rnn = dptrain.nn.DPLSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, packed):
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def _packed_losses(model, x, lengths, y):
    return F.cross_entropy(model(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)), y,
                           reduction="none")


def _sequences(B, seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (B,), generator=g)
    lengths[0] = 6
    return torch.randn(B, 6, 3, generator=g) * 2, lengths, torch.randint(0, 2, (B,), generator=g)


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_packed_sequence_input_is_exact(float64, mode, path):
    def build():
        torch.manual_seed(0)
        return Case(PackedInput(), _packed_losses, _sequences(5))

    case, R_split, ref = with_oracle(build)
    _exact(case, R_split, ref, mode, path)


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_packed_sequence_input_bounds_one_sample(float64, mode, path):
    torch.manual_seed(0)
    model = PackedInput().double()
    with torch.no_grad():
        model.head.weight.mul_(30)
    _assert_bounded(model, mode, path, _packed_losses, _sequences(1))


class Bags(nn.Module):
    """Bags of different lengths flattened for an EmbeddingBag (1-D ids with offsets) inside the model."""

    def __init__(self, mode: str, include_last_offset: bool):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode, include_last_offset=include_last_offset)
        self.head = nn.Linear(4, 2)

    def forward(self, padded, lengths, weights):
        kept = torch.arange(padded.shape[1]) < lengths[:, None]
        starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        offsets = starts if self.bag.include_last_offset else starts[:-1]
        per_sample_weights = weights[kept] if self.bag.mode == "sum" else None
        return self.head(torch.tanh(self.bag(padded[kept], offsets, per_sample_weights=per_sample_weights)))


def _bag_losses(model, padded, lengths, weights, y):
    return F.cross_entropy(model(padded, lengths, weights), y, reduction="none")


def _bags(lengths, seed=4):
    g = torch.Generator().manual_seed(seed)
    B, L = len(lengths), max(lengths)
    return (torch.randint(0, 10, (B, L), generator=g), torch.tensor(lengths), torch.rand(B, L, generator=g) + 0.5,
            torch.randint(0, 2, (B,), generator=g))


@pytest.mark.parametrize("bag_mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("mode,path", PATHS)
def test_an_embedding_bag_with_offsets_is_exact(float64, mode, path, bag_mode, last):
    def build():
        torch.manual_seed(0)
        return Case(Bags(bag_mode, last), _bag_losses, _bags([3, 1, 0, 4, 2]))  # an empty bag too

    case, R_split, ref = with_oracle(build)
    _exact(case, R_split, ref, mode, path)


@pytest.mark.parametrize("mode,path", PATHS)
def test_an_embedding_bag_with_offsets_bounds_one_sample(float64, mode, path):
    torch.manual_seed(0)
    model = Bags("sum", False).double()
    with torch.no_grad():
        model.bag.weight.mul_(10)
        model.head.weight.mul_(10)
    _assert_bounded(model, mode, path, _bag_losses, _bags([4]))


# ---------------------------------------------------------------------------------------- inputs modified in place
class ResidualInPlace(nn.Module):
    def __init__(self, out_of_place: bool):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.out_of_place = out_of_place

    def forward(self, x):
        h = self.a(x)
        if self.out_of_place:
            h = h + self.b(h)
        else:
            h += self.b(h)  # overwrites b's input after b used it
        return h


def _residual_losses(model, x):
    return model(x).square().sum(1)


@pytest.mark.parametrize("mode", dptrain.CLIPPING_MODES)
def test_input_modified_in_place_is_refused(mode, float64):
    torch.manual_seed(0)
    model, x = ResidualInPlace(out_of_place=False), torch.randn(4, 3)
    engine, _ = attached_engine(model, mode=mode, max_grad_norm=1.0, sample_size=10)
    with pytest.raises(RuntimeError, match="modified (in place|by an inplace)"):
        engine.backward(_residual_losses(model, x))


@pytest.mark.parametrize("mode", dptrain.CLIPPING_MODES)
def test_out_of_place_residual_is_exact(mode, float64):
    torch.manual_seed(0)
    model, x = ResidualInPlace(out_of_place=True), torch.randn(4, 3)
    ref = reference_clipped_gradient(model, _residual_losses, (x,), max_grad_norm=1.0)
    got = clipped_gradient(model, _residual_losses, (x,), mode=mode, max_grad_norm=1.0, sample_size=10)
    for name, _ in model.named_parameters():
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-12)
