"""Evaluation without gradients: the covered layers' hooks are set aside for the model call (``hooks_aside``), so
torch calls each layer on its fast path, and they are back, exactly as they were, for the next training step."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import attached_engine, reference_clipped_gradient
from helpers import assert_matches

R = 0.5


class Probe(nn.Module):
    """A Linear that notes, at each call, whether any module of its model has forward hooks (the slow path)."""

    def __init__(self, d_in, d_out, notes: list):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.notes = notes
        self.model: nn.Module | None = None

    def forward(self, x):
        self.notes.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                              for m in self.model.modules() if m is not self.model))
        return self.linear(x)


def _model(notes: list):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Probe(8, 8, notes), nn.LayerNorm(8), nn.Linear(8, 3)).double()
    model[2].model = model
    return model


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _data(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def _step(engine, opt, model, batch, mode_path):
    losses = _losses(model, *batch)
    engine.backward(losses) if mode_path == "engine" else losses.sum().backward()
    opt.step()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    return got


def _hook_dicts(model):
    return [(m._forward_pre_hooks, list(m._forward_pre_hooks), m._forward_hooks, list(m._forward_hooks))
            for m in model.modules()]


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk-mixopt", "plain"), ("ghost", "engine"),
                                       ("per-sample", "plain")])
def test_evaluation_between_steps_runs_without_layer_hooks_and_training_stays_exact(float64, context, mode, path):
    notes: list = []
    model = _model(notes)
    reference_model = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=0.0)
    batches = [_data(4, seed=1), _data(3, seed=2), _data(5, seed=3)]
    _step(engine, opt, model, batches[0], path)
    assert notes[-1] > 0  # a training forward runs the engine's hooks
    before = _hook_dicts(model)
    with context():
        out = model(batches[1][0])
    assert notes[-1] == 0  # every layer ran on torch's fast path
    assert not out.requires_grad
    after = _hook_dicts(model)
    assert all(a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[3] == b[3] for a, b in zip(before, after))
    for batch in batches[1:]:  # the steps after an evaluation are exact
        got = _step(engine, opt, model, batch, path)
        assert notes[-1] > 0
        want = reference_clipped_gradient(reference_model, _losses, batch, max_grad_norm=R)
        assert_matches(got, want, what=f"{mode}/{path} after an evaluation")


def test_a_users_hooks_run_in_evaluation_in_their_order_and_changes_between_evaluations_count(float64):
    notes: list = []
    model = _model(notes)
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum")
    ran: list = []
    model[0].register_forward_pre_hook(lambda m, a: ran.append("pre"))
    model[0].register_forward_hook(lambda m, a, o: ran.append("post"))
    x, _ = _data(4, seed=1)
    with torch.no_grad():
        model(x)
    assert ran == ["pre", "post"]
    assert notes[-1] == 2  # the user's two hooks, none of the engine's
    # a hook added to a layer that held only the engine's hooks, and one removed, between two evaluations
    late = model[4].register_forward_hook(lambda m, a, o: ran.append("late"))
    with torch.no_grad():
        model(x)
    assert ran[2:] == ["pre", "post", "late"]
    late.remove()
    with torch.no_grad():
        model(x)
    assert ran[5:] == ["pre", "post"]


def test_an_evaluation_that_raises_puts_the_hooks_back(float64):
    notes: list = []
    model = _model(notes)
    reference_model = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=0.0)
    before = _hook_dicts(model)
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(torch.randn(4, 7, dtype=torch.float64))  # a width the first layer cannot take
    after = _hook_dicts(model)
    assert all(a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[3] == b[3] for a, b in zip(before, after))
    batch = _data(4, seed=2)
    got = _step(engine, opt, model, batch, "engine")
    assert_matches(got, reference_clipped_gradient(reference_model, _losses, batch, max_grad_norm=R),
                   what="after an evaluation that raised")


class GradInside(nn.Module):
    """A forward that enables gradients for part of itself, whatever the caller's mode."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 3)

    def forward(self, x):
        with torch.enable_grad():
            return self.inner(x)


def test_gradients_enabled_inside_an_evaluation_never_release_a_raw_gradient(float64):
    """Under no_grad the layers run without the engine's hooks; a forward that turns gradients on inside does not get
    a private layer call then, and its backward must not leave autograd's unclipped gradient to be applied."""
    torch.manual_seed(0)
    model = GradInside().double()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum")
    x, y = _data(4, seed=1)
    with torch.no_grad():
        out = model(x)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="inner.*torch.no_grad"):
        F.cross_entropy(out, y, reduction="sum").backward()
        opt.step()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_evaluated_between_steps_stays_exact(float64, backend):
    """torch.compile guards on the modules' hooks: the evaluation compiles its own variant, training keeps its own."""
    notes: list = []
    model = _model(notes)
    reference_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    engine, opt = attached_engine(compiled, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum", lr=0.0)
    for k, batch in enumerate([_data(4, seed=1), _data(4, seed=2), _data(4, seed=3)]):
        with torch.no_grad():
            compiled(batch[0])
        got = _step(engine, opt, compiled, batch, "engine")
        want = reference_clipped_gradient(reference_model, _losses, batch, max_grad_norm=R)
        assert_matches({n.removeprefix("_orig_mod."): g for n, g in got.items()}, want,
                       what=f"torch.compile({backend}), step {k} after an evaluation")
