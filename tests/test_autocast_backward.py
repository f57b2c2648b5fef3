"""A backward run inside the user's ``torch.autocast`` region (``loss.backward()`` or ``engine.backward`` in the
``with`` block, as many loops write it): autocast lowers ``bmm``, ``mm`` and ``einsum`` to bf16, and the engine's own
arithmetic ran under it. Ghost norms then had 8 bits and book-keeping's clipped sum was rounded to bf16 as a whole, so
removing one of 256 aligned samples moved the clipped sum by 1.09-1.18 R here (1.65 R in a probe with 512). The oracle is DP's own: with noise 0 the
clipped sums of D and of D without one sample differ by at most R, whatever the backward's autocast."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.layers.numerics import autocast_is_on, without_autocast
from dptrain.testing import attached_engine
from helpers import MODES, SINGLE_BACKWARD_MODES

R = 0.1


class _Tokens(nn.Module):
    """Every rule with a product in it: an embedding (Gram of one-hot rows), a convolution, linear layers on tokens
    (Gram norms, book-keeping's weighted sum), a layer norm."""

    def __init__(self, middle: nn.Module | None = None):
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.hidden = nn.Linear(8, 16)
        self.middle = middle if middle is not None else nn.Identity()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, ids):
        h = self.embed(ids)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(self.middle(torch.tanh(self.hidden(h)))))


def _batch(size: int):
    """Nearly the same sample ``size`` times: their clipped gradients add up (a sum of ``size`` R), so a relative
    rounding of the sum is many R, and one sample's share of it is exactly R."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (1, 6), generator=gen).expand(size, 6).clone()
    ids[:, -1] = torch.randint(0, 12, (size,), generator=gen)
    targets = torch.randint(0, 5, (1, 6), generator=gen).expand(size, 6).clone()
    return ids, targets


def _clipped_sum(model, batch, mode: str, inside: bool, path: str = "engine", warm_steps: int = 0) -> torch.Tensor:
    """The clipped sum (noise 0) of one step on ``batch``, its forward under CPU bf16 autocast and its backward (and
    ``optimizer.step()``) inside the ``with`` block or after it, after ``warm_steps`` steps with the backward outside."""
    model = copy.deepcopy(model)
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    try:
        for step in range(warm_steps + 1):
            last = step == warm_steps
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ids, targets = batch
                losses = F.cross_entropy(model(ids).transpose(1, 2), targets, reduction="none").mean(1)
                if inside and last:
                    engine.backward(losses) if path == "engine" else losses.sum().backward()
                    optimizer.step()
            if not (inside and last):
                engine.backward(losses) if path == "engine" else losses.sum().backward()
                optimizer.step()
        return torch.cat([p.grad.detach().double().flatten() for p in model.parameters()])
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_one_sample_moves_the_clipped_sum_by_at_most_R_with_the_backward_inside_autocast(mode):
    torch.manual_seed(0)
    model = _Tokens()
    ids, targets = _batch(256)
    full = _clipped_sum(model, (ids, targets), mode, inside=True, warm_steps=1)
    without_one = _clipped_sum(model, (ids[1:], targets[1:]), mode, inside=True)
    distance = (full - without_one).norm().item() / R
    # float32 arithmetic on a sum of 256 R: ~1e-5 R of rounding; bf16 arithmetic was 0.3-0.65 R above the bound
    assert distance <= 1 + 1e-3, f"{mode}: removing one sample moved the clipped sum by {distance:.4f} R"


@pytest.mark.parametrize("mode", MODES)
def test_the_clipped_sum_is_the_same_whether_the_backward_runs_inside_autocast_or_after_it(mode):
    torch.manual_seed(0)
    model = _Tokens()
    batch = _batch(64)
    inside = _clipped_sum(model, batch, mode, inside=True)
    after = _clipped_sum(model, batch, mode, inside=False)
    scale = after.abs().max().item()
    assert (inside - after).abs().max().item() <= 1e-5 * scale, mode


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_plain_loss_backward_inside_autocast_is_clipped_in_float32(mode):
    torch.manual_seed(0)
    model = _Tokens()
    ids, targets = _batch(256)
    full = _clipped_sum(model, (ids, targets), mode, inside=True, path="plain")
    without_one = _clipped_sum(model, (ids[1:], targets[1:]), mode, inside=True, path="plain")
    distance = (full - without_one).norm().item() / R
    assert distance <= 1 + 1e-3, f"{mode}: removing one sample moved the clipped sum by {distance:.4f} R"


class _Gated(nn.Module):
    """A module without a rule (the per-sample fallback replays it under the forward's autocast): a learned gate."""

    def __init__(self, width: int):
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, h):
        return h * torch.sigmoid(self.gate) + h.square() @ torch.ones(h.shape[-1], h.shape[-1]) * 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_a_module_the_fallback_replays_is_clipped_in_float32_with_the_backward_inside_autocast(mode):
    torch.manual_seed(0)
    model = _Tokens(middle=_Gated(16))
    ids, targets = _batch(256)
    full = _clipped_sum(model, (ids, targets), mode, inside=True, warm_steps=1)
    without_one = _clipped_sum(model, (ids[1:], targets[1:]), mode, inside=True)
    distance = (full - without_one).norm().item() / R
    assert distance <= 1 + 1e-3, f"{mode}: removing one sample moved the clipped sum by {distance:.4f} R"


def test_without_autocast_turns_off_every_autocast_that_is_on_and_restores_it():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_is_on()
        a = torch.randn(2, 3, 4)
        with without_autocast():
            assert not autocast_is_on()
            assert torch.bmm(a, a.transpose(1, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert torch.bmm(a, a.transpose(1, 2)).dtype == torch.bfloat16
    assert not autocast_is_on()
