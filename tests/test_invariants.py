"""Properties of the private step that hold whatever the model: bounded per-sample contribution,
accumulation, detach, noise, empty batches, refusals, the layer registry. (The planner: test_planning.py.)"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.layers.numerics import flatten_tokens
from dptrain.testing import clipped_gradient, mismatches, reference_clipped_gradient, split_batch
from helpers import (
    CLIPPING_FNS,
    MODES,
    RTOL,
    SINGLE_BACKWARD_MODES,
    STYLES,
    TWO_PASS_MODES,
    Case,
    assert_matches,
    classify,
    classify_tokens,
    engine_clipped_sum,
    get_case,
    per_sample,
    reference,
    resolve_style,
    split_max_grad_norm,
)

pytestmark = pytest.mark.usefixtures("float64")

SOME_COMBOS = [(fn, "all-layer") for fn in CLIPPING_FNS] + [("abadi", s) for s in STYLES if s != "all-layer"]


def mode_path_params(modes=MODES):
    """(mode, path): engine.backward for every mode, plain loss.backward (mean, sum) for single-backward ones."""
    return [
        pytest.param(m, p, id=f"{m}-{p}")
        for m in modes
        for p in (["engine", "mean", "sum"] if m in SINGLE_BACKWARD_MODES else ["engine"])
    ]


def subset(case: Case, keep) -> Case:
    return Case(case.model, case.losses_fn, tuple(t[keep] for t in case.batch))


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def make_engine(model, **kwargs):
    defaults = dict(batch_size=4, sample_size=100, max_grad_norm=1.0, noise_multiplier=0.0)
    return dptrain.PrivacyEngine(model, **{**defaults, **kwargs})


# =========================================================================== (a) sensitivity
@pytest.mark.parametrize("mode", MODES)
def test_each_sample_contributes_at_most_max_grad_norm(mode):
    """||clipped_sum(batch) - clipped_sum(batch without i)|| <= R for every sample i."""
    case = get_case("transformer")
    model = copy.deepcopy(case.model)
    B = case.batch_size
    violations = []
    for fn, style in SOME_COMBOS:
        s = resolve_style(style, case.model)
        R = split_max_grad_norm(case, s)
        def run(c, R=R, fn=fn, s=s):  # (this combination's, bound now)
            return flat(engine_clipped_sum(c, model=model, mode=mode, max_grad_norm=R, clipping_fn=fn, clipping_style=s))
        full = run(case)
        for i in range(B):
            without = run(subset(case, [j for j in range(B) if j != i]))
            contribution = (full - without).norm().item()
            if not contribution <= R + 1e-9:
                violations.append(f"fn={fn} style={style} sample {i}: {contribution:.6g} > R={R:.6g}")
    assert not violations, "\n".join(violations)


# =========================================================================== (b) accumulation
@pytest.mark.parametrize("mode,path", mode_path_params())
@pytest.mark.parametrize("case_name", ["transformer", "called-twice-conv-embedding"])
def test_micro_batches_accumulate_to_the_full_batch(case_name, mode, path):
    """k backward calls on micro-batches of sizes 2, 1, 2 then one step == one call on the batch."""
    case = get_case(case_name)
    R = split_max_grad_norm(case, "layer-wise")
    kwargs = dict(mode=mode, max_grad_norm=R, clipping_style="layer-wise", path=path)
    one = engine_clipped_sum(case, **kwargs)
    three = engine_clipped_sum(case, micro_batches=3, **kwargs)
    assert_matches(three, one, what="3 micro-batches vs one batch")


@pytest.mark.parametrize("mode,path", mode_path_params())
def test_forwards_first_then_backwards_accumulate_exactly(mode, path):
    """Both micro-batches are forwarded before either is back-propagated: still one exact batch
    (or a clear refusal) -- never a micro-batch silently left out."""
    case = get_case("linear-[B,T,d]")
    R = split_max_grad_norm(case, "all-layer")
    model = copy.deepcopy(case.model)
    engine, optimizer = attached(model, clipping_mode=mode, max_grad_norm=R, batch_size=1,
                                 loss_reduction="sum" if path == "sum" else "mean")
    losses = [case.losses(model, chunk) for chunk in split_batch(case.batch, 2)]  # two forwards ...
    try:
        for chunk_losses in losses:                                                # ... then two backwards
            if path == "engine":
                engine.backward(chunk_losses)
            else:
                reduce = torch.mean if path == "mean" else torch.sum
                reduce(per_sample(chunk_losses)).backward()
    except (ValueError, RuntimeError) as err:
        assert "forward" in str(err) and "backward" in str(err), f"unclear refusal: {err}"
        return
    optimizer.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, reference(case, max_grad_norm=R),
                   what="forward, forward, backward, backward")


@pytest.mark.parametrize("mode,path", mode_path_params())
def test_a_forward_never_back_propagated_is_ignored(mode, path):
    """An extra forward with grad enabled (e.g. on a logging batch of another size) changes nothing."""
    case = get_case("linear-[B,T,d]")
    R = split_max_grad_norm(case, "all-layer")
    model = copy.deepcopy(case.model)
    engine, optimizer = attached(model, clipping_mode=mode, max_grad_norm=R, batch_size=1,
                                 loss_reduction="sum" if path == "sum" else "mean")
    case.losses(model, tuple(t[:2] for t in case.batch))  # discarded
    losses = case.losses(model)
    if path == "engine":
        engine.backward(losses)
    else:
        (per_sample(losses).mean() if path == "mean" else per_sample(losses).sum()).backward()
    optimizer.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, reference(case, max_grad_norm=R))


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_forward_leaves_parameters_trainable(mode):
    model = small_mlp()
    attached(model, clipping_mode=mode)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3))  # wrong input width: the first Linear raises
    assert all(p.requires_grad for p in model.parameters())


# =========================================================================== (c) detach
@pytest.mark.parametrize("mode,path", mode_path_params())
@pytest.mark.parametrize("case_name", ["transformer", "resnet-groupnorm"])
def test_detach_restores_ordinary_training_bit_for_bit(case_name, mode, path):
    case = get_case(case_name)
    attached = copy.deepcopy(case.model)
    flags = {n: p.requires_grad for n, p in attached.named_parameters()}
    clipped_gradient(attached, case.losses_fn, case.batch, mode=mode, max_grad_norm=0.5, path=path,
                     noise_multiplier=1.0, batch_size=4, seed=0)  # one private step, then detach()

    assert {n: p.requires_grad for n, p in attached.named_parameters()} == flags
    for name, m in attached.named_modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks), f"hook left on {name!r}"

    never = copy.deepcopy(case.model)
    never.load_state_dict(attached.state_dict())
    results = []
    for model in (attached, never):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.zero_grad()
        per_sample(case.losses(model)).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        results.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (grads_a, params_a), (grads_n, params_n) = results
    assert grads_a.keys() == grads_n.keys()
    assert all(torch.equal(grads_a[n], grads_n[n]) for n in grads_n)
    assert all(torch.equal(params_a[n], params_n[n]) for n in params_n)


# =========================================================================== (d) noise
def assert_gaussian(noise: torch.Tensor, std: float) -> None:
    """Mean and standard deviation of >= 1e5 iid N(0, std^2) entries, within 5 standard errors."""
    x = noise.flatten().double()
    n = x.numel()
    assert n >= 100_000
    mean, s = x.mean().item(), x.std().item()
    assert abs(mean) <= 5 * std / math.sqrt(n), f"mean {mean:.3g} of noise with std {std:.3g} over {n} entries"
    rel_se = 1 / math.sqrt(2 * (n - 1))
    assert abs(s / std - 1) <= 5 * rel_se, f"std {s:.6g} vs expected {std:.6g} (5 SE = {5 * rel_se:.2%})"


def big_linear_case() -> Case:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(320, 320), nn.Tanh(), nn.Linear(320, 3))
    return Case(model, classify, (torch.randn(4, 320, generator=g), torch.randint(0, 3, (4,), generator=g)))


SIGMA, R, EXPECTED_BATCH = 1.3, 0.7, 8


@pytest.mark.parametrize("mode,path", mode_path_params())
def test_noise_has_std_sigma_R_over_batch_size(mode, path):
    """p.grad(sigma) - p.grad(sigma=0) is N(0, (sigma R / batch_size)^2) on every entry."""
    case = big_linear_case()
    kwargs = dict(mode=mode, max_grad_norm=R, batch_size=EXPECTED_BATCH, path=path)
    noisy = engine_clipped_sum(case, noise_multiplier=SIGMA, seed=1, **kwargs)
    clean = engine_clipped_sum(case, noise_multiplier=0.0, **kwargs)
    assert_gaussian(flat(noisy) - flat(clean), SIGMA * R / EXPECTED_BATCH)


def test_noise_is_added_once_per_step_not_per_micro_batch():
    case = big_linear_case()
    kwargs = dict(mode="bk-mixopt", max_grad_norm=R, batch_size=EXPECTED_BATCH, micro_batches=4)
    noisy = engine_clipped_sum(case, noise_multiplier=SIGMA, seed=2, **kwargs)
    clean = engine_clipped_sum(case, noise_multiplier=0.0, **kwargs)
    assert_gaussian(flat(noisy) - flat(clean), SIGMA * R / EXPECTED_BATCH)


def _noise_of_steps(seed, steps=2):
    """p.grad of consecutive steps without any backward: pure noise."""
    model = big_linear_case().model
    engine = make_engine(model, noise_multiplier=1.0, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    out = []
    for _ in range(steps):
        optimizer.step()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        optimizer.zero_grad()
    engine.detach()
    return out


def test_consecutive_steps_draw_different_noise():
    first, second = _noise_of_steps(seed=5)
    assert not torch.equal(first, second)
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 0.02


def test_same_seed_reproduces_the_noise_and_another_seed_does_not():
    a, b, c = _noise_of_steps(seed=7), _noise_of_steps(seed=7), _noise_of_steps(seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_each_parameter_gets_its_own_noise():
    """The noise of different parameters is not the same draw repeated."""
    model = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 300))
    engine = make_engine(model, noise_multiplier=1.0, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    optimizer.step()
    w0, w1 = model[0].weight.grad.flatten(), model[1].weight.grad.flatten()
    assert abs(torch.corrcoef(torch.stack([w0, w1]))[0, 1].item()) < 0.02
    assert not torch.equal(model[0].bias.grad, model[1].bias.grad)


# =========================================================================== (e) empty batch
@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_adds_noise_and_counts_the_step(mode):
    model = big_linear_case().model
    engine = make_engine(model, batch_size=EXPECTED_BATCH, noise_multiplier=SIGMA, max_grad_norm=R,
                         clipping_mode=mode, seed=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    x, y = torch.randn(0, 320), torch.zeros(0, dtype=torch.long)
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    optimizer.step()
    assert_gaussian(torch.cat([p.grad.flatten() for p in model.parameters()]), SIGMA * R / EXPECTED_BATCH)
    assert engine.steps_taken == 1
    assert engine.accountant.steps == 1
    optimizer.step()  # a step with no backward at all counts as well
    assert engine.steps_taken == 2
    assert engine.accountant.steps == 2
    assert engine.get_epsilon() > 0


# =========================================================================== (f) refusals and errors
def small_mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def attached(model, **kwargs):
    engine = make_engine(model, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    return engine, optimizer


@pytest.mark.parametrize("mode", MODES)
def test_scalar_loss_to_engine_backward_is_refused(mode):
    model = small_mlp()
    engine, _ = attached(model, clipping_mode=mode)
    loss = F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match=r"per-sample losses of shape \[B\]"):
        engine.backward(loss)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_losses_are_refused_and_leave_no_trace(mode, bad):
    case = get_case("called-twice-conv-embedding")
    model = copy.deepcopy(case.model)
    engine, optimizer = attached(model, clipping_mode=mode, batch_size=1)
    losses = case.losses(model)
    losses = losses * torch.tensor([1.0, bad, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"non-finite per-sample losses at batch positions \[1\]"):
        engine.backward(losses)
    # the next, valid batch is exact: nothing of the refused one was accumulated
    engine.backward(case.losses(model))
    optimizer.step()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_matches(got, reference(case, max_grad_norm=1.0), what="batch after a refused one")


def _flipped_losses(model, x, y):
    """Cross-entropy of the logits in reverse order: separable, but the graph proof has no rule for the flip, so the
    loss check reads the losses' gradient at the model's outputs by tag passes at every step."""
    return F.cross_entropy(model(x).flip(1), y, reduction="none")


def _nan_gradient_losses(model, x, y):
    """Finite losses whose gradient at the model's output is NaN for sample 2 (sqrt at 0, times 0)."""
    out = model(x)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=out.dtype)
    return F.cross_entropy(out.flip(1), y, reduction="none") + torch.sqrt(out[:, 0].square() * mask) * 0


@pytest.mark.parametrize("scaled", [False, True], ids=["refused", "grad-scaler"])
@pytest.mark.parametrize("bad", ["nan-loss", "nan-gradient"])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_non_finite_losses_that_the_loss_check_reads_first_are_refused_by_position(float64, mode, bad, scaled):
    """The loss check's tag passes met a NaN loss (or a finite loss's NaN gradient) before the backward's norms did,
    and read its NaN sketch as a row index (IndexError). Now: refused naming the position (or the NaN gradient), or,
    with a GradScaler, an overflow whose step is skipped; then the next batch is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    scale = scaler.scale if scaled else (lambda t: t)
    engine, optimizer = dptrain.testing.attached_engine(model, mode=mode, max_grad_norm=1.0, lr=0.1,
                                                        grad_scaler=scaler)
    try:
        def step(losses):
            optimizer.zero_grad()
            engine.backward(scale(losses))
            if scaled:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()

        step(_flipped_losses(model, *batches[0]))  # an ordinary step first
        if bad == "nan-loss":
            losses = _flipped_losses(model, *batches[1]) * torch.tensor([1.0, 1.0, float("nan"), 1.0, 1.0])
            refusal = (ValueError, r"non-finite per-sample losses at batch positions \[2\]")
        else:
            losses = _nan_gradient_losses(model, *batches[1])
            assert bool(torch.isfinite(losses).all())
            refusal = (FloatingPointError, "gradient is inf or NaN")
        if scaled:
            scale_before, weights = scaler.get_scale(), copy.deepcopy(model.state_dict())
            step(losses)
            assert scaler.get_scale() < scale_before  # an overflow: the scale backs off, the step is skipped
            assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())
        else:
            with pytest.raises(refusal[0], match=refusal[1]):
                engine.backward(losses)
        want = reference_clipped_gradient(copy.deepcopy(model), _flipped_losses, batches[2], max_grad_norm=1.0)
        step(_flipped_losses(model, *batches[2]))
        assert_matches({n: p.grad for n, p in model.named_parameters()}, want,
                       what=f"{mode}: the batch after a non-finite one")
    finally:
        engine.detach()


@pytest.mark.parametrize("bad_at", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("mode", MODES)
def test_a_micro_batch_with_non_finite_norms_leaves_the_others_sums_whole(float64, mode, bad_at):
    """Gradient accumulation over three micro-batches, one of them with a NaN per-sample gradient: its backward is
    refused and nothing of it is accumulated, whether it is the step's first backward (whose finiteness is read after
    its sums are queued, and undone) or a later one (read before adding to the earlier sums); the step then equals a
    twin's that never saw it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)]
    engines = [dptrain.testing.attached_engine(m, mode=mode, max_grad_norm=0.5, lr=0.1, batch_size=10)
               for m in (model, twin)]
    try:
        (engine, optimizer), (twin_engine, twin_optimizer) = engines
        for k, batch in enumerate(batches):
            if k == bad_at:
                with pytest.raises(FloatingPointError, match="inf or NaN"):
                    engine.backward(_nan_gradient_losses(model, *batch))
                continue
            engine.backward(_flipped_losses(model, *batch))
            twin_engine.backward(_flipped_losses(twin, *batch))
        optimizer.step()
        twin_optimizer.step()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.isfinite(p).all(), name
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{mode}: {name} after a refused micro-batch")
    finally:
        for engine, _ in engines:
            engine.detach()


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_non_finite_scalar_loss_through_loss_backward_is_refused(mode):
    model = small_mlp()
    _, optimizer = attached(model, clipping_mode=mode)
    out = model(torch.randn(4, 4))
    with pytest.raises((ValueError, FloatingPointError), match="inf or NaN|non-finite"):
        (out.sum() * float("nan")).backward()


@pytest.mark.parametrize(
    "option,value",
    [
        ("clipping_mode", "fast"),
        ("clipping_fn", "clip"),
        ("clipping_style", "by-layer"),
        ("loss_reduction", "avg"),
        ("decision_rule", "bytes"),
    ],
)
def test_unknown_option_value_is_refused_listing_the_valid_ones(option, value):
    valid = {
        "clipping_mode": dptrain.CLIPPING_MODES,
        "clipping_fn": dptrain.CLIPPING_FNS,
        "clipping_style": dptrain.CLIPPING_STYLES,
        "loss_reduction": ("mean", "sum"),
        "decision_rule": ("space", "time"),
    }[option]
    with pytest.raises(ValueError) as info:
        make_engine(small_mlp(), **{option: value})
    message = str(info.value)
    assert option in message and repr(value) in message
    assert all(v in message for v in valid), message


@pytest.mark.parametrize(
    "groups,needle",
    [([["0"], ["nope"]], "'nope'"), ([["0"]], "'2'"), ([["0", "2"], ["2"]], "'2'"), ([], "non-empty")],
    ids=["unknown-module", "module-missing", "module-twice", "empty"],
)
def test_bad_clipping_groups_are_refused(groups, needle):
    with pytest.raises(ValueError, match=needle):
        make_engine(small_mlp(), clipping_style=groups)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="clip_norm"):
        make_engine(small_mlp(), clip_norm=1.0)


def test_trainable_batchnorm_is_refused_pointing_to_groupnorm():
    model = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4), flat=nn.Flatten()))
    with pytest.raises(ValueError, match=r"(?s)bn.*BatchNorm2d.*GroupNorm"):
        make_engine(model)


class FrozenBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 3 * 3, 3)
        self.bn.requires_grad_(False)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_frozen_batchnorm_in_train_mode_raises_at_forward():
    model = FrozenBNNet()
    attached(model)
    with pytest.raises(RuntimeError, match=r"(?s)bn.*training mode.*eval\(\)"):
        model(torch.randn(4, 2, 5, 5))


@pytest.mark.parametrize("mode", MODES)
def test_frozen_batchnorm_in_eval_mode_is_exact(mode):
    torch.manual_seed(0)
    model = FrozenBNNet()
    model.bn.eval()
    case = Case(model, classify, (torch.randn(5, 2, 5, 5) * 2, torch.randint(0, 3, (5,))))
    R = split_max_grad_norm(case, "all-layer")
    assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R), reference(case, max_grad_norm=R))


class Shift(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return x + self.offset


def test_trainable_module_without_rule_is_refused_by_name_without_the_fallback():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 5), shift=Shift(5), head=nn.Linear(5, 3)))
    with pytest.raises(ValueError, match=r"(?s)shift.*Shift.*offset.*register"):
        make_engine(model, allow_fallback=False)
    model.shift.requires_grad_(False)  # the fix the message names
    make_engine(model, allow_fallback=False)


class TiedLM(nn.Module):
    def __init__(self, V=7, d=4):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("mode", MODES)
def test_parameter_shared_by_two_modules_is_exact(mode):
    """Tied weights (embedding and output projection): the engine sums both layers' per-sample
    gradients before taking the norm, so the cross terms count."""
    torch.manual_seed(0)
    case = Case(TiedLM(), classify_tokens, (torch.randint(0, 7, (5, 4)), torch.randint(0, 7, (5, 4))))
    assert case.model.head.weight is case.model.emb.weight
    failures = []
    for fn, style in [(fn, "all-layer") for fn in CLIPPING_FNS] + [("abadi", "param-wise")]:
        R = split_max_grad_norm(case, style)
        got = engine_clipped_sum(case, mode=mode, max_grad_norm=R, clipping_fn=fn, clipping_style=style)
        failures += mismatches(got, reference(case, max_grad_norm=R, clipping_fn=fn, clipping_style=style),
                               rtol=RTOL, relative_to="largest", what=f"fn={fn} style={style}")
    assert not failures, "\n".join(failures)


def test_tied_parameter_with_explicit_groups_naming_both_modules_is_exact():
    """[["emb"], ["head"]] where head only holds the tied emb.weight: one effective group (engine and oracle)."""
    torch.manual_seed(0)
    case = Case(TiedLM(), classify_tokens, (torch.randint(0, 7, (5, 4)), torch.randint(0, 7, (5, 4))))
    style = [["emb"], ["head"]]
    R = split_max_grad_norm(case, style)
    ref = reference(case, max_grad_norm=R, clipping_style=style)
    for mode in MODES:
        assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R, clipping_style=style), ref, what=mode)


class FunctionalTiedLM(nn.Module):
    """The output projection reuses the embedding matrix by a functional call (h @ emb.weight.T)."""

    def __init__(self, V=7, d=4):
        super().__init__()
        self.emb = nn.Embedding(V, d)

    def forward(self, ids):
        return torch.tanh(self.emb(ids)) @ self.emb.weight.T


class FunctionalOnlyLinear(nn.Module):
    """fc's parameters are only used through F.linear: fc itself is never called."""

    def __init__(self, V=7, d=4):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc = nn.Linear(d, V)

    def forward(self, ids):
        return F.linear(torch.tanh(self.emb(ids)), self.fc.weight, self.fc.bias)


@pytest.mark.parametrize("model_cls", [FunctionalTiedLM, FunctionalOnlyLinear], ids=["tied-by-matmul", "never-called"])
@pytest.mark.parametrize("mode", MODES)
def test_parameter_used_outside_its_module_call_is_refused(mode, model_cls):
    """The engine sees a parameter only through its module's calls; any other use must not be
    silently dropped (single pass) or left out of the norm (two passes): it is refused, naming it."""
    torch.manual_seed(0)
    case = Case(model_cls(), classify_tokens, (torch.randint(0, 7, (6, 5)), torch.randint(0, 7, (6, 5))))
    R = split_max_grad_norm(case, "all-layer")
    name = "emb.weight" if model_cls is FunctionalTiedLM else "fc.bias"
    with pytest.raises(RuntimeError, match=rf"parameter '{name}' was used outside the forward call of its own layer"):
        engine_clipped_sum(case, mode=mode, max_grad_norm=R)


@pytest.mark.parametrize("model_cls", [FunctionalTiedLM, FunctionalOnlyLinear], ids=["tied-by-matmul", "never-called"])
@pytest.mark.parametrize("mode", MODES)
def test_parameter_used_outside_its_module_call_keeps_contribution_below_R(mode, model_cls):
    """The privacy guarantee itself: whatever the engine computes, one sample moves it by <= R."""
    torch.manual_seed(0)
    case = Case(model_cls(), classify_tokens, (torch.randint(0, 7, (6, 5)), torch.randint(0, 7, (6, 5))))
    R = split_max_grad_norm(case, "all-layer")
    model = copy.deepcopy(case.model)
    try:
        full = flat(engine_clipped_sum(case, model=model, mode=mode, max_grad_norm=R))
    except (ValueError, RuntimeError):
        return  # refused: nothing released
    for i in range(case.batch_size):
        without = flat(engine_clipped_sum(subset(case, [j for j in range(case.batch_size) if j != i]), model=model,
                                          mode=mode, max_grad_norm=R))
        assert (full - without).norm().item() <= R + 1e-9, f"sample {i} contributes more than R={R:.4g}"


class Repeated(nn.Module):
    """One Linear registered under two names (module sharing, not parameter sharing)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = self.first
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


@pytest.mark.parametrize("mode", MODES)
def test_module_registered_under_two_names_is_exact(mode):
    torch.manual_seed(0)
    case = Case(Repeated(), classify, (torch.randn(5, 4) * 2, torch.randint(0, 3, (5,))))
    R = split_max_grad_norm(case, "all-layer")
    for style in ("all-layer", "layer-wise"):
        assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R, clipping_style=style),
                       reference(case, max_grad_norm=R, clipping_style=style), what=style)


@pytest.mark.parametrize("mode", TWO_PASS_MODES)
def test_plain_loss_backward_in_two_pass_mode_says_to_call_engine_backward(mode):
    model = small_mlp()
    attached(model, clipping_mode=mode)
    loss = F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(RuntimeError, match=r"engine\.backward"):
        loss.backward()


class BroadcastPositions(nn.Module):
    """Position ids of shape [1, T], broadcast over the batch by the addition."""

    def __init__(self, V=6, T=4, d=3):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Embedding(T, d)
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])[None, :]  # [1, T]
        return self.head(torch.tanh(self.tok(ids) + self.pos(positions)))


class BroadcastLatents(nn.Module):
    """A Linear applied to a [1, T, d] tensor (learned-query style), broadcast over the batch."""

    def __init__(self, V=6, T=4, d=3):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.register_buffer("latents", torch.randn(1, T, d))
        self.query = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids) * self.query(self.latents)))


@pytest.mark.parametrize("variant", ["all-trainable", "only-broadcast-layer-trainable"])
@pytest.mark.parametrize("model_cls", [BroadcastPositions, BroadcastLatents], ids=["pos-embedding", "linear"])
@pytest.mark.parametrize("mode,path", mode_path_params())
def test_broadcast_inputs_are_exact_or_refused(mode, path, model_cls, variant):
    """A layer fed a [1, T, ...] input for a batch of B > 1 must not silently give a wrong gradient."""
    torch.manual_seed(0)
    model = model_cls()
    if variant == "only-broadcast-layer-trainable":
        model.tok.requires_grad_(False)
        model.head.requires_grad_(False)
    case = Case(model, classify_tokens, (torch.randint(0, 6, (5, 4)), torch.randint(0, 6, (5, 4))))
    R = split_max_grad_norm(case, "all-layer")
    try:
        got = engine_clipped_sum(case, mode=mode, max_grad_norm=R, path=path)
    except ValueError as err:
        assert "expand" in str(err), str(err)
        return
    assert_matches(got, reference(case, max_grad_norm=R), what="broadcast input accepted, so must be exact")


def test_embedding_scale_grad_by_freq_is_refused():
    model = nn.Sequential(OrderedDict(emb=nn.Embedding(5, 3, scale_grad_by_freq=True), head=nn.Linear(3, 2)))
    with pytest.raises(ValueError, match=r"(?s)emb.*scale_grad_by_freq"):
        make_engine(model)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "not-affine"])
def test_instancenorm_tracking_running_stats_is_refused(affine):
    """Running statistics averaged over private batches would leak outside the noisy gradient."""
    model = nn.Sequential(OrderedDict(conv=nn.Conv2d(2, 3, 3),
                                      norm=nn.InstanceNorm2d(3, affine=affine, track_running_stats=True),
                                      flat=nn.Flatten(), head=nn.Linear(3 * 3 * 3, 2)))
    try:
        engine, _ = attached(model)
    except ValueError as err:
        assert "track_running_stats" in str(err)
        return
    with pytest.raises((ValueError, RuntimeError), match="track_running_stats|running"):
        engine.backward(F.cross_entropy(model(torch.randn(4, 2, 5, 5)), torch.tensor([0, 1, 0, 1]), reduction="none"))


def test_backward_before_attach_and_double_attach_are_refused():
    model = small_mlp()
    engine = make_engine(model)
    with pytest.raises(RuntimeError, match="attach"):
        engine.backward(torch.zeros(3, requires_grad=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    with pytest.raises(RuntimeError, match="detach"):
        engine.attach(optimizer)


# =========================================================================== (g) the layer registry
class MyLinear(nn.Linear):
    """A subclass that keeps nn.Linear's computation (like torch's NonDynamicallyQuantizableLinear)."""

    def __init__(self, d, p):
        super().__init__(d, p)
        self.tag = "mine"


class ScaledLinear(nn.Linear):
    """A subclass whose forward is no longer x W^T + b."""

    def forward(self, x):
        return super().forward(x) * 1.5


class Scale(nn.Module):
    """out = x * weight over the last dim (a user-defined layer)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n) + 0.5 * torch.randn(n))

    def forward(self, x):
        return x * self.weight


class ScaleRule(dptrain.LayerRule):
    module_types = (Scale,)
    param_names = ("weight",)

    def dims(self, module, activation, output):
        n = module.weight.numel()
        return dptrain.LayerDims(T=activation[0].numel() // n, p=n, d=1, ghost_supported=False)

    def operands(self, module, activation, grad_output):
        return (flatten_tokens(activation * grad_output),)  # [B, T, n]

    def per_sample_grads(self, module, ops, names):
        return {"weight": ops[0].sum(1)}

    def clipped_grads(self, module, ops, factors):
        return {"weight": factors["weight"].to(ops[0].dtype) @ ops[0].sum(1)}


class SubScale(Scale):
    pass


class UnregisteredScale(nn.Module):  # like Scale, but no rule is ever registered for it
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


@pytest.fixture(scope="module")
def scale_rule_registered():
    dptrain.register_layer(ScaleRule)
    yield
    dptrain.unregister_layer(ScaleRule)


def test_subclass_of_linear_uses_the_linear_rule():
    assert type(dptrain.find_rule(MyLinear(2, 2))) is type(dptrain.find_rule(nn.Linear(2, 2)))


@pytest.mark.parametrize("mode", MODES)
def test_subclass_of_linear_is_exact(mode):
    torch.manual_seed(0)
    model = nn.Sequential(MyLinear(4, 6), nn.Tanh(), MyLinear(6, 3))
    case = Case(model, classify_tokens, (torch.randn(5, 3, 4) * 2, torch.randint(0, 3, (5, 3))))
    R = split_max_grad_norm(case, "all-layer")
    assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R), reference(case, max_grad_norm=R))


@pytest.mark.parametrize("mode", MODES)
def test_subclass_of_linear_with_another_forward_uses_the_fallback_or_is_refused(mode):
    """The nn.Linear rule assumes s = a W^T + b; a subclass computing something else must not be
    silently treated as a plain Linear (its norms would be wrong): the per-sample fallback takes it,
    exactly and with a warning that names its path, and without the fallback it is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    assert dptrain.find_rule(model[0]) is None
    case = Case(model, classify, (torch.randn(5, 4) * 2, torch.randint(0, 3, (5,))))
    R = split_max_grad_norm(case, "all-layer")
    with pytest.warns(UserWarning, match=r"use the per-sample fallback: 0\. "):
        got = engine_clipped_sum(case, mode=mode, max_grad_norm=R)
    assert_matches(got, reference(case, max_grad_norm=R), what="ScaledLinear through the fallback")
    with pytest.raises(ValueError, match="ScaledLinear"):
        make_engine(copy.deepcopy(model), allow_fallback=False, clipping_mode=mode)


def test_unregistered_user_layer_is_refused_without_the_fallback():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), scale=UnregisteredScale(4)))
    with pytest.raises(ValueError, match=r"(?s)scale.*UnregisteredScale.*register_layer"):
        make_engine(model, allow_fallback=False)


@pytest.mark.parametrize("mode,path", mode_path_params())
def test_registered_user_layer_is_exact(scale_rule_registered, mode, path):
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 5), scale=Scale(5), act=nn.Tanh(), sub=SubScale(5),
                                      head=nn.Linear(5, 3)))
    case = Case(model, classify_tokens, (torch.randn(5, 3, 4) * 2, torch.randint(0, 3, (5, 3))))
    assert isinstance(dptrain.find_rule(model.sub), ScaleRule)  # found through the class hierarchy
    for style in ("all-layer", "param-wise"):
        R = split_max_grad_norm(case, style)
        for fn in CLIPPING_FNS:
            assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R, clipping_fn=fn, clipping_style=style,
                                              path=path),
                           reference(case, max_grad_norm=R, clipping_fn=fn, clipping_style=style), what=f"{fn} {style}")
