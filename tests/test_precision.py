"""Precision (dptrain.precision and the numerics of the clipped sums): fp16 training with a GradScaler, and mixed
precision.

fp16 training with a GradScaler: the scale is removed before clipping; skipped steps still count.

Mixed precision: bf16 autocast on CPU around the forward (float32 parameters), and bf16 parameters.

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
import dptrain.core.pipeline
import dptrain.testing
from dptrain.testing import attached_engine, per_sample_gradients, trainable_named_parameters
from helpers import MODES, SINGLE_BACKWARD_MODES, classify, classify_tokens, per_sample

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


# ---------------------------------------------------------------------------- mixed precision: bf16
# (on each test below: torch warns of every bf16 input to a float32 weight)
DTYPE_MISMATCH = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

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
    if not hasattr(dptrain.core.pipeline, "clipping_factors"):
        pytest.fail("dptrain.core.pipeline no longer calls clipping_factors: update this spy on the per-sample norms")
    seen = []
    original = dptrain.core.pipeline.clipping_factors

    def spy(norms, *args, **kwargs):
        factors = original(norms, *args, **kwargs)
        seen.append((norms.detach().clone(), factors.detach().clone()))
        return factors

    monkeypatch.setattr(dptrain.core.pipeline, "clipping_factors", spy)
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
@DTYPE_MISMATCH
def test_baselines_leave_a_meaningful_tolerance():
    """Guards the comparisons below: plain bf16 is accurate enough here that the tolerance says something."""
    for name in CASES:
        for autocast in (True, False):
            s = setting(name, autocast)
            worst = max(s.baseline.values())
            assert 0 < worst < 0.05, f"{name} (autocast={autocast}): plain bf16 error {worst:.3g}"


@DTYPE_MISMATCH
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", CASES)
def test_autocast_bf16_matches_float64_oracle(case_name, mode, observed):
    """Forward under torch.autocast("cpu", bfloat16), float32 parameters: float32 gradients within bf16 tolerance."""
    check_against_oracle(setting(case_name, autocast=True), mode, observed, torch.float32)


@DTYPE_MISMATCH
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", CASES)
def test_bf16_parameters_match_float64_oracle(case_name, mode, observed):
    """model.to(bfloat16), no autocast: bf16 gradients within bf16 tolerance, norms still float32."""
    check_against_oracle(setting(case_name, autocast=False), mode, observed, BF16)


# Clipping factors halfway (plus a little) between two neighbouring bf16 numbers just above 0.5: rounded
# to bf16 they are off by almost 2^-8 relative, bf16's full unit roundoff.
_HALFWAY_FACTORS = [0.5 + (k + 0.5) * 2.0 ** -8 + 2.0 ** -16 for k in (0, 3, 7)]


@DTYPE_MISMATCH
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


@DTYPE_MISMATCH
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


@DTYPE_MISMATCH
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


def _aligned(B: int):
    """Nearly the same sample B times: their clipped gradients add up, and a rounding shared by all shows."""
    torch.manual_seed(0)
    return torch.randn(1, 16) + 1e-3 * torch.randn(B, 16), torch.zeros(B, dtype=torch.long)


def _rounding_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


@pytest.mark.parametrize("mode", MODES)
def test_fp16_with_a_grad_scaler_moves_the_clipped_sum_by_at_most_R(mode):
    """The scaled losses are divided by the expected batch size, a constant, not averaged: the mean's 1/B was rounded
    into each sample's fp16 gradient, and removing one of 512 aligned samples moved the clipped sum by 1.005 R."""
    x, y = _aligned(512)
    model, R = _rounding_model(), 1e-3

    def clipped_sum(xs, ys):
        m = copy.deepcopy(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        engine, opt = attached_engine(m, mode=mode, max_grad_norm=R, grad_scaler=scaler)
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                losses = F.cross_entropy(m(xs).float(), ys, reduction="none")
            engine.backward(scaler.scale(losses))
            scaler.step(opt)
            scaler.update()
            return torch.cat([p.grad.double().flatten() for p in m.parameters()])
        finally:
            engine.detach()

    distance = (clipped_sum(x, y) - clipped_sum(x[1:], y[1:])).norm().item() / R
    assert distance <= 1 + 1e-4, f"{mode}: {distance:.6f} R"


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_plain_mean_backward_after_a_bf16_forward_on_poisson_batches_is_refused(mode):
    """Its 1/B is the user's, rounded into each sample's bf16 gradient (1.4 R for one of 512 aligned samples): refused
    before anything is accumulated, naming the ways out; loss.sum() with loss_reduction='sum' is exact."""
    x, y = _aligned(512)
    model, R = _rounding_model(), 1e-3

    def clipped_sum(xs, ys, reduction):
        m = copy.deepcopy(model)
        engine, opt = attached_engine(m, mode=mode, max_grad_norm=R, loss_reduction=reduction)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(xs).float(), ys, reduction=reduction)
            loss.backward()
            opt.step()
            return torch.cat([p.grad.double().flatten() for p in m.parameters()])
        finally:
            engine.detach()

    with pytest.raises(ValueError, match="mean's 1/B is rounded.*engine.backward"):
        clipped_sum(x, y, "mean")
    distance = (clipped_sum(x, y, "sum") - clipped_sum(x[1:], y[1:], "sum")).norm().item() / R
    assert distance <= 1 + 1e-4, f"{mode}: {distance:.6f} R"
