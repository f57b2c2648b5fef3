"""The per-sample fallback (torch.func replay) and structurally recognised RMS norms.

Modules without a rule must get exactly the oracle's clipped gradient in every mode, through
engine.backward and a plain loss.backward(); modules that mix samples, replays that do not
reproduce the call, and a norm-shaped module that is not an RMS norm must be refused.
"""
from __future__ import annotations

import copy
import functools
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.layers import FallbackRule, fallback_modules, resolve_rule
from dptrain.layers.fallback import SampleMixingError
from dptrain.layers.norms import RecognisedRMSNormRule
from dptrain.testing import attached_engine, trainable_named_parameters
from helpers import (
    MODES,
    SINGLE_BACKWARD_MODES,
    TWO_PASS_MODES,
    Case,
    assert_matches,
    classify,
    classify_tokens,
    engine_clipped_sum,
    reference,
    resolve_style,
    reweighted_reference,
    split_max_grad_norm,
    with_oracle,
)

# the engine's one-time warning naming the fallback layers (tested below)
pytestmark = pytest.mark.filterwarnings("ignore:.*use the per-sample fallback:UserWarning")

B = 4  # a power of two: the mean over the batch scales gradients without rounding


# --------------------------------------------------------------------------- modules only the fallback covers
class Scale(nn.Module):
    """out = x * scale: a parameter used directly in the forward."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.5 * torch.randn(n))

    def forward(self, x):
        return x * self.scale


class SquaredLinear(nn.Linear):
    """A Linear subclass that overrides forward (so the Linear rule does not apply)."""

    def forward(self, x):
        return F.linear(x, self.weight * self.weight.abs(), self.bias)


class BareLinear(nn.Module):
    """A bare nn.Parameter used with F.linear, called with a keyword argument and a broadcast mask."""

    def __init__(self, d, h):
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, d) / math.sqrt(d))
        self.b = nn.Parameter(0.5 * torch.randn(h))

    def forward(self, x, mask=None):
        out = torch.tanh(F.linear(x, self.w, self.b))
        return out if mask is None else out * mask


class PositionParam(nn.Module):
    """Returns its parameter for the sequence length of x, shape [1, T, d]: broadcast over the batch."""

    def __init__(self, max_len, d):
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_len, d))

    def forward(self, x):
        return self.table[: x.shape[1]].unsqueeze(0)


class FallbackNet(nn.Module):
    def __init__(self, d=4, h=5, C=3, T=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.pos = PositionParam(6, h)
        self.scale = Scale(h)
        self.sq = SquaredLinear(h, h)
        self.bare = BareLinear(h, C)
        self.register_buffer("mask", (torch.arange(C) % 2 + 0.5).reshape(1, 1, C))

    def forward(self, x):
        h = self.inp(x) + self.pos(x)
        h = self.scale(torch.tanh(h))
        h = torch.tanh(self.sq(h)) + self.scale(h)  # the scale module called twice
        return self.bare(h, mask=self.mask)


def fallback_case(seed: int = 0, frozen: bool = False) -> Case:
    """Random widths and sequence length; ``frozen``: some parameters of fallback layers frozen."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    d, h, C, T = rng.randint(2, 5), rng.randint(2, 6), rng.randint(2, 4), rng.randint(1, 5)
    model = FallbackNet(d, h, C)
    if frozen:
        model.bare.b.requires_grad_(False)
        model.sq.bias.requires_grad_(False)
    x = torch.randn(B, T, d, generator=g) * 2
    return Case(model, classify_tokens, (x, torch.randint(0, C, (B, T), generator=g)))


class ScaledBlock(nn.Module):
    """A parameter of its own around a child that has a rule: x + gamma * fc(x)."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gamma = nn.Parameter(0.5 + torch.rand(d))

    def forward(self, x):
        return x + self.gamma * torch.tanh(self.fc(x))


def block_case() -> Case:
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), ScaledBlock(6), ScaledBlock(6), nn.Linear(6, 3))
    return Case(model, classify, (torch.randn(B, 4, generator=g) * 2, torch.randint(0, 3, (B,), generator=g)))


# --------------------------------------------------------------------------- norm-shaped modules
class PlainRMSNorm(nn.Module):
    """An RMS norm no rule names, statistics in float32 as the Llama family computes them."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class OnePlusRMSNorm(nn.Module):
    """Gemma's form: (1 + weight) * x / rms(x)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class BufferedRMSNorm(PlainRMSNorm):
    """An RMS norm whose epsilon lives in a buffer: its normalised input comes from the generic replay, which protects
    buffers (the others' from their own forward with the weight swapped in its slot)."""

    def __init__(self, d, eps=1e-6):
        super().__init__(d, eps)
        self.register_buffer("eps_buffer", torch.tensor(eps))

    def forward(self, x):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps_buffer)
        return self.weight * xf.to(x.dtype)


class MeanAbsNorm(nn.Module):
    """Shaped like an RMS norm (one weight [d], an eps) but divides by the mean absolute value."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


class NormNet(nn.Module):
    def __init__(self, norm, d=4, h=6, C=3):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(d, h), norm, nn.Linear(h, C)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.inp(x))))


def norm_case(kind: str) -> Case:
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(2)
    norm = {"plain": PlainRMSNorm, "one-plus": OnePlusRMSNorm, "buffered": BufferedRMSNorm,
            "mean-abs": MeanAbsNorm}[kind](6)
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(6, generator=g))
    x = torch.randn(B, 3, 4, generator=g) * 2
    return Case(NormNet(norm), classify_tokens, (x, torch.randint(0, 3, (B, 3), generator=g)))


class AliasBlock(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.tanh(self.layer(x))


class AliasedNet(nn.Module):
    """CoaT's shape: a parameter of the root's own (its cls token), so the root goes through the fallback,
    and one layer registered under two names, at the root and inside a block, called through both."""

    def __init__(self, kind, d=3, C=3):
        super().__init__()
        layer = nn.Conv2d(d, d, 3, padding=1) if kind == "conv" else nn.Linear(d, d)
        self.kind = kind
        self.shared = layer
        self.block = AliasBlock(layer)
        self.token = nn.Parameter(torch.randn(d))
        self.head = nn.Linear(d, C)

    def forward(self, x):
        token = self.token[:, None, None] if self.kind == "conv" else self.token
        h = self.block(self.shared(x) * (1 + token) + token)
        return self.head(h.mean((2, 3)) if self.kind == "conv" else h)


def aliased_case(kind: str, seed: int = 5, n: int = B) -> Case:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = AliasedNet(kind)
    shape = (n, 3, 5, 4) if kind == "conv" else (n, 3)
    return Case(model, classify, (torch.randn(*shape, generator=g) * 2, torch.randint(0, 3, (n,), generator=g)))


class AffineScalars(nn.Module):
    """timm's LearnableAffineBlock: scale * x + bias with scalar parameters."""

    def __init__(self, scale=1.3, bias=0.2):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([scale]))
        self.bias = nn.Parameter(torch.tensor([bias]))

    def forward(self, x):
        return self.scale * x + self.bias


def affine_before_norm(C=4):
    """The affine block before a GroupNorm with one channel per group, which removes each channel's mean and
    scale: the true gradients of `bias` (and, but for the norm's eps, of `scale`) are 0, their per-sample values
    rounding noise."""
    return nn.Sequential(nn.Conv2d(3, C, 3), AffineScalars(), nn.GroupNorm(C, C), nn.Tanh(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(C, 3))


def affine_norm_case(seed: int = 7) -> Case:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return Case(affine_before_norm(), classify,
                (torch.randn(B, 3, 6, 5, generator=g) * 2, torch.randint(0, 3, (B,), generator=g)))


CASES = {
    "fallback-modules": fallback_case,
    "fallback-modules-seed-1": lambda: fallback_case(1),
    "fallback-modules-seed-2-frozen": lambda: fallback_case(2, frozen=True),
    "rms-norm-plain": lambda: norm_case("plain"),
    "rms-norm-one-plus": lambda: norm_case("one-plus"),
    "rms-norm-buffered": lambda: norm_case("buffered"),
    "rms-norm-check-fails": lambda: norm_case("mean-abs"),  # shaped like one, handed to the fallback
    "fallback-around-child": block_case,  # the child's hooks stay silent while its parent is replayed
    "fallback-root-aliased-conv": lambda: aliased_case("conv"),  # a layer registered under two names
    "fallback-root-aliased-linear": lambda: aliased_case("linear"),
    "fallback-zero-gradient-before-norm": affine_norm_case,  # accepted: its gradient sums are rounding noise
}

@functools.cache
def built(name):
    return with_oracle(CASES[name])


def _engine(case, **kwargs):
    return engine_clipped_sum(case, quiet=True, **kwargs)


# The Llama-style norm computes in float32 inside a float64 model. A second backward of
# sum_i C_i L_i (the two-pass modes) rounds the C_i-scaled gradients there, where the oracle rounds
# unscaled ones and scales after: those modes are also checked exactly against that same backward
# driven by the oracle's own clipping factors.
FLOAT32_INSIDE = {"rms-norm-plain", "rms-norm-buffered"}


def check_against_oracle(name, case, R, ref, got, mode, float32_inside):
    if name in float32_inside and mode in TWO_PASS_MODES:
        assert_matches(got, ref, rtol=1e-6, what=f"{name} {mode}: float32 rounding inside the model only")
        ref = reweighted_reference(case, R)
    assert_matches(got, ref, what=f"{name} {mode} engine.backward")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_engine_backward_matches_oracle(name, mode):
    case, R, ref = built(name)
    check_against_oracle(name, case, R, ref, _engine(case, mode=mode, max_grad_norm=R), mode, FLOAT32_INSIDE)


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_loss_backward_matches_oracle(name, mode):
    case, R, ref = built(name)
    assert_matches(_engine(case, mode=mode, max_grad_norm=R, path="mean"), ref, what=f"{name} {mode} loss.backward")


@pytest.mark.parametrize("style", ["layer-wise", "param-wise", "groups"])
@pytest.mark.parametrize("mode", ["ghost", "bk", "bk-mixopt"])
def test_clipping_styles_match_oracle(mode, style):
    case, _, _ = built("fallback-modules")
    style_value = resolve_style(style, case.model)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        R = split_max_grad_norm(case, style_value)
        ref = reference(case, max_grad_norm=R, clipping_style=style_value)
    finally:
        torch.set_default_dtype(previous)
    got = _engine(case, mode=mode, max_grad_norm=R, clipping_style=style_value)
    assert_matches(got, ref, what=f"{mode} {style}")


@pytest.mark.parametrize("kind", ["plain", "one-plus", "buffered"])
def test_a_recognised_norms_own_weight_stays_in_its_slot(kind):
    """The normalised input is the norm's own forward with another weight in the weight's slot, at every backward:
    the user's parameter is back in its slot after each step, and a step that raises inside that forward puts it back
    too."""
    case = norm_case(kind)
    model, norm = case.model, case.model.norm
    weight = norm.weight
    engine = dptrain.PrivacyEngine(model, batch_size=B, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    try:
        for _ in range(2):
            engine.backward(case.losses_fn(model, *case.batch))
            optimizer.step()
            optimizer.zero_grad()
            assert norm.weight is weight and norm._parameters["weight"] is weight
        losses = case.losses_fn(model, *case.batch)
        forward = type(norm).forward

        def failing(self, x):  # the replay of the norm raises; the model's own forward already ran
            raise RuntimeError("a forward that fails when run again")

        type(norm).forward = failing
        try:
            with pytest.raises(RuntimeError, match="fails when run again"):
                engine.backward(losses)
        finally:
            type(norm).forward = forward
        assert norm.weight is weight and norm._parameters["weight"] is weight
    finally:
        engine.detach()


def test_micro_batches_accumulate_exactly():
    case, R, ref = built("fallback-modules")
    assert_matches(_engine(case, mode="bk-mixopt", max_grad_norm=R, micro_batches=2), ref, what="two micro-batches")


# --------------------------------------------------------------------------- which rule, and reports
def test_rules_are_preferred_and_norms_recognised_before_the_fallback():
    model = FallbackNet()
    assert not isinstance(resolve_rule(model.inp), FallbackRule)
    assert isinstance(resolve_rule(model.scale), FallbackRule)
    assert isinstance(resolve_rule(model.sq), FallbackRule)  # overrides Linear.forward
    assert resolve_rule(model.scale, allow_fallback=False) is None
    assert isinstance(resolve_rule(PlainRMSNorm(4), allow_fallback=False), RecognisedRMSNormRule)
    assert not isinstance(resolve_rule(nn.RMSNorm(4)), RecognisedRMSNormRule)  # torch's has its own rule
    assert fallback_modules(model) == ["pos", "scale", "sq", "bare"]
    model.scale.requires_grad_(False)
    assert fallback_modules(model) == ["pos", "sq", "bare"]


def test_without_the_fallback_uncovered_modules_are_refused_as_before():
    model = FallbackNet()
    assert dptrain.find_problems(model) == []
    problems = dptrain.find_problems(model, allow_fallback=False)
    assert len(problems) == 4
    assert any("scale (Scale)" in p and "register a rule" in p for p in problems)
    assert any("sq (SquaredLinear) subclasses Linear but overrides forward" in p for p in problems)
    with pytest.raises(ValueError, match="bare"):
        dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=1.0, allow_fallback=False)
    # a recognised norm needs no fallback
    dptrain.validate(NormNet(PlainRMSNorm(6)), allow_fallback=False)


def test_plan_counts_no_call_of_a_replay():
    """The fallback's forward checks replay its module, children included: plan() counts only real calls."""
    case = block_case()
    planned = {d.name: d for d in dptrain.plan(case.model, case.batch[0])}
    assert planned["1"].norm == "fallback" and planned["1.fc"].T == 1 and planned["2.fc"].T == 1


def test_plan_on_the_meta_device_needs_no_data():
    """Shapes are all plan() needs: the fallback's and recognised norms' numerical checks wait for real data."""
    with torch.device("meta"):
        model = nn.Sequential(FallbackNet(), NormNet(PlainRMSNorm(6), d=3))
        planned = {d.name: d.norm for d in dptrain.plan(model, torch.zeros(4, 3, 4))}
    assert planned["0.sq"] == "fallback" and planned["1.norm"] == "instantiate"


def test_plan_and_last_decisions_label_fallback_layers():
    torch.manual_seed(0)
    model = FallbackNet()
    x = torch.randn(4, 3, 4)
    planned = {d.name: d for d in dptrain.plan(model, x)}
    assert planned["sq"].norm == "fallback" and planned["sq"].instantiate_cost == 5 * 5 + 5
    assert planned["inp"].norm != "fallback"
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=0.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        engine.backward(F.cross_entropy(model(x).transpose(1, 2), torch.zeros(4, 3, dtype=torch.long),
                                        reduction="none"))
        labels = {d.name: d.norm for d in engine.last_decisions()}
    finally:
        engine.detach()
    assert labels["bare"] == "fallback" and labels["inp"] != "fallback"


# --------------------------------------------------------------------------- refusals
def _one_step(model, x, y, **kwargs):
    engine = dptrain.PrivacyEngine(model, batch_size=x.shape[0], sample_size=100, noise_multiplier=0.0, **kwargs)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    finally:
        engine.detach()


class BatchCentred(nn.Module):
    """Subtracts the batch mean: mixes samples in the forward."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.weight


class _MixedBackward(torch.autograd.Function):
    """Identity forward whose backward averages the gradient over the batch."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g.mean(0, keepdim=True).expand_as(g)


class MixedBackward(nn.Module):
    """Samples independent in the forward, coupled in the backward: only the gradient check sees it."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return _MixedBackward.apply(x * self.weight)


class Noisy(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.dropout(x * self.weight, 0.5, self.training)


def _batch(d=4, n=4):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("module, why", [
    (BatchCentred, "changing one sample's input changed the outputs of the others"),
    (MixedBackward, "do not sum to the gradient of the whole batch"),
    (Noisy, "does not reproduce its output"),
])
def test_modules_that_mix_samples_or_do_not_replay_are_refused(module, why):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), module(4), nn.Linear(4, 3))
    x, y = _batch()
    with pytest.raises(RuntimeError, match=f"{module.__name__}.*{why}"):
        _one_step(model, x, y)
    assert all(p.grad is None for p in model.parameters())


def test_mixing_is_checked_per_input_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), BatchCentred(4), nn.Linear(4, 3))
    x, y = _batch(n=1)
    _one_step(model, x, y)  # one sample cannot be mixed with another
    x, y = _batch(n=4)
    with pytest.raises(RuntimeError, match="mixes the samples"):
        _one_step(model, x, y)


def test_norm_whose_numerical_check_fails_is_not_trusted():
    """Refused without the fallback; with it, handed to the fallback (exact: see the 'rms-norm-check-fails'
    case above) with a warning."""
    torch.manual_seed(0)
    model = NormNet(MeanAbsNorm(6))
    assert isinstance(resolve_rule(model.norm, allow_fallback=False), RecognisedRMSNormRule)
    dptrain.validate(model, allow_fallback=False)  # structurally it is one; only its first call can tell
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
    with pytest.raises(ValueError, match=r"MeanAbsNorm looks like an RMS norm.*not x / sqrt\(mean\(x\^2\) \+ eps\)"):
        _one_step(model, x, y, allow_fallback=False)
    with pytest.warns(UserWarning, match="MeanAbsNorm looks like an RMS norm.*per-sample fallback instead"):
        _one_step(model, x, y)


def test_recognised_norm_reproduces_float32_statistics_in_bfloat16():
    """Per-sample gradients of a bf16 Llama-style norm equal the oracle's (xhat is the module's own)."""
    torch.manual_seed(0)
    norm = PlainRMSNorm(6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(6).to(torch.bfloat16))
    rule = resolve_rule(norm)
    x = torch.randn(3, 5, 6).to(torch.bfloat16)
    out = norm(x)
    activation = rule.capture_call(norm, (x,), {}, out)
    g = torch.randn_like(out)
    got = rule.per_sample_grads(norm, rule.operands(norm, activation, g), {"weight"})["weight"]
    want = torch.stack([torch.autograd.grad((norm(x[i:i + 1]).float() * g[i:i + 1].float()).sum(), norm.weight)[0]
                        for i in range(3)]).float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


class DtypeProbe(BareLinear):
    """Records the dtype its linear map computes in, at every call and replay."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.seen: list[torch.dtype] = []

    def forward(self, x, mask=None):
        out = F.linear(x, self.w, self.b)
        self.seen.append(out.dtype)
        return torch.tanh(out)


def test_replay_runs_under_the_autocast_of_the_recorded_call():
    """bf16 autocast around the forward: the replays (checks, per-sample gradients, in the backward
    outside autocast) run under it, and the per-sample gradients are autograd's one sample at a time
    under autocast."""
    torch.manual_seed(0)
    module = DtypeProbe(8, 6)
    rule = resolve_rule(module)
    x = torch.randn(4, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
        call = rule.capture_call(module, (x,), {}, out)
    assert out.dtype == torch.bfloat16
    g = torch.randn(out.shape).to(out.dtype)
    got = rule.per_sample_grads(module, rule.operands(module, call, g), {"w", "b"})
    assert len(module.seen) > 3 and set(module.seen) == {torch.bfloat16}  # call, check replays, vmap, sum check
    for i in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_i = module(x[i:i + 1])
        want = torch.autograd.grad(out_i, [module.w, module.b], g[i:i + 1])
        for name, w in zip(("w", "b"), want):
            scale = w.abs().max().item()  # within two roundings of bf16 (2^-8 each) of the largest entry
            torch.testing.assert_close(got[name][i], w, rtol=0, atol=2 ** -7 * scale, msg=f"{name}, sample {i}")


def test_input_modified_in_place_after_the_call_is_refused():
    torch.manual_seed(0)
    module = Scale(4)
    rule = resolve_rule(module)
    x = torch.randn(3, 4)
    out = module(x)
    call = rule.capture_call(module, (x,), {}, out)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        rule.operands(module, call, torch.ones_like(out))


def test_engine_warns_once_naming_the_fallback_layers():
    model = FallbackNet()
    with pytest.warns(UserWarning, match="4 layer.*use the per-sample fallback: pos, scale, sq, bare"):
        dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=0.0)
    with warnings.catch_warnings():  # recognised norms and rules: no warning
        warnings.simplefilter("error")
        dptrain.PrivacyEngine(NormNet(PlainRMSNorm(6)), batch_size=4, sample_size=100, noise_multiplier=0.0)


def test_fallback_warning_names_the_modules():
    from dptrain.layers.fallback import fallback_warning

    assert fallback_warning([]) is None
    text = fallback_warning(["scale", "bare"])
    assert "scale, bare" in text and "allow_fallback=False" in text and "register_layer" in text
    assert "and 2 more" in fallback_warning([f"m{k}" for k in range(10)])


# --------------------------------------------------------------------------- container outputs
class PairOutput(nn.Module):
    """A parameter of its own and a tuple output: the scaled input, and the input itself (no parameter in it)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight, x


class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair, self.head = PairOutput(4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.pair(x)[0])


def test_fallback_layer_with_a_tuple_output_is_exact_not_dropped():
    torch.manual_seed(0)
    dptrain.testing.assert_rule_exact(PairNet(), torch.randn(4, 3, 4), allow_fallback=True)


class ManyOutputs(nn.Module):
    """Own parameters (a gate, a temperature) and a child in several outputs of a container: features, attention
    weights, a second output of the gate (which the nets below leave unused), integer ids and None."""

    def __init__(self, d, kind):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.randn(d))
        self.temperature = nn.Parameter(torch.tensor([0.7]))

    def forward(self, x):  # [B, T, d]
        h = self.proj(x) * torch.sigmoid(self.gate)
        weights = torch.softmax(self.temperature * x @ x.transpose(1, 2), -1)
        extra = torch.tanh(h) * self.gate
        ids = x.argmax(-1)
        if self.kind == "tuple":
            return h, weights, extra, ids, None
        if self.kind == "list":
            return [h, [weights, extra], ids]
        if self.kind == "dict":
            return {"ids": ids, "weights": weights, "h": h, "extra": extra}
        if self.kind == "twice":  # the same tensor in two places: each gets its own gradient
            return h, h, weights
        from transformers.modeling_outputs import BaseModelOutput  # a dict subclass, flattened by torch's pytree

        return BaseModelOutput(last_hidden_state=h, hidden_states=(extra,), attentions=(weights,))


class ManyOutputsNet(nn.Module):
    def __init__(self, kind, d=4):
        super().__init__()
        self.kind = kind
        self.block, self.head = ManyOutputs(d, kind), nn.Linear(d, 3)

    def forward(self, x):
        out = self.block(torch.tanh(x))
        if self.kind == "tuple":
            h, weights = out[0], out[1]  # out[2] (it depends on the gate) unused
        elif self.kind == "list":
            h, weights = out[0], out[1][0]
        elif self.kind == "dict":
            h, weights = out["h"], out["weights"]
        elif self.kind == "twice":
            h, weights = out[0] + 2 * torch.tanh(out[1]), out[2]
        else:
            h, weights = out.last_hidden_state, out.attentions[0]
        return self.head(weights @ h + h)


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "twice", "model-output"])
def test_fallback_layer_with_a_container_output_is_exact(kind):
    """Every leaf that depends on the layer's parameters is differentiated (one unused: its gradient is zero),
    in every mode and through both backward paths."""
    if kind == "model-output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    dptrain.testing.assert_rule_exact(ManyOutputsNet(kind), torch.randn(4, 3, 4), allow_fallback=True)


class WithTable(nn.Module):
    """Its features, and a table made of its own parameters alone, broadcast over the batch ([1, T, T]) as T5's
    position bias is."""

    def __init__(self, d, T):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.table = nn.Parameter(torch.randn(T, T))

    def forward(self, x):
        return x * self.weight, torch.tanh(self.table)[None]


class TableNet(nn.Module):
    def __init__(self, use, d=4, T=3):
        super().__init__()
        self.use = use
        self.first, self.block, self.head = nn.Linear(d, d), WithTable(d, T), nn.Linear(d, 3)

    def forward(self, x):
        h, table = self.block(torch.tanh(self.first(x)))
        if self.use == "table":
            h = table @ h
        elif self.use == "detached":
            h = h * table.detach().sum()
        return self.head(h)


@pytest.mark.parametrize("path", ["engine.backward", "loss.backward"])
def test_output_without_the_batch_that_depends_on_the_parameters_is_refused(path):
    torch.manual_seed(0)
    model = TableNet("table").double()
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        losses = model(x).square().sum((1, 2))
        with pytest.raises(ValueError, match=r"block \(WithTable\): its output \[1\] depends on the layer's trainable "
                                             r"parameters but does not lead with the call's 4 rows.*register a rule"):
            engine.backward(losses) if path == "engine.backward" else losses.mean().backward()
    finally:
        engine.detach()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("use", ["unused", "detached"])
def test_output_without_the_batch_that_no_gradient_reaches_is_left_alone(use):
    torch.manual_seed(0)
    dptrain.testing.assert_rule_exact(TableNet(use), torch.randn(4, 3, 4), allow_fallback=True)


class Holder:
    """An object torch's pytree does not look into."""

    def __init__(self, tensor):
        self.tensor = tensor


class HidesATensor(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight, Holder(torch.tanh(x) * self.weight)


def test_output_hidden_in_an_object_that_the_loss_does_not_use_is_exact():
    """A tensor in an object torch's pytree does not flatten (a cache of keys and values) is not differentiated by
    the fallback; the loss does not use it: the step is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), HidesATensor(4), Pick(0), nn.Linear(4, 3))
    dptrain.testing.assert_rule_exact(model, _batch()[0], allow_fallback=True)


class UsesHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), HidesATensor(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        out, holder = self.inner(x)
        return self.head(out + holder.tensor)


@pytest.mark.parametrize("path", ["engine.backward", "loss.backward"])
def test_output_hidden_in_an_object_that_the_loss_uses_is_refused(path):
    """Its graph does not reach the parameter (switched off during the layer's call): its gradient would be dropped.
    Refused when the gradient reaches it, naming the module; no gradient is given."""
    torch.manual_seed(0)
    model = UsesHidden()
    x, y = _batch()
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        for _ in range(2):  # (the second call takes what the first one read from its cache)
            losses = F.cross_entropy(model(x), y, reduction="none")
            with pytest.raises(ValueError, match=r"inner.1 \(HidesATensor\): the loss depends on its output \[1\], a "
                                                 r"Holder holding tensors that depend on its trainable parameters"):
                engine.backward(losses) if path == "engine.backward" else losses.mean().backward()
    finally:
        engine.detach()
    assert all(p.grad is None for p in model.parameters())


class Pick(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, out):
        return out[self.k]


class MixesInSecond(nn.Module):
    """Samples apart in its first output, the batch mean in its second."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = x * self.weight
        return h, h.mean(0, keepdim=True).expand_as(h)


class Swapped(nn.Module):
    """Samples apart in both outputs; the model feeds the second one's rows to other samples."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight, torch.tanh(x) * self.weight.square()


class SecondOutputNet(nn.Module):
    def __init__(self, block, d=4):
        super().__init__()
        self.first, self.block, self.head = nn.Linear(d, d), block, nn.Linear(d, 3)

    def forward(self, x):
        a, b = self.block(torch.tanh(self.first(x)))
        if isinstance(self.block, Swapped):
            b = b.flip(0)
        return self.head(a + b)


@pytest.mark.parametrize("path", ["engine.backward", "loss.backward"])
@pytest.mark.parametrize("block, why", [
    (MixesInSecond, r"block \(MixesInSecond\) mixes the samples of a batch: changing one sample's input"),
    (Swapped, r"block \(Swapped\): .*rows along the first axis mix the gradients of several samples"),
])
def test_samples_mixed_in_any_output_are_refused(block, why, path):
    """The forward check replays every output that depends on the parameters; the rows of the joined gradient
    are read from tag passes, so an output whose rows the model hands to other samples shows too."""
    torch.manual_seed(0)
    model = SecondOutputNet(block(4)).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with pytest.raises(RuntimeError if block is MixesInSecond else ValueError, match=why):
            losses = model(x).square().sum(1)
            engine.backward(losses) if path == "engine.backward" else losses.mean().backward()
    finally:
        engine.detach()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode, path", [(m, "engine.backward") for m in MODES]
                         + [(m, "loss.backward") for m in SINGLE_BACKWARD_MODES])
def test_one_sample_through_a_container_output_moves_the_model_by_at_most_R(mode, path):
    """A batch of one (noise 0, SGD lr 1): each step moves the model by R exactly, never more."""
    torch.manual_seed(0)
    model, R = ManyOutputsNet("tuple").double(), 0.05  # far below the gradient norm: every step is clipped
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, lr=1.0)
    try:
        for _ in range(2):
            before = [p.detach().clone() for p in model.parameters()]
            losses = 10 * model(x).square().sum((1, 2))
            engine.backward(losses) if path == "engine.backward" else losses.mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
            assert update.norm() <= R * (1 + 1e-9), f"{mode}: one sample moved the model by {update.norm():.4g} > {R}"
            assert update.norm() >= R * (1 - 1e-9)  # clipped to R, not dropped
            assert not torch.equal(model.block.gate.detach(), before[1])
    finally:
        engine.detach()


def test_plan_counts_a_container_output_layer_as_fallback():
    torch.manual_seed(0)
    planned = {d.name: d for d in dptrain.plan(ManyOutputsNet("dict"), torch.randn(4, 3, 4))}
    assert planned["block"].norm == "fallback" and planned["block"].instantiate_cost == 4 + 1
    assert planned["block.proj"].norm != "fallback"


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_and_batch_of_one(mode):
    """An empty batch (Poisson sampling) contributes nothing; a batch of one is its own oracle."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), Scale(5), SquaredLinear(5, 5), nn.Tanh(), BareLinear(5, 3)).double()
    batch = (torch.randn(3, 2, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (3, 2), generator=g))
    case = Case(net, classify_tokens, batch)
    model = copy.deepcopy(case.model)
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=0.5)
    try:
        x, y = case.batch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.backward(case.losses_fn(model, x[:0], y[:0]))
            engine.backward(case.losses_fn(model, x[:1], y[:1]))
        optimizer.step()
        got = {n: p.grad for n, (_, p) in trainable_named_parameters(model).items()}
    finally:
        engine.detach()
    one = Case(case.model, case.losses_fn, (x[:1], y[:1]))
    assert_matches(got, reference(one, max_grad_norm=0.5), what=f"{mode}: empty batch, then one sample")


def test_recognised_norm_input_modified_in_place_is_refused():
    norm = PlainRMSNorm(4)
    rule = resolve_rule(norm)
    x = torch.randn(3, 2, 4)
    out = norm(x)
    call = rule.capture_call(norm, (x,), {}, out)
    x.add_(1)
    with pytest.raises(RuntimeError, match="PlainRMSNorm was modified in place"):
        rule.operands(norm, call, torch.ones_like(out))


class TimeMix(nn.Module):
    """Sequence-first [T, B, d]: mixes the time steps (dim 0) of each sample, never the samples."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x, lengths):
        return x * self.weight + 0.5 * x.cumsum(0) * self.weight.square() + lengths[:, None]


def test_sequence_first_calls_are_replayed_in_their_own_layout():
    """With batch_first=False the engine hands rules a call with dims 0 and 1 of its tensors swapped
    (batch first); the fallback swaps them back to replay it: per-sample gradients as autograd's."""
    torch.manual_seed(0)
    module = TimeMix(3).double()
    rule = resolve_rule(module, batch_first=False)
    x = torch.randn(5, 4, 3, dtype=torch.float64)  # [T, B, d]
    lengths = torch.rand(4, dtype=torch.float64)   # [B]: one dim, not swapped
    out = module(x, lengths)
    call = rule.capture_call(module, (x.transpose(0, 1), lengths), {}, out.transpose(0, 1))
    g = torch.randn_like(out)
    got = rule.per_sample_grads(module, rule.operands(module, call, g.transpose(0, 1)), {"weight"})["weight"]
    for i in range(4):
        want = torch.autograd.grad(module(x[:, i:i + 1], lengths[i:i + 1]), module.weight, g[:, i:i + 1])[0]
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="TimeMix.*could not replay this call"):  # the call taken as batch first
        resolve_rule(module).capture_call(module, (x.transpose(0, 1), lengths), {}, out.transpose(0, 1))


# --------------------------------------------------------------------------- aliased submodules
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_aliased_layer_under_a_fallback_root_keeps_its_parameters_and_bounds_one_sample(kind, mode):
    """The fallback replays a root whose subtree holds one layer under two names: after each step every
    parameter is still the nn.Parameter the optimizer holds (no plain tensor left in the model), the
    shared layer is updated, and one sample moves the model by at most max_grad_norm (noise 0, SGD lr 1)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        case = aliased_case(kind, seed=6, n=1)
    finally:
        torch.set_default_dtype(previous)
    model, R = case.model, 0.05  # far below the gradient norm: every step is clipped
    objects = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    assert objects["shared.weight"] is objects["block.layer.weight"]
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, lr=1.0)
    try:
        for _ in range(3):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine.backward(case.losses(model))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after = dict(model.named_parameters(remove_duplicate=False))
            assert after.keys() == objects.keys()
            assert all(after[n] is p and type(p) is nn.Parameter for n, p in objects.items())
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            assert {id(p) for p in model.parameters()} == held
            update = torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()])
            assert update.norm() <= R * (1 + 1e-9), f"{mode}: one sample moved the model by {update.norm():.4g} > {R}"
            assert update.norm() >= R * (1 - 1e-9)  # clipped to R, not dropped
            assert not torch.equal(model.shared.weight.detach(), before["shared.weight"])
    finally:
        engine.detach()


def test_replay_swaps_each_aliased_slot_once_and_restores_the_parameters():
    from dptrain.layers.fallback import replay

    model = AliasedNet("linear").double()
    x = torch.randn(2, 3, dtype=torch.float64)
    objects = list(model.named_parameters(remove_duplicate=False))
    token = model.token.detach().clone().requires_grad_(True)
    out = replay(model, (x,), {}, {"token": token})
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    (token_grad,) = torch.autograd.grad(out.sum(), token)
    assert token_grad.abs().sum() > 0
    assert [(n, p) for n, p in model.named_parameters(remove_duplicate=False)] == objects
    assert all(type(p) is nn.Parameter for _, p in objects)


# --------------------------------------------------------------------------- the gradient-sum check's scale
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parameters_with_zero_true_gradient_are_not_taken_for_mixing(dtype):
    """Per-sample gradients of rounding noise sum to a batch gradient of rounding noise: compared with the
    size of the terms that cancelled, not with themselves, they are accepted (float32 as in training)."""
    torch.manual_seed(0)
    model = affine_before_norm(8).to(dtype)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(6, 3, 7, 7, generator=g).to(dtype), torch.randint(0, 3, (6,), generator=g)
    engine = dptrain.PrivacyEngine(model, batch_size=6, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    try:
        for _ in range(2):
            engine.backward(F.cross_entropy(model(x), y, reduction="none"))
            optimizer.step()
            assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
            optimizer.zero_grad(set_to_none=True)
    finally:
        engine.detach()


def test_refusals_name_the_module_path():
    """A rule built with the module's path names it in every refusal (the class alone where none was given)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), BatchCentred(4)), nn.Linear(4, 3))
    module = model[1][1]
    x = torch.randn(4, 4)
    with pytest.raises(SampleMixingError, match=r"^1\.1 \(BatchCentred\) mixes the samples"):
        resolve_rule(module, name="1.1").capture_call(module, (x,), {}, module(x))
    with pytest.raises(SampleMixingError, match=r"^BatchCentred mixes the samples"):
        resolve_rule(module).capture_call(module, (x,), {}, module(x))
    root = MixedBackward(4)
    rule = resolve_rule(root, name="")
    out = root(x)
    ops = rule.operands(root, rule.capture_call(root, (x,), {}, out), torch.randn_like(out))
    with pytest.raises(SampleMixingError, match=r"^<root> \(MixedBackward\) mixes.*do not sum"):
        rule.per_sample_grads(root, ops, {"weight"})
    noisy = Noisy(4)
    with pytest.raises(SampleMixingError, match=r"^head\.drop \(Noisy\): replaying this call does not reproduce"):
        resolve_rule(noisy, name="head.drop").capture_call(noisy, (x,), {}, noisy(x))
    time_mix = TimeMix(3)
    x, lengths = torch.randn(5, 4, 3), torch.rand(4)  # [T, B, d] taken as batch first
    with pytest.raises(RuntimeError, match=r"^t \(TimeMix\): the per-sample fallback could not replay"):
        resolve_rule(time_mix, name="t").capture_call(time_mix, (x.transpose(0, 1), lengths), {},
                                                       time_mix(x, lengths).transpose(0, 1))


# --------------------------------------------------------------------------- modules vmap cannot run
class _OldStyleLinear(torch.autograd.Function):
    """x @ w.T as a custom autograd.Function written for torch < 2.0 (no setup_context): no functorch transform
    (vmap, vjp) can run it, plain autograd can."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class OldStyleLinear(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, d) / math.sqrt(d))

    def forward(self, x):
        return _OldStyleLinear.apply(x, self.w)


class ItemScale(nn.Module):
    """Reads a value on the host with .item() (1 for any non-zero input, in a batch or alone): vmap cannot."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x):
        return x * self.scale * int((x.detach().abs().amax() > 0).item())


class MaskedGate(nn.Module):
    """Keeps x * w where x > 0 by boolean-mask indexing (a data-dependent shape): vmap cannot batch it."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x):
        h = x * self.w
        out = torch.zeros_like(h)
        out[x > 0] = h[x > 0]
        return out


class NoVmapNet(nn.Module):
    def __init__(self, d=4, h=5, C=3):
        super().__init__()
        self.inp, self.old, self.item, self.gate = nn.Linear(d, h), OldStyleLinear(h, h), ItemScale(h), MaskedGate(h)
        self.head = nn.Linear(h, C)

    def forward(self, x):
        return self.head(torch.tanh(self.gate(self.item(torch.tanh(self.old(self.inp(x)))))))


def no_vmap_case(seed: int = 11, n: int = B) -> Case:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 4, generator=g) * 2
    return Case(NoVmapNet(), classify_tokens, (x, torch.randint(0, 3, (n, 3), generator=g)))


_NO_VMAP = {}


def _no_vmap_built():
    if "case" not in _NO_VMAP:
        _NO_VMAP["case"] = with_oracle(no_vmap_case)
    return _NO_VMAP["case"]


@pytest.mark.filterwarnings("ignore:.*one sample at a time:UserWarning")
@pytest.mark.parametrize("mode, path", [(m, "engine.backward") for m in MODES]
                         + [(m, "loss.backward") for m in SINGLE_BACKWARD_MODES])
def test_modules_vmap_cannot_run_are_replayed_one_sample_at_a_time_exactly(mode, path):
    """A custom autograd.Function without setup_context, .item(), boolean-mask indexing: the fallback replays each
    sample alone through plain autograd, and every mode matches the oracle (float64)."""
    case, R, ref = _no_vmap_built()
    got = _engine(case, mode=mode, max_grad_norm=R, **({} if path == "engine.backward" else {"path": "mean"}))
    assert_matches(got, ref, what=f"no-vmap modules {mode} {path}")
    assert set(fallback_modules(case.model)) == {"old", "item", "gate"}


@pytest.mark.filterwarnings("ignore:.*one sample at a time:UserWarning")
@pytest.mark.parametrize("mode", MODES)
def test_one_sample_through_modules_vmap_cannot_run_moves_the_model_by_R(mode):
    """A batch of one (noise 0, SGD lr 1), every step clipped: the update's norm is R exactly."""
    case = no_vmap_case(n=1)
    model, R = case.model.double(), 0.01
    x, y = case.batch
    x = x.double()
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, lr=1.0)
    try:
        for _ in range(2):
            before = [p.detach().clone() for p in model.parameters()]
            engine.backward(10 * F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").sum(1))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
            assert R * (1 - 1e-9) <= update.norm() <= R * (1 + 1e-9), f"{mode}: moved by {update.norm():.4g}"
            assert not torch.equal(model.old.w.detach(), before[2])
    finally:
        engine.detach()


def test_replaying_one_sample_at_a_time_warns_once_naming_the_module():
    case = no_vmap_case()
    engine, _ = attached_engine(case.model, mode="bk-mixopt", max_grad_norm=1.0, lr=0.1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                engine.backward(case.losses_fn(case.model, *case.batch))
    finally:
        engine.detach()
    messages = [str(w.message) for w in caught if "one sample at a time" in str(w.message)]
    assert sorted(m.split(" ")[0] for m in messages) == ["gate", "item", "old"], messages


class BatchSizeBranch(nn.Module):
    """Computes a sample differently alone than in a batch (a branch on the batch size), and reads .item() so that
    only a loop can replay it: the per-sample replays do not reproduce the batch's rows, and it is refused."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x):
        k = int((x.detach().abs().amax() > 0).item())
        return x * self.w * (2.0 if x.shape[0] > 1 else 1.0) * k


class BatchMaxItem(nn.Module):
    """Divides by the batch's largest entry, read with .item(): mixes samples."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x):
        return x * self.w / (1 + x.detach().abs().amax().item())


@pytest.mark.parametrize("module, why", [
    (BatchSizeBranch(4), r"^1 \(BatchSizeBranch\): replaying each sample alone .* does not reproduce"),
    (BatchMaxItem(4), r"^1 \(BatchMaxItem\) mixes the samples"),
])
def test_modules_vmap_cannot_run_that_mix_samples_are_refused(module, why):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), module, nn.Linear(4, 3))
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SampleMixingError, match=why):
            _one_step(model, x, y)


# --------------------------------------------------------------------------- the batch at another axis (issue 19)
class SeqFirstAttention(nn.Module):
    """No rule: raw parameters in einsums, run sequence-first inside a batch-first model, as XLNet's relative attention:
    h [T, B, d], a padding mask [T, T, B] (the batch its third axis), positions [T, B, d] expanded over the batch.
    ``mixes``: it also adds the mean over the batch axis, which no assignment of batch axes can split."""

    def __init__(self, d, kind="tensor", mixes=False):
        super().__init__()
        self.kind, self.mixes = kind, mixes
        self.q, self.k, self.v = (nn.Parameter(torch.randn(d, d) / math.sqrt(d)) for _ in range(3))
        self.bias = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, h, mask, pos):
        q = torch.einsum("ibd,de->ibe", h + pos, self.q)
        k = torch.einsum("ibd,de->ibe", h + pos, self.k)
        v = torch.einsum("ibd,de->ibe", h, self.v)
        score = torch.einsum("ibe,jbe->ijb", q, k) - 1e4 * mask
        out = torch.einsum("ijb,jbe->ibe", torch.softmax(score, dim=1), v) + self.bias
        if self.mixes:
            out = out + out.mean(1, keepdim=True)
        return out if self.kind == "tensor" else (out, None)


class SeqFirstNet(nn.Module):
    def __init__(self, d=4, kind="tensor", mixes=False):
        super().__init__()
        self.embed, self.head = nn.Linear(3, d), nn.Linear(d, 3)
        self.block = SeqFirstAttention(d, kind, mixes)
        self.register_buffer("positions", torch.randn(16, d))

    def forward(self, x, pad):  # x [B, T, 3], pad [B, T] (1: a padded token)
        h = self.embed(x).transpose(0, 1)  # [T, B, d]
        T, B = h.shape[:2]
        mask = pad.transpose(0, 1).unsqueeze(0).expand(T, T, B).to(h.dtype)  # mask[i, j, b] = pad[b, j]
        pos = self.positions[:T].unsqueeze(1).expand(T, B, -1)
        out = self.block(h, mask, pos)
        out = out if isinstance(out, torch.Tensor) else out[0]
        return self.head(torch.tanh(out).transpose(0, 1).mean(1))


def _seq_first_case(B, kind, T=4, mixes=False):
    torch.manual_seed(B)
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, T, 3, generator=g)
    pad = torch.zeros(B, T, dtype=torch.long)
    pad[1:, T - 1] = 1  # every sample but the first pads its last token: the mask differs between samples
    if B > 2:
        pad[2, T - 2] = 1
    return Case(SeqFirstNet(kind=kind, mixes=mixes).double(), classify, (x.double(), pad, torch.randint(0, 3, (B,), generator=g)))


@pytest.mark.parametrize("mode, path", [(m, "engine") for m in MODES] + [(m, "mean") for m in SINGLE_BACKWARD_MODES])
@pytest.mark.parametrize("B", [4, 3], ids=["B=T", "B!=T"])
@pytest.mark.parametrize("kind", ["tensor", "tuple"])
def test_sequence_first_module_in_a_batch_first_model_is_exact(kind, B, mode, path):
    """The fallback finds each argument's batch axis (h's second, the mask's third, the positions' second) and the
    output's, among the axes of size B (at B = T several), verifies them and replays each sample along them."""
    case, R, ref = with_oracle(lambda: _seq_first_case(B, kind))
    got = engine_clipped_sum(case, quiet=True, mode=mode, max_grad_norm=R, path=path if path == "engine" or B == 4 else "sum")
    assert_matches(got, ref, what=f"{kind} B={B} {mode} {path}")


@pytest.mark.parametrize("mode, path", [(m, "engine") for m in MODES] + [(m, "mean") for m in SINGLE_BACKWARD_MODES])
def test_sequence_first_module_one_sample_moves_the_model_by_at_most_R(mode, path):
    """B = T, every sample's loss but the first weighted 0: the clipped sum is one sample's, of norm R."""
    case = _seq_first_case(4, "tensor")

    def losses(model, *batch):
        out = classify(model, *batch)
        return out * (torch.arange(out.shape[0]) == 0).to(out.dtype)

    R = 1e-3
    got = engine_clipped_sum(Case(case.model, losses, case.batch), quiet=True, mode=mode, max_grad_norm=R, path=path)
    norm = torch.sqrt(sum(g.square().sum() for g in got.values())).item()
    assert 0.5 * R < norm <= R * (1 + 1e-9), f"{mode} {path}: one sample moved the model by {norm / R:.4g} R"


@pytest.mark.parametrize("B", [4, 3], ids=["B=T", "B!=T"])
@pytest.mark.parametrize("kind", ["tensor", "tuple"])
def test_sequence_first_module_that_mixes_the_batch_is_refused(kind, B):
    """No assignment of batch axes verifies (the output adds the mean over the batch): refused, naming the module."""
    case = _seq_first_case(B, kind, mixes=True)
    with pytest.raises((RuntimeError, ValueError), match=r"block \(SeqFirstAttention\) mixes the samples of a batch"):
        engine_clipped_sum(case, quiet=True, mode="bk-mixopt", max_grad_norm=1.0, path="engine")


def test_sequence_first_axes_are_searched_once_per_call_pattern(monkeypatch):
    """The verified assignment is kept per call pattern: later steps verify it again on their values (a few replays,
    test_fallback_values.py) without searching again."""
    case = _seq_first_case(4, "tensor")
    model = copy.deepcopy(case.model)
    calls = []
    search = FallbackRule._search_axes

    def counting(self, *args, **kwargs):
        calls.append(1)
        return search(self, *args, **kwargs)

    monkeypatch.setattr(FallbackRule, "_search_axes", counting)
    engine, optimizer = attached_engine(model, mode="bk", max_grad_norm=1.0)
    try:
        for _ in range(3):
            engine.backward(case.losses(model))
            optimizer.step()
            optimizer.zero_grad()
    finally:
        engine.detach()
    assert len(calls) == 1


class Elementwise(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return torch.tanh(x * self.w)


def test_two_assignments_of_batch_axes_with_different_gradients_are_refused():
    """x [B, B] times one weight: the batch along either axis reproduces the call sample by sample, but the per-sample
    gradients differ (rows or columns): the fallback cannot tell which is right and refuses, naming the module. With
    one axis of size B there is one assignment."""
    torch.manual_seed(0)
    for shape, B in (((4, 4), 4), ((3, 4), 4)):
        module = Elementwise(1).double()  # one weight for every entry
        x = torch.randn(*shape, dtype=torch.float64)
        rule = FallbackRule(module, "block")
        call = rule._keep_call(module, (x,), {}, x.device)
        with torch.no_grad():
            out = module(x)
        if shape[0] == shape[1]:
            with pytest.raises(SampleMixingError, match=r"block \(Elementwise\): its batch could sit at more than one"):
                rule._search_axes(module, call, [out], (0,), ("",), B)
        else:
            found = rule._search_axes(module, call, [out], (0,), ("",), B)
            assert found.args == ((0, 1),) and found.picked.axes == (1,) and found.picked.shapes == ((3,),)
