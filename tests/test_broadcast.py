"""A layer output of batch size 1 broadcast over the batch (position ids ``[1, T]``) keeps its shape and values under
the engine (dptrain.broadcast): where it meets the batch it carries each sample's gradient to that sample's row, and
any other use is read at every step (refused where several samples' gradients reach one row), never cached.

Float64, noise 0, batch_size 1 (the step's p.grad is the clipped sum); B = T and B != T.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.core.broadcast import BroadcastRows
from dptrain.testing import clipped_gradient, reference_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, assert_matches, one_sample_update
from test_engine import RUN, R, _backward, _engine

PATHS = [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES]
D = 8


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _data(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


class Positions(nn.Module):
    """Features plus a position table looked up on ``[1, T]`` ids, then used by ``use`` (the table's output and the
    features): what each use sees of the table's shape is recorded in ``seen``."""

    USES = {
        # broadcast against the batch, or row by row first: exact
        "added": lambda pos, h: h + pos,
        "moved, then added": lambda pos, h: h + pos.to(h.dtype).contiguous(),
        "permuted twice, then added": lambda pos, h: (h.transpose(1, 2) + pos.permute(0, 2, 1)).transpose(1, 2),
        "multiplied": lambda pos, h: h * torch.sigmoid(pos),
        "where": lambda pos, h: torch.where(h > 0, pos, h),
        "added in place to the features": lambda pos, h: h.__iadd__(pos),  # BERT's `embeddings += position_embeddings`
        "copied into the features": lambda pos, h: (h * 1).copy_(pos) + h,
        # written in place, then used (as DeBERTa scales its projected table, Longformer its global queries): exact
        "changed in place": lambda pos, h: h + pos.mul_(2),
        "split into heads, divided in place": lambda pos, h: h + _heads_divided(pos),
        "one column set in place": lambda pos, h: h + _column_set(pos),
        "changed in place twice, used between": lambda pos, h: (h + pos.mul_(2)) * torch.sigmoid(pos.add_(1.0)),
        # used as a whole: the same values as without the engine, refused where it gets a gradient
        "first row": lambda pos, h: h + pos[0],
        "summed over its batch axis": lambda pos, h: h + pos.sum(0),
        "viewed as [T, d]": lambda pos, h: h + pos.view(pos.shape[1], pos.shape[2]),
        "dropout on the table alone": lambda pos, h: h + F.dropout(pos, 0.5, training=True),
        # written in place through a view taken as a whole, then used: its gradient would go around the engine
        "first row changed in place, then added": lambda pos, h: h + _first_row_doubled(pos),
        "viewed as [T, d], changed in place, then added": lambda pos, h: h + _viewed_and_doubled(pos),
    }

    def __init__(self, use: str, norm: bool = False):
        super().__init__()
        self.use = use
        self.wte, self.wpe = nn.Linear(6, D), nn.Embedding(16, D)
        self.norm = nn.LayerNorm(D) if norm else None
        self.head = nn.Linear(D, 3)
        self.seen: list[tuple] = []

    def forward(self, x):
        pos = self.wpe(torch.arange(x.shape[1], device=x.device).unsqueeze(0))
        if self.norm is not None:
            pos = self.norm(pos)  # a covered layer on the table alone: row by row
        self.seen.append(tuple(pos.shape))
        return self.head(torch.tanh(self.USES[self.use](pos, self.wte(x))).mean(1))


def _heads_divided(pos):
    """DeBERTa's `transpose_for_scores` then `/=`: a view naming the table's batch axis, a permutation, a write."""
    heads = pos.view(pos.size()[:-1] + (2, -1)).permute(0, 2, 1, 3)
    heads /= 3.0
    return heads.permute(0, 2, 1, 3).reshape(pos.shape)


def _column_set(pos):
    pos[..., 0] = 0.5
    return pos


def _first_row_doubled(pos):
    pos[0] *= 2  # pos[0] is the table as a whole ([T, d]), not its rows: the write goes around them
    return pos


def _viewed_and_doubled(pos):
    whole = pos.view(pos.shape[1], pos.shape[2])  # the table as a whole, an ordinary tensor
    whole *= 2
    return whole


EXACT = ["added", "moved, then added", "permuted twice, then added", "multiplied", "where",
         "added in place to the features", "copied into the features", "changed in place",
         "split into heads, divided in place", "one column set in place", "changed in place twice, used between"]
AS_A_WHOLE = ["first row", "summed over its batch axis", "viewed as [T, d]", "dropout on the table alone"]
SIZES = {"B=T": (4, 4), "B!=T": (3, 5)}


def _reference(model, batches):
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return reference_clipped_gradient(model, _losses, (x, y), max_grad_norm=R)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("use", EXACT)
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_table_broadcast_over_the_batch_keeps_its_shape_and_is_exact(float64, mode, path, use, size):
    B, T = SIZES[size]
    torch.manual_seed(0)
    model = Positions(use, norm=use == "added").double()
    batches = [_data(B, T, seed=1), _data(B + 1, T, seed=2)]
    trained = copy.deepcopy(model)
    got = clipped_gradient(trained, _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(model, batches), what=f"{mode}-{path}-{use}")
    assert set(trained.seen) == {(1, T, D)}  # as without the engine


@pytest.mark.parametrize("use", EXACT)
@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk", "plain"), ("ghost", "engine"), ("per-sample", "plain")])
def test_one_sample_through_a_broadcast_table_moves_the_model_by_at_most_R(float64, mode, path, use):
    torch.manual_seed(0)
    model = Positions(use, norm=use == "added").double()
    x, y = _data(1, 4, seed=3)
    with torch.no_grad():  # a large gradient, so that the clipping bound is what is tested
        model.head.weight.mul_(50)
    moved = one_sample_update(model, _losses, (x, y), mode=mode, max_grad_norm=R, path=RUN[path])
    assert moved <= R * (1 + 1e-9)


@pytest.mark.parametrize("path", ["engine", "plain"])
@pytest.mark.parametrize("use, when, why", [
    # the table used after the write: refused in the forward, its rows no longer hold its values
    ("first row changed in place, then added", "forward", "through a view of it that the engine does not follow"),
    # an ordinary view of it used after the write: refused when the gradient reaches the write (capture's guard)
    ("viewed as [T, d], changed in place, then added", "backward", "the loss depends on a view of it taken before"),
])
def test_a_broadcast_table_written_through_a_view_of_it_as_a_whole_is_refused(float64, path, use, when, why):
    """``pos[0] *= 2`` writes the table through a view that is not its rows (the table as a whole), which the engine
    does not follow: refused, naming the layer, before any gradient is given."""
    model = Positions(use).double()
    x, y = _data(4, 4, seed=1)
    engine = _engine(model, "bk-mixopt", loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    match = rf"wpe \(Embedding\), a table broadcast over the batch, was modified in place.*{why}"
    if when == "forward":
        with pytest.raises(ValueError, match=match):
            model(x)
    else:
        model(x)  # (the forward runs as without the engine)
    with pytest.raises(ValueError, match=match):
        _backward(engine, model, x, y, path)
    engine.detach()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("use", AS_A_WHOLE)
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_broadcast_table_used_as_a_whole_is_refused_naming_the_layer(float64, mode, path, use, size):
    B, T = SIZES[size]
    torch.manual_seed(0)
    model = Positions(use).double()
    if use != "dropout on the table alone":  # the forward's values are those without the engine
        x, _ = _data(B, T, seed=1)
        expected = model(x)
        engine = _engine(model, mode, loss_reduction="sum")
        engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
        assert torch.equal(model(x), expected)
        engine.detach()
    engine = _engine(model, mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _data(B, T, seed=1)
    with pytest.raises(ValueError, match=r"wpe \(Embedding\): its output, of batch size 1 .* was used by"):
        _backward(engine, model, x, y, path)


class ProjectedGrid(nn.Module):
    """A fixed coordinate grid of batch size 1 projected by a trainable layer, then broadcast over the batch: by a
    1x1 convolution and ``.repeat(B, 1, 1, 1)`` (timm's XCiT), or by a Linear and an addition."""

    def __init__(self, layer: str):
        super().__init__()
        self.layer = layer
        self.inp = nn.Conv2d(3, D, 1)
        self.proj = nn.Conv2d(4, D, 1) if layer == "conv" else nn.Linear(4, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        B, _, H, W = x.shape
        grid = torch.stack(torch.meshgrid(torch.linspace(-1, 1, H, dtype=x.dtype, device=x.device),
                                          torch.linspace(-1, 1, W, dtype=x.dtype, device=x.device), indexing="ij"))
        grid = torch.cat([grid, grid.sin()]).unsqueeze(0)  # [1, 4, H, W]
        if self.layer == "conv":
            pos = self.proj(grid).repeat(B, 1, 1, 1)
        else:
            pos = self.proj(grid.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(torch.tanh(self.inp(x) + pos).mean((2, 3)))


def _images(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, 4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("B", [4, 5])  # 4: B = H
@pytest.mark.parametrize("layer", ["conv", "linear"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_projected_grid_broadcast_over_the_batch_is_exact(float64, mode, path, layer, B):
    torch.manual_seed(0)
    model = ProjectedGrid(layer).double()
    batches = [_images(B, seed=1), _images(2, seed=2)]
    got = clipped_gradient(copy.deepcopy(model), _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(model, batches), what=f"{mode}-{path}-{layer}")


@pytest.mark.parametrize("layer", ["conv", "linear"])
@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk", "plain"), ("ghost", "engine"), ("per-sample", "plain")])
def test_one_sample_through_a_projected_grid_moves_the_model_by_at_most_R(float64, mode, path, layer):
    torch.manual_seed(0)
    model = ProjectedGrid(layer).double()
    with torch.no_grad():
        model.head.weight.mul_(50)
    moved = one_sample_update(model, _losses, _images(1, seed=3), mode=mode, max_grad_norm=R, path=RUN[path])
    assert moved <= R * (1 + 1e-9)


class SometimesWhole(Positions):
    """Broadcasts the table, and on some batches also uses its first row for every sample: a layout cached from
    the first kind of batch must not be taken for the second."""

    def __init__(self):
        super().__init__("added")
        self.whole = False

    def forward(self, x):
        pos = self.wpe(torch.arange(x.shape[1], device=x.device).unsqueeze(0))
        h = self.wte(x) + pos
        if self.whole:
            h = h + pos[0]
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk", "plain"), ("ghost", "engine"), ("per-sample", "plain")])
def test_a_use_as_a_whole_after_cached_steps_is_still_refused(float64, mode, path):
    torch.manual_seed(0)
    model = SometimesWhole().double()
    engine = _engine(model, mode, loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    for seed in range(3):  # the layout of wpe's call is read once, then cached
        x, y = _data(4, 4, seed=seed)
        _backward(engine, model, x, y, path)
        opt.step()
        opt.zero_grad()
    model.whole = True
    x, y = _data(4, 4, seed=9)
    with pytest.raises(ValueError, match=r"wpe \(Embedding\): its output, of batch size 1 .*__getitem__"):
        _backward(engine, model, x, y, path)


class FrozenTableAsAWhole(Positions):
    """The table's output is used as a whole where no gradient reaches it: nothing to refuse."""

    def forward(self, x):
        pos = self.wpe(torch.arange(x.shape[1], device=x.device).unsqueeze(0))
        scale = pos.detach().sum(0).abs().mean()  # a statistic of the table, no gradient
        return self.head(torch.tanh((self.wte(x) + pos) * scale).mean(1))


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_use_as_a_whole_without_gradient_is_exact(float64, mode, path):
    torch.manual_seed(0)
    model = FrozenTableAsAWhole("added").double()
    batches = [_data(4, 4, seed=1)]
    got = clipped_gradient(copy.deepcopy(model), _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(model, batches), what=f"{mode}-{path}")


class HookedTable(Positions):
    def __init__(self, hook):
        super().__init__("added")
        self.hook = hook

    def forward(self, x):
        pos = self.wpe(torch.arange(x.shape[1], device=x.device).unsqueeze(0))
        if pos.requires_grad:
            pos.register_hook(self.hook)
        return self.head(torch.tanh(self.wte(x) + pos).mean(1))


def test_a_hook_on_the_table_sees_its_gradient_as_without_the_engine(float64):
    torch.manual_seed(0)
    seen = []
    model = HookedTable(lambda g: seen.append(g.clone())).double()
    x, y = _data(4, 4, seed=1)
    _losses(model, x, y).sum().backward()
    expected = seen.pop()
    model.zero_grad()
    engine = _engine(model, "bk-mixopt", loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    # (a hook registered in the forward acts outside the graph: every step reads its rows by tag passes, which run
    # the hook too; the last call is the real backward's)
    for _ in range(2):
        seen.clear()
        _backward(engine, model, x, y, "plain")
        opt.step()
        opt.zero_grad()
        assert len(seen) >= 1 and seen[-1].shape == (1, 4, D)
        torch.testing.assert_close(seen[-1], expected, rtol=1e-12, atol=1e-12)


def test_a_hook_that_changes_the_table_s_gradient_is_refused(float64):
    torch.manual_seed(0)
    model = HookedTable(lambda g: 2 * g).double()
    engine = _engine(model, "bk-mixopt", loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _data(4, 4, seed=1)
    with pytest.raises(ValueError, match=r"hook .* broadcast over the batch"):
        _backward(engine, model, x, y, "engine")


def test_the_table_is_an_ordinary_tensor_outside_the_engine_and_at_batch_size_one(float64):
    model = Positions("added").double()
    model(_data(3, 4, seed=1)[0])
    engine = _engine(model, "bk-mixopt", loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    kinds = []
    model.wpe.register_forward_hook(lambda m, a, out: kinds.append(type(out)))
    model(_data(3, 4, seed=1)[0])
    model(_data(1, 4, seed=1)[0])
    assert kinds == [BroadcastRows, torch.Tensor]


def test_last_decisions_show_the_table_s_rows_broadcast_over_the_batch(float64):
    model = Positions("added").double()
    engine = _engine(model, "bk-mixopt", loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _data(3, 4, seed=1)
    _backward(engine, model, x, y, "engine")
    layouts = {d.name: d.layout for d in engine.last_decisions()}
    assert layouts["wpe"] == "identity (one row broadcast over the batch)"
    assert layouts["wte"] == "identity"
