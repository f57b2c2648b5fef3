"""Which sample each row of a layer call belongs to is read from the gradient (dptrain.rows), never from a shape.

Every model here has a layer whose leading dimension equals the batch size by coincidence (B = T, B = C, N = B)
or whose rows are samples in another layout. Each is exact against the one-sample-at-a-time oracle, or refused;
none is silently wrong. Float64, noise 0, batch_size 1 (the step's p.grad is the clipped sum).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dptrain
from dptrain import plan, rows
from dptrain.rows.reading import tolerance
from dptrain.testing import clipped_gradient, reference_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, Opaque, assert_matches, one_sample_update, tag_passes_counted
from test_engine import RUN, R, _backward, _engine

PATHS = [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES]


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _reference(model, batches):
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return reference_clipped_gradient(model, _losses, (x, y), max_grad_norm=R)


def _data(B, T, seed, d=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


# ------------------------------------------------------------------------------------------ one sample per row
class SequenceFirstInside(nn.Module):
    """A batch-first model with one layer run on [T, B, d] (as XLNet's and Longformer's layers)."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # [T, B, 8]
        h = torch.tanh(self.mid(h)).transpose(0, 1)
        return self.head(h.mean(1))


class SortsTheBatch(nn.Module):
    """Sorts the batch inside forward (by a data-dependent key) and un-sorts after: the layout changes per batch."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        order = x[:, 0, 0].argsort()
        h = torch.tanh(self.inp(x[order])).mean(1)
        return self.head(h[order.argsort()])


class EmbeddingWindows(nn.Module):
    """Windows of tokens folded into the batch, [B * W, N, d], as in window attention, through a norm and a conv."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm(torch.tanh(self.inp(x)).reshape(B * (T // 2), 2, 8))  # windows of 2 tokens
        h = self.conv(h.transpose(1, 2)).reshape(B, T // 2, 4, 2).mean((1, 3))
        return self.head(h)


ONE_SAMPLE_PER_ROW = {"sequence-first layer": SequenceFirstInside, "sorted batch": SortsTheBatch,
                      "windows folded into the batch": EmbeddingWindows}


@pytest.mark.parametrize("B,T", [(3, 4), (4, 4), (2, 4)], ids=["B!=T", "B=T", "T=2B"])
@pytest.mark.parametrize("name", list(ONE_SAMPLE_PER_ROW))
@pytest.mark.parametrize("mode,path", PATHS)
def test_rows_of_one_sample_in_another_layout_are_regrouped_exactly(float64, mode, path, name, B, T):
    torch.manual_seed(0)
    model = ONE_SAMPLE_PER_ROW[name]().double()
    batches = [_data(B, T, seed=1), _data(B, T, seed=2), _data(B + 1, T, seed=3)]
    got = clipped_gradient(copy.deepcopy(model), _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(model, batches), what=name)


@pytest.mark.parametrize("name", list(ONE_SAMPLE_PER_ROW))
@pytest.mark.parametrize("mode,path", PATHS)
def test_one_sample_in_another_layout_moves_the_model_by_at_most_R(float64, mode, path, name):
    torch.manual_seed(0)
    x, y = _data(1, 4, seed=5)
    model = ONE_SAMPLE_PER_ROW[name]().double()
    assert one_sample_update(model, _losses, (10 * x, y), mode=mode, max_grad_norm=R, path=RUN[path]) <= R * (1 + 1e-9)


def test_a_data_dependent_layout_is_read_at_every_step(float64):
    """The sort picks rows by the data: a batch that happens to be in order (the identity this time) proves nothing
    about the next, which is read again, and exact."""
    torch.manual_seed(0)
    model = SortsTheBatch().double()
    trained = copy.deepcopy(model)
    engine = _engine(trained, "bk-mixopt", loss_reduction="sum")
    opt = torch.optim.SGD(trained.parameters(), lr=0.0)
    engine.attach(opt)
    try:
        with tag_passes_counted() as passes:
            x, y = _data(4, 3, seed=1)
            x[:, 0, 0] = torch.arange(4.0)  # already sorted
            engine.backward(_losses(trained, x, y))
            opt.zero_grad()
            first = len(passes)
            x, y = _data(4, 3, seed=2)
            engine.backward(_losses(trained, x, y))
            opt.step()
            got = {n: p.grad.clone() for n, p in trained.named_parameters()}
    finally:
        engine.detach()
    assert first > 0 and len(passes) == 2 * first
    assert_matches(got, _reference(model, [(x, y)]), what="sorted batch, second step")


class PositionalIndex(nn.Module):
    """Rows picked by positions the forward makes itself (XLNet's relative shift: index_select with torch.arange), on
    an axis as long as a multiple of the batch; ``reversed``: positions derived from them (flipped), not followed."""

    def __init__(self, reversed_: bool = False):
        super().__init__()
        self.reversed = reversed_
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))  # [B, T, 8], T = 2B below
        positions = torch.arange(h.shape[1])
        if self.reversed:
            positions = positions.flip(0)
        return self.head(h.index_select(1, positions).mean(1))


@pytest.mark.parametrize("reversed_", [False, True])
def test_an_index_along_the_positions_is_proven_whatever_its_values(float64, reversed_):
    """An index on another axis than the batch's picks positions within each sample, whatever it holds (made by
    torch.arange, or reversed): the graph proves it (no tag pass), and the step is exact."""
    torch.manual_seed(0)
    model = PositionalIndex(reversed_).double()
    batches = [_data(3, 6, seed=1)]
    with tag_passes_counted() as passes:
        got = clipped_gradient(copy.deepcopy(model), _losses, *batches, mode="bk-mixopt", max_grad_norm=R)
    assert_matches(got, _reference(model, batches), what=f"reversed={reversed_}")
    assert not passes


# ------------------------------------------------------------------------------------------ rows that mix samples
class PerClassVectors(nn.Module):
    """A Linear on per-class vectors [C, d] (shared by every sample): with C = B its rows look like samples."""

    def __init__(self, classes):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.classes = nn.Parameter(torch.randn(classes, 8), requires_grad=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.inp(x)).mean(1) @ self.proj(self.classes).t()


class Positions(nn.Module):
    """A position embedding added to the tokens' features, looked up as nanoGPT does (``table``: [T] ids, rows
    shared by every sample), on [1, T] ids reduced over their batch axis by user code (``reduced``), or on
    [1, T] ids broadcast by the addition, as Hugging Face's GPT-2 does (``broadcast``: per-sample once expanded)."""

    def __init__(self, lookup: str):
        super().__init__()
        self.lookup = lookup
        self.wte, self.wpe = nn.Linear(6, 8), nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        ids = torch.arange(x.shape[1])
        pos = {"table": lambda: self.wpe(ids), "reduced": lambda: self.wpe(ids.unsqueeze(0)).sum(0),
               "broadcast": lambda: self.wpe(ids.unsqueeze(0))}[self.lookup]()
        return self.head(torch.tanh(self.wte(x) + pos).mean(1))


MIXING = {"per-class vectors": (lambda: PerClassVectors(4), "proj"),
          "position table": (lambda: Positions("table"), "wpe"),
          "[1, T] ids reduced over the batch": (lambda: Positions("reduced"), "wpe")}


@pytest.mark.parametrize("name", list(MIXING))
@pytest.mark.parametrize("mode,path", PATHS)
def test_rows_that_mix_samples_are_refused_also_when_B_equals_their_count(float64, mode, path, name):
    build, layer = MIXING[name]
    torch.manual_seed(0)
    model = build().double()
    engine = _engine(model, mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _data(4, 4, seed=1)  # B = T = C = 4
    with pytest.raises((ValueError, RuntimeError), match=rf"{layer} \("):
        _backward(engine, model, x, y, path)


def test_an_embedding_on_broadcast_ids_added_to_the_batch_stays_exact(float64):
    """[1, T] position ids broadcast by an addition (Hugging Face's GPT-2): the expanded rows are per-sample."""

    torch.manual_seed(0)
    model = Positions("broadcast").double()
    for mode, path in [("bk-mixopt", "engine"), ("ghost", "engine"), ("per-sample", "plain")]:
        batches = [_data(4, 4, seed=1), _data(3, 4, seed=2)]
        got = clipped_gradient(copy.deepcopy(model), _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
        assert_matches(got, _reference(model, batches), what=f"{mode}-{path}")


# ------------------------------------------------------------------------------------------ the reading itself
@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 9), per=st.integers(1, 4), width=st.integers(1, 5), seed=st.integers(0, 10_000),
       layout=st.sampled_from(["identity", "blocks", "interleaved", "permuted", "mixed"]))
def test_read_rows_finds_the_sample_of_every_row_or_refuses(batch, per, width, seed, layout):
    g = torch.Generator().manual_seed(seed)
    if layout == "mixed":  # rows of one value can mix into a tag's value by chance: the residual needs two
        width = max(width, 2)
    n = batch * (1 if layout in ("identity", "permuted") else per)
    owner = {"identity": torch.arange(batch), "blocks": torch.arange(batch).repeat_interleave(per),
             "interleaved": torch.arange(batch).repeat(per), "permuted": torch.randperm(batch, generator=g),
             "mixed": torch.arange(batch).repeat_interleave(per)}[layout]
    contributions = torch.randn(n, width, generator=g, dtype=torch.float64)
    tags = rows.make_tags(batch, g)
    grad = contributions.clone()
    tagged = [contributions * v[owner].unsqueeze(1) for v in tags]
    if layout == "mixed" and batch > 1:
        extra = torch.randn(width, generator=g, dtype=torch.float64)  # row 0 also gets the last sample's gradient
        grad[0] += extra
        for t, v in zip(tagged, tags):
            t[0] += v[batch - 1] * extra
        with pytest.raises(rows.RowsMixSamples):
            rows.read_rows(grad, tagged, tags, batch, two_axes=False)
        return
    found = rows.read_rows(grad, tagged, tags, batch, two_axes=False)
    assert torch.equal(found.samples, owner)
    assert found.identity == bool(torch.equal(owner, torch.arange(n)) and n == batch)


def test_pattern_keys_change_when_the_batch_size_equals_another_dimension():
    assert rows.pattern_key((8, 12, 32), 8) == rows.pattern_key((5, 12, 32), 5)
    assert rows.pattern_key((16, 16, 32), 16) != rows.pattern_key((8, 16, 32), 8)
    assert rows.pattern_key((16, 8, 32), 8) != rows.pattern_key((16, 5, 32), 5)  # T = 2B: a new pattern


# ------------------------------------------------------------------------------------------ caching
class InterleavesHalves(nn.Module):
    """Permutes the batch by a reshape (no indexing op the watch would see): row 2i is sample i, row 2i + 1 sample
    B/2 + i; un-permuted after its layer. Sample 0 stays at row 0, where the identity has it too."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        B = x.shape[0]
        h = x.mean(1)
        if B % 2:  # (the oracle's batches of one)
            return self.head(torch.tanh(self.inp(h)))
        h = torch.tanh(self.inp(h.reshape(2, B // 2, -1).transpose(0, 1).reshape(B, -1)))
        return self.head(h.reshape(B // 2, 2, -1).transpose(0, 1).reshape(B, -1))


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_layout_read_while_some_samples_had_no_gradient_is_not_cached(float64, mode, path):
    """A step where only sample 0 contributes (the others padding: loss weight 0) shows only where sample 0's row
    is, and there the identity agrees with the permutation: taken for the layout, the next step was 0.18 off."""
    torch.manual_seed(0)
    model = InterleavesHalves().double()
    trained = copy.deepcopy(model)
    engine = _engine(trained, mode, loss_reduction="sum")
    opt = torch.optim.SGD(trained.parameters(), lr=0.0)
    engine.attach(opt)
    try:
        x, y = _data(4, 3, seed=1)
        padded = _losses(trained, x, y) * torch.tensor([1.0, 0.0, 0.0, 0.0])
        engine.backward(padded) if path == "engine" else padded.sum().backward()
        opt.step()
        opt.zero_grad()
        x, y = _data(4, 3, seed=2)
        _backward(engine, trained, x, y, path)
        opt.step()
        got = {n: p.grad.clone() for n, p in trained.named_parameters()}
    finally:
        engine.detach()
    assert_matches(got, _reference(model, [(x, y)]), what=f"{mode}-{path}")


class SequenceFirstInsideOpaque(SequenceFirstInside):
    def forward(self, x):
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # [T, B, 8]
        h = torch.tanh(Opaque.apply(self.mid(h))).transpose(0, 1)
        return self.head(h.mean(1))


def test_rows_read_by_tags_are_read_again_at_every_step(float64):
    """Rows read from tag passes show where a sample sits only as far as its loss had a gradient, and only for the
    values of that step: nothing read by tags is kept. A step where one sample has no gradient, then an ordinary one:
    both read their rows, and the second is exact."""
    torch.manual_seed(0)
    model = SequenceFirstInsideOpaque().double()
    trained = copy.deepcopy(model)
    engine = _engine(trained, "bk-mixopt", loss_reduction="sum")
    opt = torch.optim.SGD(trained.parameters(), lr=0.0)
    engine.attach(opt)
    try:
        with tag_passes_counted() as passes:
            x, y = _data(4, 3, seed=1)
            engine.backward(_losses(trained, x, y) * torch.tensor([1.0, 1.0, 0.0, 1.0]))
            opt.zero_grad()
            first = len(passes)
            x, y = _data(4, 3, seed=2)
            engine.backward(_losses(trained, x, y))
            opt.step()
            got = {n: p.grad.clone() for n, p in trained.named_parameters()}
    finally:
        engine.detach()
    assert first > 0 and len(passes) == 2 * first
    assert_matches(got, _reference(model, [(x, y)]), what="read again")


def test_a_layout_proven_from_the_graph_does_not_depend_on_the_losses_values(float64):
    """Where the graph proves the layout (rows.proof: a transpose keeps the batch on the other axis), it holds for
    every sample, whatever the losses weigh: no tag pass, exact at the next step."""
    torch.manual_seed(0)
    model = SequenceFirstInside().double()
    trained = copy.deepcopy(model)
    engine = _engine(trained, "bk-mixopt", loss_reduction="sum")
    opt = torch.optim.SGD(trained.parameters(), lr=0.0)
    engine.attach(opt)
    try:
        with tag_passes_counted() as passes:
            x, y = _data(4, 3, seed=1)
            engine.backward(_losses(trained, x, y) * torch.tensor([1.0, 1.0, 0.0, 1.0]))
            opt.zero_grad()
            x, y = _data(4, 3, seed=2)
            engine.backward(_losses(trained, x, y))
            opt.step()
            got = {n: p.grad.clone() for n, p in trained.named_parameters()}
    finally:
        engine.detach()
    assert not passes
    assert_matches(got, _reference(model, [(x, y)]), what="proven layout")


# ------------------------------------------------------------------------------------------ a forward that mixes samples
class MeanOverBatchFirst(nn.Module):
    """A frozen layer, a mean over the batch, then the trainable head: each sample's loss sees every sample's input."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.inp.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x)).mean(1)
        return self.head(h + h.mean(0, keepdim=True))


@pytest.mark.parametrize("B", [4, 3], ids=["B=T", "B!=T"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_mean_over_the_batch_before_the_trainable_layers_is_refused(float64, mode, path, B):
    torch.manual_seed(0)
    model = MeanOverBatchFirst().double()
    x, y = _data(B, 4, seed=1)
    engine = _engine(model, mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0))
    try:
        with pytest.raises(ValueError, match=r"forward mixes samples before its trainable layers.*head \("):
            _backward(engine, model, x, y, path)
    finally:
        engine.detach()


class ReturnsClassVectors(nn.Module):
    """Returns the samples' features [B, d] and the projected per-class vectors [C, d]; the loss compares them
    (CLIP-like). The class vectors are shared by every sample whatever C is."""

    def __init__(self, classes):
        super().__init__()
        self.inp, self.proj = nn.Linear(6, 8), nn.Linear(8, 8)
        self.classes = nn.Parameter(torch.randn(classes, 8), requires_grad=False)

    def forward(self, x):
        return torch.tanh(self.inp(x)).mean(1), self.proj(self.classes)


def _class_vector_losses(model, x, y):
    features, classes = model(x)
    return F.cross_entropy(features @ classes.t(), y, reduction="none")


def _refused_on_the_plain_path(B, C, mode):
    torch.manual_seed(0)
    model = ReturnsClassVectors(C).double()
    x, y = _data(B, 4, seed=1)
    engine = _engine(model, mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0))
    try:
        with pytest.raises((ValueError, RuntimeError), match=r"proj \("):
            _class_vector_losses(model, x, y % C).sum().backward()
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_table_returned_by_the_model_is_refused_on_the_plain_path_when_C_differs_from_B(float64, mode):
    _refused_on_the_plain_path(B=3, C=4, mode=mode)


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_table_returned_by_the_model_is_refused_on_the_plain_path_when_C_equals_B(float64, mode):
    _refused_on_the_plain_path(B=4, C=4, mode=mode)


def test_last_decisions_show_each_layers_layout(float64):
    """identity for a batch-first layer, the regrouped layout for one run sequence-first; plan() runs no backward
    and reads none."""
    torch.manual_seed(0)
    model = SequenceFirstInside().double()
    x, y = _data(4, 3, seed=1)
    engine = _engine(model, "bk-mixopt", loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    try:
        engine.backward(_losses(model, x, y))
        layouts = {d.name: d.layout for d in engine.last_decisions()}
    finally:
        engine.detach()
    assert layouts == {"inp": "identity", "mid": "transposed over 2 axes", "head": "identity"}
    assert all(d.layout is None for d in plan(model, x))


# ------------------------------------------------------------------------------------------ rows that are not samples
def _views_setup(mode, seed=0):
    """A Poisson loader attached to the engine (batch_size 6, noise 0, lr 1) and one of its non-empty batches."""
    from torch.utils.data import TensorDataset

    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,)))
    loader = dptrain.data.poisson_loader(data, batch_size=6, generator=torch.Generator().manual_seed(seed))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    engine = dptrain.PrivacyEngine(model, batch_size=6, sample_size=30, noise_multiplier=0.0, max_grad_norm=R,
                                   clipping_mode=mode, loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt, data_loader=loader)
    batches = iter(loader)
    x, y = next(b for b in batches if len(b[0]) > 1)
    return model, engine, opt, x, y, batches


def test_a_batch_from_a_loader_that_was_not_attached_is_refused_naming_attach(float64):
    """A plain DataLoader taken up mid-run, the Poisson loader still attached: its larger batch is refused, and the
    message says to attach the new loader (an outside probe read only the views' fix in it)."""
    from torch.utils.data import DataLoader, TensorDataset

    model, engine, opt, x, y, _ = _views_setup("bk-mixopt")
    data = TensorDataset(torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,)))
    xs, ys = next(iter(DataLoader(data, batch_size=20)))
    with pytest.raises(ValueError, match=r"attach that loader instead \(engine.detach\(\), then "
                                         r"engine.attach\(optimizer, data_loader=\.\.\.\)"):
        engine.backward(F.cross_entropy(model(xs), ys, reduction="none"))
    engine.detach()


@pytest.mark.parametrize("mode,path", [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES])
def test_a_backward_over_more_rows_than_the_loaders_batch_is_refused(float64, mode, path):
    """``model(torch.cat([x, x_aug]))``: each row would be clipped as a sample (a sample moving the model by 2R);
    with a loader attached the engine knows the batch had fewer samples, refuses, and keeps nothing of it."""
    model, engine, opt, x, y, _ = _views_setup(mode)
    augmented = x + 0.1 * torch.randn_like(x)
    with pytest.raises(ValueError, match=r"the attached loader's batch had \d+ samples"):
        losses = F.cross_entropy(model(torch.cat([x, augmented])), torch.cat([y, y]), reduction="none")
        if path == "engine":
            engine.backward(losses)
        else:
            losses.sum().backward()
    # one call per view, one loss per sample (the sum of its views'): exact, and nothing of the refused one stayed
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def both_views(m, xi, ai, yi):
        return F.cross_entropy(m(xi), yi, reduction="none") + F.cross_entropy(m(ai), yi, reduction="none")

    expected = reference_clipped_gradient(copy.deepcopy(model), both_views, (x, augmented, y), max_grad_norm=R)
    engine.backward(both_views(model, x, augmented, y))
    opt.step()
    got = {n: (before[n] - p.detach()) * 6 for n, p in model.named_parameters()}  # the step divides by batch_size
    assert_matches(got, expected, what=f"{mode}-{path}")


def test_the_next_batch_fetched_before_the_backward_is_not_mistaken_for_the_current_one(float64):
    """A loop that fetches batch k+1 before back-propagating batch k (prefetching) is not refused."""
    model, engine, opt, x, y, batches = _views_setup("bk-mixopt", seed=3)
    smaller = next(b for b in batches if len(b[0]) < len(x))  # handed out now, before x's backward
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    opt.step()
    assert engine.steps_taken == 1 and len(smaller[0]) < len(x)


# ------------------------------------------------------------------------------------------ the forward's precision
def test_the_forward_precision_is_the_lowest_of_autocast_and_the_parameters():
    """A gradient's dtype does not show the precision it was computed in: the row reading allows for autocast's
    dtype and the parameters' (a float32 input gradient of a bf16 forward read by float32 rounding was refused as
    mixing samples on CUDA)."""
    cpu = torch.device("cpu")
    assert rows.computing_precision(cpu, [torch.float64]) is torch.float64
    assert rows.computing_precision(cpu, [torch.float32, torch.float64]) is torch.float32
    assert rows.computing_precision(cpu, [torch.bfloat16, torch.float32]) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rows.computing_precision(cpu, [torch.float32]) is torch.bfloat16
    assert rows.computing_precision(torch.device("meta"), [torch.float32]) is torch.float32  # no autocast there


def test_rows_computed_in_bf16_are_read_with_bf16_rounding_where_passes_may_round_apart():
    """One sample's rows whose tagged gradient carries bf16-sized rounding, as passes that round apart give them (a
    GPU's non-deterministic kernels): refused by float32 rounding, read at the forward's precision; rows that mix two
    samples are refused at either. Where every pass is exact (the CPU), such a row is refused at any precision: a row
    of one sample is then exactly its tag times the real row."""
    torch.manual_seed(0)
    batch, width = 4, 16
    g = torch.randn(batch, width)
    tags = rows.make_tags(batch, torch.Generator().manual_seed(1), 1)
    noisy = [(tags[0].float().unsqueeze(1) * g) * (1 + 3e-3 * torch.randn(batch, width))]  # bf16-sized error

    def read(real, tagged, precision, device=None):
        eps, rel = tolerance(torch.float32, precision, device)
        return rows.read_sketches(real.double(), [t.double() for t in tagged], tags, batch, (batch, width), 1, eps, rel)

    with pytest.raises(rows.RowsMixSamples):
        read(g, noisy, None)
    assert read(g, noisy, torch.bfloat16).identity
    with pytest.raises(rows.RowsMixSamples):
        read(g, noisy, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(rows.RowsMixSamples):
        rows.read_rows(g, noisy, tags, batch, two_axes=False, precision=torch.bfloat16)
    mixed = [noisy[0].clone()]
    mixed[0][1] = tags[0][1] * g[1] + tags[0][2] * g[2]  # row 1 carries sample 2's gradient too
    mixed_g = g.clone()
    mixed_g[1] = g[1] + g[2]
    with pytest.raises(rows.RowsMixSamples):
        read(mixed_g, mixed, torch.bfloat16)


@pytest.mark.parametrize("width", [1, 7, 300, 70_001])
def test_sketched_reading_sees_a_mixture_of_a_percent_and_passes_every_row_of_one_sample(width):
    """The reading keeps 16 Gaussian projections of each row (rows.sketch): a row that carries 1 % of another
    sample's gradient (orthogonal to its own) is refused on every draw (the miss probability is 7e-26), and rows of
    one sample scaled by their tags are read exactly, also across several blocks of the projection."""
    batch = 4
    g = torch.Generator().manual_seed(width)
    for seed in range(20 if width < 1000 else 3):
        grad = torch.randn(batch, width, generator=g, dtype=torch.float64)
        tags = rows.make_tags(batch, g)
        tagged = [grad * v.unsqueeze(1) for v in tags]
        projections = rows.Projections(seed)
        assert rows.read_rows(grad, tagged, tags, batch, two_axes=False, projections=projections).identity
        if width == 1:
            continue  # (a row of one number is a multiple of any other: its mixtures are seen by the tag's value)
        other = torch.randn(width, generator=g, dtype=torch.float64)
        other -= (other @ grad[0]) / (grad[0] @ grad[0]) * grad[0]  # orthogonal to row 0's own gradient
        other *= 0.01 * grad[0].norm() / other.norm()
        mixed = [t.clone() for t in tagged]  # row 0 also gets sample 1's gradient, a percent of its own size
        for t, v in zip(mixed, tags):
            t[0] += v[1] * other
        with pytest.raises(rows.RowsMixSamples):
            rows.read_rows(grad + torch.nn.functional.pad(other[None], (0, 0, 0, batch - 1)), mixed, tags, batch,
                           two_axes=False, projections=projections)
