"""Every clipping mode against the per-sample oracle, in float64.

With noise_multiplier=0, batch_size=1 and SGD(lr=0), p.grad after optimizer.step() is the
clipped sum ``sum_i C_i g_i``; dptrain.testing.reference_clipped_gradient computes it one
sample at a time. They must agree to ~1e-10 relative to the largest reference entry, for
every clipping function and style, with max_grad_norm chosen so that some samples are
clipped and others are not.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dptrain.testing import mismatches
from helpers import (
    CASES,
    CLIPPING_FNS,
    MODES,
    RTOL,
    SINGLE_BACKWARD_MODES,
    STYLES,
    Case,
    ConvNet,
    assert_matches,
    classify,
    engine_clipped_sum,
    get_case,
    reference,
    resolve_style,
    scaled_group_norms,
    split_max_grad_norm,
)

pytestmark = pytest.mark.usefixtures("float64")

_thresholds: dict[tuple, float] = {}
_references: dict[tuple, dict] = {}


def threshold_for(case_name: str, style: str) -> float:
    key = (case_name, style, torch.get_default_dtype())
    if key not in _thresholds:
        case = get_case(case_name)
        _thresholds[key] = split_max_grad_norm(case, resolve_style(style, case.model))
    return _thresholds[key]


def reference_for(case_name: str, fn: str, style: str) -> dict:
    key = (case_name, fn, style, torch.get_default_dtype())
    if key not in _references:
        case = get_case(case_name)
        _references[key] = reference(case, max_grad_norm=threshold_for(case_name, style), clipping_fn=fn,
                                     clipping_style=resolve_style(style, case.model))
    return _references[key]


ALL_COMBOS = [(fn, style) for style in STYLES for fn in CLIPPING_FNS]
# every clipping function once, every style once: for the secondary matrices
SOME_COMBOS = [(fn, "all-layer") for fn in CLIPPING_FNS] + [("abadi", s) for s in STYLES if s != "all-layer"]


def check_against_oracle(case_name: str, mode: str, path: str = "engine", combos=ALL_COMBOS) -> None:
    """Compare engine and oracle for each (clipping_fn, style); report every mismatch at once.

    One copy of the model serves all combinations: each run attaches a new engine and
    detaches it, so a detach() that leaves state behind also shows up here.
    """
    case = get_case(case_name)
    model = copy.deepcopy(case.model)
    failures = []
    for fn, style in combos:
        try:
            got = engine_clipped_sum(case, model=model, mode=mode, max_grad_norm=threshold_for(case_name, style),
                                     clipping_fn=fn, clipping_style=resolve_style(style, case.model), path=path)
            failures += mismatches(got, reference_for(case_name, fn, style), rtol=RTOL, relative_to="largest",
                                   what=f"fn={fn} style={style}")
        except Exception as err:  # noqa: BLE001  -- report every combination, not just the first
            failures.append(f"fn={fn} style={style}: {type(err).__name__}: {str(err).splitlines()[0]}")
    assert not failures, f"{case_name} / {mode} / backward via {path}:\n" + "\n".join(failures)


# --------------------------------------------------------------------------- the full matrix
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", list(CASES))
def test_engine_backward_matches_oracle(case_name, mode):
    """engine.backward(per-sample losses), every clipping function x style."""
    check_against_oracle(case_name, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", ["transformer", "resnet-groupnorm", "layernorm-2d-shape-no-bias"])
def test_kept_gradients_alone_and_joined_match_oracle(case_name, mode, monkeypatch):
    """The kept per-sample gradients of biases and norms are joined into one matrix per group (SmallGradients) up to
    pipeline.SMALL_NUMEL numbers a sample; larger ones are reduced one by one. Every case with a limit of 0 (none
    joined) too, so that the path of a large kept gradient keeps its oracle test."""
    import dptrain.core.pipeline

    monkeypatch.setattr(dptrain.core.pipeline, "SMALL_NUMEL", 0)
    check_against_oracle(case_name, mode, combos=SOME_COMBOS)


PLAIN_BACKWARD_CASES = [
    "linear-[B,T,d]", "mlp-inplace-relu", "frozen-bitfit", "conv2d", "embedding-padding-idx",
    "layernorm-2d-shape-no-bias", "resnet-groupnorm", "transformer", "called-twice-conv-embedding",
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
@pytest.mark.parametrize("case_name", PLAIN_BACKWARD_CASES)
def test_plain_loss_backward_matches_oracle(case_name, mode, reduction):
    """Single-backward modes: loss = losses.mean() (or .sum()); loss.backward(); step."""
    check_against_oracle(case_name, mode, path=reduction, combos=SOME_COMBOS)


# --------------------------------------------------------------------------- the max_grad_norm choice
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case_name", ["linear-[B,d]", "conv3d", "transformer"])
def test_threshold_clips_some_samples_and_not_others(case_name, style):
    """Guards the matrix above against vacuous abadi/global comparisons."""
    case = get_case(case_name)
    norms = scaled_group_norms(case, resolve_style(style, case.model))
    R = threshold_for(case_name, style)
    assert (norms > R).any() and (norms < R).any()


# --------------------------------------------------------------------------- edge batches
EDGE_CASES = ["linear-[B,T,d]", "transformer"]


def _paths(mode):
    return ["engine", "mean", "sum"] if mode in SINGLE_BACKWARD_MODES else ["engine"]


def _mode_path_params():
    return [pytest.param(m, p, id=f"{m}-{p}") for m in MODES for p in _paths(m)]


def _slice(case: Case, stop: int) -> Case:
    return Case(case.model, case.losses_fn, tuple(t[:stop] for t in case.batch))


@pytest.mark.parametrize("mode,path", _mode_path_params())
@pytest.mark.parametrize("case_name", EDGE_CASES)
def test_batch_of_one_matches_oracle(case_name, mode, path):
    case = _slice(get_case(case_name), 1)
    (norm,) = scaled_group_norms(case, "all-layer")[0].tolist()
    model = copy.deepcopy(case.model)
    failures = []
    for R in (0.5 * norm, 2.0 * norm):  # clipped, then not clipped
        for fn, style in SOME_COMBOS:
            s = resolve_style(style, case.model)
            key = (case_name, "batch-of-one", R, fn, style, torch.get_default_dtype())
            if key not in _references:
                _references[key] = reference(case, max_grad_norm=R, clipping_fn=fn, clipping_style=s)
            ref = _references[key]
            got = engine_clipped_sum(case, model=model, mode=mode, max_grad_norm=R, clipping_fn=fn,
                                     clipping_style=s, path=path)
            failures += mismatches(got, ref, rtol=RTOL, relative_to="largest", what=f"R={R:.3g} fn={fn} style={style}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode,path", _mode_path_params())
@pytest.mark.parametrize("case_name", ["linear-[B,T,d]", "conv2d", "called-twice-parallel"])
def test_empty_batch_gives_zero_gradient(case_name, mode, path):
    """B = 0: the clipped sum is zero (and finite) for every parameter; the step still works."""
    case = _slice(get_case(case_name), 0)
    got = engine_clipped_sum(case, mode=mode, max_grad_norm=1.0, path=path)
    for name, g in got.items():
        assert torch.equal(g, torch.zeros_like(g)), f"{name}: {g}"


# --------------------------------------------------------------------------- random conv configurations
@st.composite
def conv_configs(draw):
    n = draw(st.integers(1, 3))
    per_dim = lambda lo, hi: tuple(draw(st.integers(lo, hi)) for _ in range(n))  # noqa: E731
    stride = per_dim(1, 3)
    groups = draw(st.sampled_from([1, 2, 4]))
    padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    if all(s == 1 for s in stride) and draw(st.booleans()):
        padding = draw(st.sampled_from(["same", "valid"]))
    else:
        padding = per_dim(0, 2)
    kwargs = dict(kernel_size=per_dim(1, 3), stride=stride, dilation=per_dim(1, 2), groups=groups,
                  padding=padding, padding_mode=padding_mode, bias=draw(st.booleans()),
                  out_channels=groups * draw(st.integers(1, 2)))
    size = per_dim({1: 6, 2: 5, 3: 4}[n], {1: 9, 2: 6, 3: 5}[n])
    return n, kwargs, size, draw(st.sampled_from(MODES))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(conv_configs())
def test_random_conv_configuration_matches_oracle(config):
    n, kwargs, size, mode = config
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[n](4, **kwargs)
    x = torch.randn(3, 4, *size) * 2
    try:
        with torch.no_grad():
            out = conv(x)
    except RuntimeError:
        return  # torch itself rejects this configuration (e.g. reflect padding wider than the input)
    if out.numel() == 0:
        return
    case = Case(ConvNet([conv], out[0].numel(), 3), classify, (x, torch.randint(0, 3, (3,))))
    R = scaled_group_norms(case, "all-layer").median().item()
    for fn in ("abadi", "automatic"):
        ref = reference(case, max_grad_norm=R, clipping_fn=fn)
        got = engine_clipped_sum(case, mode=mode, max_grad_norm=R, clipping_fn=fn)
        assert_matches(got, ref, what=f"{mode} {fn} {type(conv).__name__}({kwargs}) input {size}")


@pytest.mark.parametrize("mode", MODES)
def test_engine_on_copy_leaves_case_model_untouched(mode):
    """Sanity check of the harness: the oracle's model is never attached (hooks stay on copies)."""
    case = get_case("transformer")
    before = copy.deepcopy(case.model.state_dict())
    engine_clipped_sum(case, mode=mode, max_grad_norm=1.0)
    for name, t in case.model.state_dict().items():
        assert torch.equal(t, before[name])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in case.model.modules())
