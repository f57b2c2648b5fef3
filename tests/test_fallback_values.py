"""The per-sample fallback's checks read values, so no verdict of theirs is reused for other values.

Whether a module keeps the samples of a batch apart can depend on the data (an expert whose capacity some batches
overflow, a gate that takes another sample's row on some inputs), on a coefficient that is 0 at first (a mixing weight
a schedule raises), or on the batch (one sample cannot show mixing). Each test runs ordinary steps first, exact against
the float64 one-sample-at-a-time oracle and bounded by DP's neighbour test (noise 0: the clipped sum for D and for D
without one sample differ by at most R, at an R that clips every sample and one that clips none), then the hazard, of
the same shapes where it can be: refused, naming the module.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.layers import FallbackRule
from dptrain.layers.fallback import SampleMixingError
from dptrain.rows import RowsMixSamples
from dptrain.testing import attached_engine, neighbour_test, per_sample_gradients, reference_clipped_gradient
from helpers import assert_matches

pytestmark = [pytest.mark.filterwarnings("ignore:.*use the per-sample fallback:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*replays it one sample at a time:UserWarning")]

D = 4
MODES_PATHS = [("bk-mixopt", "engine"), ("ghost", "engine"), ("per-sample", "engine"), ("bk-mixopt", "mean")]


# --------------------------------------------------------------------------- modules that mix on some values only
class CappedExpert(nn.Module):
    """Rows whose first feature is positive go to the expert, at most ``capacity`` of the call's (in order); the others
    pass through, as mixture-of-experts layers with a capacity factor drop tokens. ``container``: it also returns the
    share of rows routed (which does not depend on its weight); ``indexed``: the routed rows are picked by a boolean
    mask, which vmap cannot run (the fallback replays one sample at a time)."""

    def __init__(self, capacity: int, container: bool = False, indexed: bool = False):
        super().__init__()
        self.capacity, self.container, self.indexed = capacity, container, indexed
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))

    def forward(self, x):
        hit = x[:, 0] > 0
        routed = hit & (torch.cumsum(hit.long(), 0) <= self.capacity)
        if self.indexed:
            out = x.clone()
            out[routed] = torch.tanh(x[routed] * self.weight)
        else:
            out = torch.where(routed[:, None], torch.tanh(x * self.weight), x)
        return (out, routed.to(x.dtype).mean()) if self.container else out


class Gate(nn.Module):
    """Takes the previous sample's row where a gate on its own input opens (first feature above 2): a mask across the
    batch that keeps every row its own on ordinary data."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))

    def forward(self, x):
        h = torch.tanh(x * self.weight)
        return torch.where(x[..., :1] > 2, h.roll(1, 0), h)


class Mixing(nn.Module):
    """Adds ``mix`` times the mean over the batch (a buffer a schedule sets, as a mixup weight or a batch-attention
    coefficient warmed up from 0)."""

    def __init__(self, mix: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))
        self.register_buffer("mix", torch.tensor(mix))

    def forward(self, x):
        h = torch.tanh(x * self.weight)
        return h + self.mix * h.mean(0, keepdim=True)


class SeqFirstMixing(nn.Module):
    """Attention run sequence-first inside a batch-first model (h [T, B, d], as XLNet's): its batch axis is found
    among the axes of size B and verified; ``mix`` times the mean over the batch axis is added (0 at first)."""

    def __init__(self):
        super().__init__()
        self.q, self.v = (nn.Parameter(torch.randn(D, D) / math.sqrt(D)) for _ in range(2))
        self.register_buffer("mix", torch.tensor(0.0))

    def forward(self, h):
        q, v = h @ self.q, h @ self.v
        score = torch.einsum("ibe,jbe->ijb", q, h)
        out = torch.einsum("ijb,jbe->ibe", torch.softmax(score, dim=1), v)
        return out + self.mix * out.mean(1, keepdim=True)


class Net(nn.Module):
    """``block`` on the samples' rows ([B, d]), on their tokens ([B, T, d]), on their tokens folded into the batch
    ([B * T, d]), or sequence-first ([T, B, d]); a linear head on the mean over tokens."""

    def __init__(self, block: nn.Module, layout: str = "rows"):
        super().__init__()
        self.block, self.layout, self.head = block, layout, nn.Linear(D, 3)

    def forward(self, x):  # x [B, d] (rows) or [B, T, d]
        if self.layout == "rows":
            h = self.block(x)
        elif self.layout == "tokens":
            h = self.block(x).mean(1)
        elif self.layout == "folded":
            B, T, _ = x.shape
            h = self.block(x.reshape(B * T, D))
            h = (h[0] if isinstance(h, tuple) else h).reshape(B, T, D).mean(1)
        else:
            h = self.block(x.transpose(0, 1)).transpose(0, 1).mean(1)
        return self.head(h[0] if isinstance(h, tuple) else h)


def losses_fn(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


# --------------------------------------------------------------------------- scenarios: ordinary steps, then the hazard
def _data(seed: int, shape: tuple, first: float | None = None, low: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): ``first`` sets every row's first feature; ``low`` keeps them in (-1, 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if first is not None:
        x[..., 0] = first
    if low:
        x[..., 0] = torch.rand(shape[:-1], generator=g, dtype=torch.float64) * 2 - 1
    return x, torch.randint(0, 3, (shape[0],), generator=g)


def _one_routed(seed, shape):
    """Every first feature negative but the first row's (first token's): one routed row, within any capacity."""
    x, y = _data(seed, shape, first=-1.0)
    x.view(-1, D)[0, 0] = 1.0
    return x, y


def _open_one_gate(seed, shape, sample: int):
    """Ordinary data but for one sample whose first features are all 3 (its gate opens)."""
    x, y = _data(seed, shape, low=True)
    x[sample, ..., 0] = 3.0
    return x, y


@dataclass
class Scenario:
    build: Callable[[], nn.Module]
    warm: list            # ordinary batches, each its own step
    hazard: tuple         # the batch of the step after them
    arm: Callable | None  # what changes in the model before the hazard (a schedule), or None
    label: str            # the module as a refusal names it


def _set_mix(value):
    def arm(model):
        model.block.mix.fill_(value)
    return arm


SCENARIOS = {
    # an expert with a capacity, on the samples' rows: ordinary batches route one row, the hazard every row (4 > 2)
    "capacity": lambda: Scenario(lambda: Net(CappedExpert(2)), [_one_routed(s, (4, D)) for s in range(3)],
                                 _data(9, (4, D), first=1.0), None, r"block \(CappedExpert\)"),
    # the same, returning a tuple (the container outputs' path)
    "capacity-tuple": lambda: Scenario(lambda: Net(CappedExpert(2, container=True)),
                                       [_one_routed(s, (4, D)) for s in range(3)], _data(9, (4, D), first=1.0), None,
                                       r"block \(CappedExpert\)"),
    # the same, replayed one sample at a time (vmap cannot run it)
    "capacity-one-by-one": lambda: Scenario(lambda: Net(CappedExpert(2, indexed=True)),
                                            [_one_routed(s, (4, D)) for s in range(3)], _data(9, (4, D), first=1.0),
                                            None, r"block \(CappedExpert\)"),
    # on tokens folded into the batch (the retired repro's): six tokens routed, capacity 3
    "capacity-folded": lambda: Scenario(lambda: Net(CappedExpert(3), "folded"),
                                        [_one_routed(s, (3, 2, D)) for s in range(3)], _data(9, (3, 2, D), first=1.0),
                                        None, r"block \(CappedExpert\)"),
    # a gate that opens on one sample's data only in the hazard
    "gate": lambda: Scenario(lambda: Net(Gate()), [_data(s, (4, D), low=True) for s in range(3)],
                             _data(9, (4, D), first=3.0), None, r"block \(Gate\)"),
    # on [B, T, d] with T = B (the leading rows checked every row apart on the first call only): the gate of one
    # sample opens, which changing row 0 does not show (the row after it takes its row): the backward's checks refuse
    "gate-tokens": lambda: Scenario(lambda: Net(Gate(), "tokens"), [_data(s, (4, 4, D), low=True) for s in range(3)],
                                    _open_one_gate(9, (4, 4, D), sample=2), None, r"block \(Gate\)"),
    # a mixing weight that is 0 on the first steps, then 0.5 (the same data as the last ordinary step)
    "coefficient": lambda: Scenario(lambda: Net(Mixing()), [_data(s, (4, D)) for s in range(3)], _data(2, (4, D)),
                                    _set_mix(0.5), r"block \(Mixing\)"),
    # the same on [B, T, d] with T = B
    "coefficient-tokens": lambda: Scenario(lambda: Net(Mixing(), "tokens"), [_data(s, (4, 4, D)) for s in range(3)],
                                           _data(2, (4, 4, D)), _set_mix(0.5), r"block \(Mixing\)"),
    # the same, run sequence-first (B = T, B != T): the batch axes verified on the first steps, then mixing along them
    "coefficient-seq-first": lambda: Scenario(lambda: Net(SeqFirstMixing(), "seq-first"),
                                              [_data(s, (4, 4, D)) for s in range(3)], _data(2, (4, 4, D)),
                                              _set_mix(0.5), r"block \(SeqFirstMixing\)"),
    "coefficient-seq-first-B3": lambda: Scenario(lambda: Net(SeqFirstMixing(), "seq-first"),
                                                 [_data(s, (3, 4, D)) for s in range(3)], _data(2, (3, 4, D)),
                                                 _set_mix(0.5), r"block \(SeqFirstMixing\)"),
    # batches of one sample first (nothing to mix), then four: a mean over the batch
    "one-sample-first": lambda: Scenario(lambda: Net(Mixing(0.5)), [_data(s, (1, D)) for s in range(3)],
                                         _data(9, (4, D)), None, r"block \(Mixing\)"),
    # one sample of two tokens within the capacity (a token dropped would be the sample's own business), then three
    "one-sample-first-folded": lambda: Scenario(lambda: Net(CappedExpert(2), "folded"),
                                                [_data(s, (1, 2, D), first=1.0) for s in range(3)],
                                                _data(9, (3, 2, D), first=1.0), None, r"block \(CappedExpert\)"),
}


def _model(scenario: Scenario) -> nn.Module:
    torch.manual_seed(0)
    return scenario.build().double()


def _step(engine, optimizer, model, batch, path) -> dict[str, torch.Tensor]:
    optimizer.zero_grad(set_to_none=True)
    losses = losses_fn(model, *batch)
    if path == "engine":
        engine.backward(losses)
    else:
        losses.mean().backward()
    optimizer.step()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode, path", MODES_PATHS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ordinary_steps_are_exact_then_the_hazard_is_refused(name, mode, path):
    """One engine over the ordinary steps, each exact against the oracle, then the hazard (the data, a schedule or the
    batch's size): refused, naming the module, as it is when it comes first."""
    scenario = SCENARIOS[name]()
    model = _model(scenario)
    oracle = copy.deepcopy(model)
    norms = torch.cat([_norms(oracle, batch) for batch in scenario.warm])
    R = math.sqrt(float(norms.min()) * float(norms.max()))  # some samples clipped, some not
    assert bool((norms < R).any()) and bool((norms > R).any())
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="mean")
    try:
        for k, batch in enumerate(scenario.warm):
            got = _step(engine, optimizer, model, batch, path)
            assert_matches(got, reference_clipped_gradient(oracle, losses_fn, batch, max_grad_norm=R),
                           what=f"{name}, ordinary step {k}, {mode} through {path}")
        if scenario.arm is not None:
            scenario.arm(model)
        with pytest.raises((SampleMixingError, RowsMixSamples), match=scenario.label):
            _step(engine, optimizer, model, scenario.hazard, path)
    finally:
        engine.detach()
    cold = _model(scenario)
    if scenario.arm is not None:
        scenario.arm(cold)
    engine, optimizer = attached_engine(cold, mode=mode, max_grad_norm=R, loss_reduction="mean")
    try:  # the hazard as a first step: the same refusal
        with pytest.raises((SampleMixingError, RowsMixSamples), match=scenario.label):
            _step(engine, optimizer, cold, scenario.hazard, path)
    finally:
        engine.detach()


def _norms(model, batch) -> torch.Tensor:
    """Each sample's gradient norm (the oracle's)."""
    grads = per_sample_gradients(model, losses_fn, batch)
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))


def _clip_every_and_none(model, batch) -> tuple[float, float]:
    """(an R below every sample's gradient norm, one above every one): every sample clipped, or none."""
    norms = _norms(model, batch)
    assert float(norms.min()) > 0
    return 0.5 * float(norms.min()), 1.01 * float(norms.max())


@pytest.mark.parametrize("mode, path", MODES_PATHS)
@pytest.mark.parametrize("name", ["capacity", "capacity-tuple", "capacity-one-by-one", "capacity-folded", "gate",
                                  "gate-tokens", "coefficient", "coefficient-seq-first-B3", "one-sample-first-folded"])
def test_neighbour_test_holds_on_the_ordinary_steps_and_the_hazard_is_refused(name, mode, path):
    """DP's own definition on the last ordinary step after the others (warm): removing any one sample moves the clipped
    sum by at most R, at an R that clips every sample (by R exactly, then) and one that clips none. With the hazard
    batch instead, after the same warm-up, the step is refused (a schedule's hazard is the other test's)."""
    scenario = SCENARIOS[name]()
    model = _model(scenario)
    *warm, last = scenario.warm
    for R, clipped in zip(_clip_every_and_none(model, last), ("every sample", "no sample")):
        report = neighbour_test(model, losses_fn, last, max_grad_norm=R, mode=mode, path=path, warm_up=warm)
        assert report.refused is None and report.distances, f"{name} {mode} {path}: {report}"
        assert report.worst <= 1 + 1e-6, f"{name} {mode} {path}, R clipping {clipped}: {report}"
        if clipped == "every sample":  # each removal takes away a term of norm R, no more
            assert report.worst >= 1 - 1e-6, f"{name} {mode} {path}: {report}"
    if scenario.arm is None:
        with pytest.raises((SampleMixingError, RowsMixSamples), match=scenario.label):
            neighbour_test(model, losses_fn, scenario.hazard, max_grad_norm=1.0, mode=mode, path=path,
                           warm_up=scenario.warm)


@pytest.mark.parametrize("B", [4, 3], ids=["B=T", "B!=T"])
def test_the_batch_axes_kept_for_a_call_pattern_are_verified_again_at_every_call(B):
    """The rule alone, without the engine's reading of rows: the assignment of batch axes found on the first call is
    used on the next calls of the pattern only where it verifies on their values; once the module mixes along the
    batch axis, the call is refused, naming the module."""
    torch.manual_seed(0)
    block = SeqFirstMixing().double()
    rule = FallbackRule(block, "block")

    def capture(h):
        out = block(h)
        if rule.batch_not_leading(block, (h,), {}, out, B):
            return rule.capture_leaves(block, (h,), {}, out, B)[0]
        return rule.capture_call(block, (h,), {}, out)

    for seed in range(3):
        call = capture(_data(seed, (4, B, D))[0])  # [T, B, d]
        assert call.axes == [1] and call.outputs.axes == (1,)
    block.mix.fill_(0.5)
    with pytest.raises(SampleMixingError, match=r"^block \(SeqFirstMixing\) mixes the samples of a batch"):
        capture(_data(2, (4, B, D))[0])


class Branching(nn.Module):
    """Returns (h, aux): aux depends on its second weight only where ``gain`` (a float argument, not a tensor: the
    call's shapes do not show it) is non-zero, a branch in its forward."""

    def __init__(self):
        super().__init__()
        self.weight, self.other = (nn.Parameter(1 + 0.5 * torch.randn(D)) for _ in range(2))

    def forward(self, x, gain: float):
        h = torch.tanh(x * self.weight)
        return h, (gain * torch.tanh(x * self.other) if gain else torch.zeros_like(x))


class BranchingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head, self.gain = Branching(), nn.Linear(D, 3), 0.0

    def forward(self, x):
        h, aux = self.block(x, self.gain)
        return self.head(h + aux)


@pytest.mark.parametrize("mode, path", MODES_PATHS)
def test_which_output_leaves_depend_on_the_parameters_is_read_at_every_call(mode, path):
    """A leaf that depends on the parameters on some calls only (a branch on a float argument): while it does not, the
    other parameter has no gradient; once it does, its gradient through that leaf is counted, exactly."""
    torch.manual_seed(0)
    model = BranchingNet().double()
    oracle = copy.deepcopy(model)
    R = 0.3
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="mean")
    try:
        for k, gain in enumerate((0.0, 0.0, 1.5)):
            model.gain = oracle.gain = gain
            batch = _data(k, (4, D))
            got = _step(engine, optimizer, model, batch, path)
            expected = reference_clipped_gradient(oracle, losses_fn, batch, max_grad_norm=R)
            assert bool(expected["block.other"].abs().max() > 0) == bool(gain)
            assert_matches(got, expected, what=f"step {k} (gain {gain}), {mode} through {path}")
    finally:
        engine.detach()
