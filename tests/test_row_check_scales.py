"""Samples whose gradients differ in scale by orders of magnitude. Clipping gives every clipped sample the same weight R,
whatever its scale, so a sample whose gradient is 1e-4 of another's counts as much as that one once both are clipped.
A forward that adds sample 1's hidden row to sample 0's puts sample 0's (small) gradient into row 1, next to sample 1's
own: the part is 1e-4 of the row, and the tag reading took it for rounding (its relative slack was a thousand of
float32's units), so the row was read as sample 1's while sample 0's gradient, formed from sample 1's values, kept its
full weight: 1.04-2.1 R, silent, every mode, at an R that clips both (an outside probe). A row of one sample is exactly
its tag times its real row where every pass runs the same kernels (a power of two commutes with rounding): on the CPU
(and on CUDA with deterministic algorithms) a row must now fit exactly, so a part of another sample is read as mixing
down to what the backward itself keeps of it (its own rounding of the row: docs/row-check.md). Where the passes may
round differently (fp16, a GPU's non-deterministic kernels) the slack stays."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.rows import reading
from dptrain.rows.reading import EXACT_REL, make_tags, read_sketches, reproducible, tolerance
from dptrain.testing import neighbour_test
from helpers import MODES, Opaque

B, D = 4, 4
MIXED = "mix the gradients of several samples"


class _AddsARow(nn.Module):
    """``h[0] += c * h[1]`` after the first layer, ``c`` given with the batch (each sample carries it): nothing mixes
    where it is 0, but the product across rows leaves ``l1``'s rows to the tag passes. ``across=False``: no such
    product (``l1``'s rows are proven the samples' own)."""

    def __init__(self, across: bool = True):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, 1)
        self.across = across

    def forward(self, x, c):
        h = self.l1(x)
        if self.across:
            mix = torch.zeros(len(x), len(x), dtype=h.dtype)
            if len(x) > 1:
                mix[0, 1] = c[0]
            h = h + mix @ h
        return self.l2(torch.tanh(h))


def _weighted(m, x, w, c):
    return w * m(x, c).pow(2).sum(1)


def _batch(seed: int, weights, input_scale=None, coefficient: float = 1.0):
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(seed))
    if input_scale is not None:
        x[2] *= input_scale
    return x, torch.tensor(weights), torch.full((B,), coefficient)


def _model(across: bool = True):
    torch.manual_seed(1)
    return _AddsARow(across)


@pytest.mark.parametrize("start", ["cold", "warm"])
@pytest.mark.parametrize("spread", ["loss weights", "an input's scale"])
@pytest.mark.parametrize("mode", MODES)
def test_a_mixture_far_smaller_than_its_row_is_refused(mode, spread, start):
    """Sample 0's loss weighs 1e-4 (with sample 2's 1e9, or sample 2's input 1e5 times the others'): its gradient in
    row 1 is 1e-4 of sample 1's there. Warm: steps of the same forward with c = 0 first (nothing mixes; exact), then
    the mixing step."""
    batch = _batch(0, [1e-4, 1.0, 1e9 if spread == "loss weights" else 1.0, 1.0],
                   1e5 if spread == "an input's scale" else None)
    warm_up = [_batch(1, [1e-4, 1.0, 1.0, 1.0], coefficient=0.0), _batch(2, [1.0, 1e-4, 1e9, 1.0], coefficient=0.0)]
    report = neighbour_test(_model(), _weighted, batch, mode=mode, max_grad_norm=[1e-6, 1e-3, 1e3],
                            warm_up=warm_up if start == "warm" else [])
    assert report.refused is not None and MIXED in report.refused, report
    assert report.worst <= 1.0 + 1e-6, report


@pytest.mark.parametrize("mode", MODES)
def test_samples_of_scales_far_apart_that_do_not_mix_are_read_exactly(mode):
    """The control: the same model with nothing mixed (c = 0), losses weighted from 1e-6 to 1e6 and an input 1e5 times
    the others', read by tag passes at every step: not refused, within the bound at an R that clips every sample, some,
    and none; after ordinary steps, and before them (the reading keeps nothing from one step for the next)."""
    ordinary, spread = _batch(1, [1.0] * B, coefficient=0.0), _batch(0, [1e-6, 1.0, 1e6, 1e-3], 1e5, 0.0)
    for warm_up, batch in (([ordinary], spread), ([spread, ordinary], _batch(2, [1.0] * B, coefficient=0.0))):
        report = neighbour_test(_model(), _weighted, batch, mode=mode, max_grad_norm=[1e-9, 1e-3, 1e9],
                                warm_up=warm_up)
        assert report.refused is None, report
        assert report.worst <= 1.0 + 1e-6, report


def _coupled_in_the_loss(m, x, w, c):
    """Sample 0's loss also reads sample 1's output."""
    out = m(x, c).squeeze(1)
    coupled = out.clone()
    if len(x) > 1:
        coupled = coupled + torch.cat([out[1:2], out.new_zeros(len(x) - 1)])
    return w * coupled.pow(2)


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_small_samples_coupling_in_the_loss_is_refused(mode):
    """The loss check reads as the layers do: sample 0's loss, weighted 1e-4, also reads sample 1's output."""
    report = neighbour_test(_model(), _coupled_in_the_loss, _batch(0, [1e-4, 1.0, 1.0, 1.0], coefficient=0.0),
                            mode=mode, max_grad_norm=[1e-6, 1e3])
    assert report.refused is not None and "the loss couples samples" in report.refused, report
    assert report.worst <= 1.0 + 1e-6, report


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_users_of_scales_far_apart(mode):
    """User level: samples 0 and 1 (weights 1e-4 and 1) coupled in the loss across users is refused, and within one
    user, whose samples' scales differ as much, it is exact (a layer's rows are read per example, so the model here
    has no product across rows: user-level.md)."""
    batch = _batch(0, [1e-4, 1.0, 1.0, 1.0], coefficient=0.0)
    across = neighbour_test(_model(across=False), _coupled_in_the_loss, batch, mode=mode, users=[0, 1, 2, 3],
                            max_grad_norm=[1e-6, 1e3])
    assert across.refused is not None and "the loss couples" in across.refused, across
    within = neighbour_test(_model(across=False), _coupled_in_the_loss, batch, mode=mode, users=[0, 0, 1, 2],
                            max_grad_norm=[1e-6, 1e3], remove=[1, 2])  # (users 1, 2: the coupling stays within user 0)
    assert within.refused is None, within
    assert within.worst <= 1.0 + 1e-6, within


def test_where_the_passes_are_exact():
    """The CPU's passes are exact, CUDA's with deterministic algorithms, never fp16's; exact readings allow no
    rounding (eps 0) and a misfit of EXACT_REL only."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert reproducible(cpu, None) and reproducible(cpu, torch.bfloat16)
    assert not reproducible(cpu, torch.float16) and not reproducible(None, None)
    assert tolerance(torch.float32, None, cpu) == (0.0, EXACT_REL)
    eps, rel = tolerance(torch.float32, torch.float16, cpu)
    assert eps == torch.finfo(torch.float16).eps and rel == 0.05
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not reproducible(cuda, None)
        reading._WARNED.clear()
        with pytest.warns(UserWarning, match="without deterministic algorithms.*use_deterministic_algorithms"):
            assert tolerance(torch.float32, None, cuda)[1] == 1e3 * torch.finfo(torch.float32).eps
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (said once a process)
            tolerance(torch.float32, None, cuda)
        torch.use_deterministic_algorithms(True)
        assert reproducible(cuda, None)
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_reading_of_a_part_of_another_sample():
    """The reading itself: a row of sample 1 holding a part of sample 0's row 1e-7 of its own is mixed when read
    exactly, and passes with float32's slack (what a GPU's non-deterministic passes keep); rows exactly their tags
    pass both ways, and a row of nothing in every pass is a row of no sample."""
    g = torch.Generator().manual_seed(0)
    tags = make_tags(3, g)
    own = torch.randn(3, 16, dtype=torch.float64, generator=g)
    own[2] = 0.0
    part = torch.zeros(3, 16, dtype=torch.float64)
    part[1] = 1e-7 * own[0]  # sample 0's gradient in row 1
    real = own + part
    tagged = [v[:, None] * own + v[0] * part for v in tags]
    with pytest.raises(Exception, match=MIXED):
        read_sketches(real, tagged, tags, 3, (3, 16), 1, 0.0, EXACT_REL)
    assert read_sketches(real, tagged, tags, 3, (3, 16), 1, *tolerance(torch.float32, None, None)).identity
    assert read_sketches(own, [v[:, None] * own for v in tags], tags, 3, (3, 16), 1, 0.0, EXACT_REL).identity


class _FrozenHalfMiddle(nn.Module):
    """float32 trainable layers around a frozen fp16 one, no autocast; ``Opaque`` leaves the rows to the tag passes."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)
        self.mid = nn.Linear(32, 32).half().requires_grad_(False)

    def forward(self, x):
        h = self.mid(Opaque.apply(torch.tanh(self.l1(x))).half()).float()
        return self.l3(Opaque.apply(torch.relu(self.l2(h))))


@pytest.mark.parametrize("mode", ["per-sample", "ghost", "bk-mixopt"])
def test_a_frozen_fp16_part_keeps_the_reading_loose(mode):
    """A gradient through a frozen fp16 part is rounded in fp16, where a tag's power of two rounds small values: the
    forward's precision counts every parameter, frozen ones too (the trainable ones alone read float32, and the exact
    reading refused this model, which mixes nothing; an outside probe)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(6, 16, generator=g), torch.randint(0, 5, (6,), generator=g)
    report = neighbour_test(_FrozenHalfMiddle(), lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), batch,
                            mode=mode, max_grad_norm=[1e-3, 1e3], remove=[0, 3])
    assert report.refused is None, report
    assert report.worst <= 1.0 + 1e-2, report  # (fp16 rounding in the frozen part)


def _weighted_bf16(m, x, w, c):
    with torch.autocast("cpu", torch.bfloat16):
        return (w * m(x, c).pow(2).sum(1)).float()


@pytest.mark.parametrize("start", ["cold", "warm"])
@pytest.mark.parametrize("precision", ["bf16 autocast", "float32 at 3e-9"])
@pytest.mark.parametrize("mode", MODES)
def test_a_part_below_the_backwards_own_rounding_is_read_at_the_others_scale(mode, precision, start):
    """Sample 0's part of row 1 below the backward's own rounding of that row (bf16: a loss weighted 1e-4; float32:
    3e-9) is rounded away in every pass alike, so no reading of the real gradient shows it: 1.1-1.4 R, silent (an
    outside probe). The tag passes and a reference pass weigh sample 0's loss up to the others' scale
    (``reading.even_scales``): its part is as large as sample 1's there, and the row reads as mixed."""
    bf16 = precision == "bf16 autocast"
    losses = _weighted_bf16 if bf16 else _weighted
    x, w, _ = _batch(0, [1e-4 if bf16 else 3e-9, 1.0, 1.0, 1.0])
    batch = x, w, torch.tensor([1.0, 0.0, 0.0, 0.0])  # (sample 0 carries the coefficient: without it nothing mixes)
    warm_up = [_batch(1, [1e-4, 1.0, 1.0, 1.0], coefficient=0.0)] if start == "warm" else []
    report = neighbour_test(_model(), losses, batch, mode=mode, max_grad_norm=[1e-9, 1e3], warm_up=warm_up)
    assert report.refused is not None and MIXED in report.refused, report


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_samples_of_scales_far_apart_are_read_exactly_under_bf16(mode):
    """The control under bf16 autocast: nothing mixed, losses weighted from 1e-6 to 1e6, read by tag passes weighted
    to even the scales out: not refused, within the bound (bf16's rounding of the sums)."""
    report = neighbour_test(_model(), _weighted_bf16, _batch(0, [1e-6, 1.0, 1e6, 1e-3], coefficient=0.0), mode=mode,
                            max_grad_norm=[1e-9, 1e9], warm_up=[_batch(1, [1.0] * B, coefficient=0.0)])
    assert report.refused is None, report
    assert report.worst <= 1.0 + 2.0 ** -6, report


def test_the_scales_that_even_out_the_losses():
    """Powers of two that bring each loss up towards the largest, at least 1 and at most 2^40; None where none would
    be 8 or more, under fp16, or with a non-finite loss."""
    losses = torch.tensor([1.0, 1e-3, -2.0, 0.0, 1e-30])
    assert reading.even_scales(losses, None).tolist() == [2.0, 2.0 ** 10, 1.0, 2.0 ** 40, 2.0 ** 40]
    assert reading.even_scales(torch.tensor([1.0, 0.5, 3.0]), None) is None
    assert reading.even_scales(losses, torch.float16) is None
    assert reading.even_scales(torch.tensor([1.0, float("nan")]), None) is None


def test_the_scales_are_not_applied_under_data_parallelism(monkeypatch):
    """Every rank runs the backwards all ranks agreed on (FSDP2 gathers parameters in each): a reference pass that only
    some ranks' losses asked for hung the others (the FSDP2 example under torchrun). Several processes: no weighting."""
    losses = torch.tensor([1.0, 1e-6])
    assert reading.even_scales(losses, None) is not None
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    assert reading.even_scales(losses, None) is None
