"""Mixed precision: bf16 autocast on CPU around the forward (float32 parameters), and bf16 parameters.

The reference is the float64 oracle (dptrain.testing) on the same weights and inputs cast to
float64, without autocast; max_grad_norm lies between the smallest and largest per-sample norm,
so some samples are clipped and others are not. bf16 cannot match it to 1e-10: the tolerance is
what bf16 itself explains, measured per parameter (error relative to the parameter's largest
reference entry) for plain PyTorch in the same precision setting:

  A. the per-sample gradients from autograd, one sample at a time, clipped exactly in float64;
  B. one batched backward of ``sum_i C_i L_i`` with the oracle's factors ``C_i`` (the gradient
     autocast would give if the clipping factors were known in advance).

dptrain's error must be at most ``2 * max(A, B) + 2^-9`` (the last term, half of bf16's unit
roundoff, a margin for the rounding of a result to bf16). The engine's per-sample norms and clipping factors are
observed at the pipeline's call of ``clipping_factors``: they must be float32 and finite, and the
norms close to the oracle's; the clipped gradient is in the parameter's dtype and finite.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
import dptrain.pipeline
from dptrain.testing import attached_engine, per_sample_gradients, trainable_named_parameters
from helpers import MODES, classify, classify_tokens, per_sample

# torch warns that a bf16 input and a float32 weight miss RMSNorm's fused kernel (autocast leaves them so)
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

BF16 = torch.bfloat16
ROUNDING = 2.0 ** -9  # half of bf16's unit roundoff 2^-8 (8 significant bits): a typical rounding error
FACTOR = 2.0          # dptrain may be up to this many times less accurate than plain bf16 PyTorch


# --------------------------------------------------------------------------- models
class TokenMLP(nn.Module):
    """Linear -> tanh -> Linear on [B, T, d]: T = 4 tokens, so the mixed modes take the ghost norm."""

    def __init__(self, d=12, h=24, C=5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, C)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ConvGroupNorm(nn.Module):
    """Conv2d -> GroupNorm -> relu -> grouped, strided Conv2d -> tanh -> Linear."""

    def __init__(self, C=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, groups=2)
        self.head = nn.Linear(8 * 3 * 3, C)

    def forward(self, x):
        h = torch.relu(self.gn(self.conv1(x)))
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


class EmbeddingLayerNorm(nn.Module):
    """Embedding (with padding_idx, repeated tokens) -> LayerNorm -> tanh -> Linear per token."""

    def __init__(self, V=20, d=16, C=5):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.ln(self.emb(ids))))


class SmallScaleRMSNorm(nn.Module):
    """Linear with small weights -> RMSNorm -> Linear: activations of RMS ~0.05 entering the norm,
    where its default eps (float32's, as torch computes bf16 inputs in float32) must be matched."""

    def __init__(self, d=12, h=16, C=5):
        super().__init__()
        self.fc = nn.Linear(d, h)
        self.norm = nn.RMSNorm(h)
        self.head = nn.Linear(h, C)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.fc(x))))


def _perturb(params, g, scale=0.3):
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def build(name: str):
    """(model, losses_fn, batch) in float32, from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    B = 6
    if name == "linear":
        return TokenMLP(), classify_tokens, (torch.randn(B, 4, 12, generator=g), torch.randint(0, 5, (B, 4), generator=g))
    if name == "conv2d-groupnorm":
        model = ConvGroupNorm()
        _perturb(model.gn.parameters(), g)
        return model, classify, (torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g))
    if name == "embedding-layernorm":
        model = EmbeddingLayerNorm()
        _perturb(model.ln.parameters(), g)
        ids = torch.randint(0, 20, (B, 7), generator=g)
        ids[:, -2:] = 0  # padded tails
        return model, classify_tokens, (ids, torch.randint(0, 5, (B, 7), generator=g))
    if name == "rmsnorm-small-activations":
        model = SmallScaleRMSNorm()
        with torch.no_grad():
            model.fc.weight.mul_(0.1)
            model.fc.bias.mul_(0.1)
        _perturb(model.norm.parameters(), g)
        return model, classify_tokens, (torch.randn(B, 3, 12, generator=g), torch.randint(0, 5, (B, 3), generator=g))
    raise KeyError(name)


CASES = ["linear", "conv2d-groupnorm", "embedding-layernorm"]
if hasattr(nn, "RMSNorm"):
    CASES.append("rmsnorm-small-activations")


# --------------------------------------------------------------------------- precision settings
def cast(model: nn.Module, batch: tuple, dtype: torch.dtype):
    return copy.deepcopy(model).to(dtype), tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def in_precision(losses_fn, autocast: bool):
    """losses_fn with its forward under bf16 autocast (or unchanged, for bf16 parameters)."""
    if not autocast:
        return losses_fn

    def forward(model, *batch):
        with torch.autocast("cpu", dtype=BF16):
            return losses_fn(model, *batch)

    return forward


def sample_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum(g.double().flatten(1).square().sum(1) for g in grads.values()))


def clip_exactly(grads: dict[str, torch.Tensor], R: float):
    """(sum_i C_i g_i in float64, C) with abadi clipping of the whole per-sample gradient."""
    C = torch.clamp(R / sample_norms(grads), max=1.0)
    return {n: torch.einsum("b,b...->...", C, g.double()) for n, g in grads.items()}, C


def relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """{name: max |got - ref| / max |ref|} per parameter (NaN stays NaN)."""
    assert set(got) == set(ref)
    return {n: ((got[n].double() - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref}


class Setting:
    """One case in one precision setting: the float64 oracle, the threshold and the bf16 baselines."""

    def __init__(self, name: str, autocast: bool):
        model, self.losses_fn, batch = build(name)
        self.autocast = autocast
        # bf16 parameters: the weights are rounded first, and the oracle uses the rounded ones
        self.model, self.batch = (model, batch) if autocast else cast(model, batch, BF16)
        self.forward = in_precision(self.losses_fn, autocast)
        model64, batch64 = cast(self.model, self.batch, torch.float64)
        g64 = per_sample_gradients(model64, self.losses_fn, batch64)
        self.ref_norms = sample_norms(g64)
        ordered = self.ref_norms.sort().values.tolist()
        middle = len(ordered) // 2
        self.R = math.sqrt(ordered[middle - 1] * ordered[middle])  # between two middle norms
        self.ref, C = clip_exactly(g64, self.R)

        # baseline A: bf16 per-sample gradients, clipped exactly
        low = per_sample_gradients(self.model, self.forward, self.batch)
        base_a = relative_errors(clip_exactly(low, self.R)[0], self.ref)
        self.norm_baseline = ((sample_norms(low) - self.ref_norms).abs() / self.ref_norms).max().item()
        # baseline B: one batched backward of sum_i C_i L_i, factors from the oracle
        plain = copy.deepcopy(self.model)
        losses = per_sample(self.forward(plain, *self.batch))
        (losses.float() * C.float()).sum().backward()
        base_b = relative_errors({n: p.grad for n, (_, p) in trainable_named_parameters(plain).items()}, self.ref)
        self.baseline = {n: max(base_a[n], base_b[n]) for n in self.ref}

    def tolerance(self, name: str) -> float:
        return FACTOR * self.baseline[name] + ROUNDING


_settings: dict[tuple[str, bool], Setting] = {}


def setting(name: str, autocast: bool) -> Setting:
    key = (name, autocast)
    if key not in _settings:
        _settings[key] = Setting(name, autocast)
    return _settings[key]


# --------------------------------------------------------------------------- running the engine
@pytest.fixture
def observed(monkeypatch):
    """Every (norms, factors) the engine passes through ``clipping_factors``."""
    if not hasattr(dptrain.pipeline, "clipping_factors"):
        pytest.fail("dptrain.pipeline no longer calls clipping_factors: update this spy on the per-sample norms")
    seen = []
    original = dptrain.pipeline.clipping_factors

    def spy(norms, *args, **kwargs):
        factors = original(norms, *args, **kwargs)
        seen.append((norms.detach().clone(), factors.detach().clone()))
        return factors

    monkeypatch.setattr(dptrain.pipeline, "clipping_factors", spy)
    return seen


def private_gradient(s: Setting, mode: str, R: float | None = None, batch: tuple | None = None):
    """(p.grad after one step with sigma = 0, batch_size = 1: the clipped sum; the engine's decisions, read between
    the backward and the step). The losses are formed under autocast, the backward outside it."""
    model = copy.deepcopy(s.model)
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=s.R if R is None else R)
    try:
        losses = s.forward(model, *(s.batch if batch is None else batch))
        engine.backward(losses)  # outside autocast, as torch recommends
        decisions = engine.last_decisions()
        optimizer.step()
        return {n: p.grad.detach().clone() for n, (_, p) in trainable_named_parameters(model).items()}, decisions
    finally:
        engine.detach()


def check_against_oracle(s: Setting, mode: str, observed: list, grad_dtype: torch.dtype) -> None:
    got, _ = private_gradient(s, mode)
    params = {n: p for n, (_, p) in trainable_named_parameters(s.model).items()}
    for name, g in got.items():
        assert g.dtype == params[name].dtype == grad_dtype, f"{name}: gradient {g.dtype}, parameter {params[name].dtype}"
        assert torch.isfinite(g).all(), f"{name}: non-finite clipped gradient"

    # the per-sample norms and clipping factors: float32, finite, and the norms those of the oracle
    assert observed, "the engine computed no clipping factors"
    norms, factors = observed[0]
    assert norms.dtype == factors.dtype == torch.float32, f"norms {norms.dtype}, factors {factors.dtype}"
    assert torch.isfinite(norms).all() and torch.isfinite(factors).all()
    norm_error = ((norms.double() - s.ref_norms).abs() / s.ref_norms).max().item()
    assert norm_error <= FACTOR * s.norm_baseline + ROUNDING, (
        f"per-sample norms off by {norm_error:.3g} relative; bf16 per-sample gradients: {s.norm_baseline:.3g}"
    )
    assert ((s.ref_norms > s.R).any() and (s.ref_norms < s.R).any()), "the threshold clips all samples or none"

    errors = relative_errors(got, s.ref)
    failures = [
        f"{n}: error {errors[n]:.3g} > {s.tolerance(n):.3g} (plain bf16 PyTorch: {s.baseline[n]:.3g})"
        for n in errors if not errors[n] <= s.tolerance(n)
    ]
    assert not failures, f"{mode}:\n" + "\n".join(failures)


# --------------------------------------------------------------------------- the tests
def test_baselines_leave_a_meaningful_tolerance():
    """Guards the comparisons below: plain bf16 is accurate enough here that the tolerance says something."""
    for name in CASES:
        for autocast in (True, False):
            s = setting(name, autocast)
            worst = max(s.baseline.values())
            assert 0 < worst < 0.05, f"{name} (autocast={autocast}): plain bf16 error {worst:.3g}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", CASES)
def test_autocast_bf16_matches_float64_oracle(case_name, mode, observed):
    """Forward under torch.autocast("cpu", bfloat16), float32 parameters: float32 gradients within bf16 tolerance."""
    check_against_oracle(setting(case_name, autocast=True), mode, observed, torch.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", CASES)
def test_bf16_parameters_match_float64_oracle(case_name, mode, observed):
    """model.to(bfloat16), no autocast: bf16 gradients within bf16 tolerance, norms still float32."""
    check_against_oracle(setting(case_name, autocast=False), mode, observed, BF16)


# Clipping factors halfway (plus a little) between two neighbouring bf16 numbers just above 0.5: rounded
# to bf16 they are off by almost 2^-8 relative, bf16's full unit roundoff.
_HALFWAY_FACTORS = [0.5 + (k + 0.5) * 2.0 ** -8 + 2.0 ** -16 for k in (0, 3, 7)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", ["linear", "conv2d-groupnorm", "embedding-layernorm"])
def test_clipped_sample_has_norm_max_grad_norm(case_name, mode, observed):
    """A single clipped sample contributes a gradient of norm R: the factor C = R / ||g|| is applied in float32.

    The thresholds are chosen from the engine's own norm of the sample so that C falls halfway between two
    bf16 numbers: a factor rounded to bf16 would scale the whole contribution by ~2^-8 (above R if rounded
    up). Single-backward modes form the clipped gradient from the very operands that gave the norm, so only
    the rounding of its entries remains, which largely averages out in the norm (under 2^-9);
    two-pass modes recompute it by a second bf16 backward, which differs from the first by at most twice
    the error of a bf16 gradient (measured for this sample against float64).
    """
    s = setting(case_name, autocast=True)
    one = tuple(t[:1] for t in s.batch)
    private_gradient(s, mode, batch=one)
    engine_norm = observed[0][0].item()
    if dptrain.RECIPES[mode].two_pass:
        low = per_sample_gradients(s.model, s.forward, one)
        model64, one64 = cast(s.model, one, torch.float64)
        exact = per_sample_gradients(model64, s.losses_fn, one64)
        gradient_error = (sample_norms({n: low[n].double() - exact[n] for n in exact}) / sample_norms(exact)).item()
        bound = FACTOR * gradient_error + ROUNDING
    else:
        bound = ROUNDING
    deviations = []
    for c in _HALFWAY_FACTORS:
        R = c * engine_norm
        got, _ = private_gradient(s, mode, R=R, batch=one)
        deviations.append(sample_norms({n: g[None] for n, g in got.items()}).item() / R - 1)
    worst = max(abs(d) for d in deviations)
    assert worst <= bound, f"||p.grad|| / R - 1 = {[f'{d / ROUNDING:+.2f}' for d in deviations]} x 2^-9"


@pytest.mark.parametrize("mode", MODES)
def test_float16_norms_do_not_overflow(mode, observed):
    """float16 parameters, with per-sample squared norms far above float16's maximum (65504): the norms
    are accumulated in float32, finite and right, and the clipped gradient is finite float16."""
    model, losses_fn, batch = build("linear")
    model, batch = cast(model, batch, torch.float16)
    scale = 1024.0  # as a loss scaler would: per-sample norms ~1e3, squared ~1e6
    model64, batch64 = cast(model, batch, torch.float64)
    ref_norms = scale * sample_norms(per_sample_gradients(model64, losses_fn, batch64))
    assert (ref_norms.square() > torch.finfo(torch.float16).max).all()
    low = sample_norms(per_sample_gradients(model, lambda m, *b: scale * losses_fn(m, *b), batch))
    baseline = ((low - ref_norms).abs() / ref_norms).max().item()

    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=1.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warnings either
            engine.backward(scale * losses_fn(model, *batch))
        optimizer.step()
        for name, p in model.named_parameters():
            assert p.grad.dtype == torch.float16 and torch.isfinite(p.grad).all(), name
    finally:
        engine.detach()
    norms, _ = observed[0]
    assert norms.dtype == torch.float32 and torch.isfinite(norms).all()
    error = ((norms.double() - ref_norms).abs() / ref_norms).max().item()  # margin below: float16's unit roundoff 2^-11
    assert error <= FACTOR * baseline + 2.0 ** -11, f"norms off by {error:.3g}; float16 autograd: {baseline:.3g}"


def test_rmsnorm_rule_matches_torch_eps_for_bf16_inputs():
    """nn.RMSNorm(eps=None) on a bf16 input normalises in float32 with float32's eps (not bf16's 2^-7)."""
    if not hasattr(nn, "RMSNorm"):
        pytest.skip("nn.RMSNorm needs torch >= 2.4")
    from dptrain.layers import find_rule

    norm = nn.RMSNorm(16)
    x = (0.02 * torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))).to(BF16)
    expected = F.rms_norm(x.float(), (16,), eps=torch.finfo(torch.float32).eps)
    got = find_rule(norm).normalized(norm, x)
    assert (got.float() - expected).abs().max().item() <= ROUNDING * expected.abs().max().item()
