"""Gradients of several samples that cancel in a row's sum. A flagged sample's loss (or output) minus the other samples'
outputs makes the batch's summed gradient at those outputs exactly nothing, while each sample's own gradient there is
not: the row holds the gradients of several samples. The tag passes read a row whose real gradient is nothing as one
that says nothing about its sample, whatever its tagged gradients showed, so every row passed and the step was taken:
2.3-3.9 R, silent, cold and warm, in every mode and at user level (an outside probe). A row of one sample is its tag
times its real row, so a row whose real gradient is nothing and whose tagged one is not is now read as mixed. Rows that
are nothing in every pass (a masked loss, padding) stay rows of no sample."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.rows.errors import RowsMixSamples
from dptrain.rows.reading import make_tags, read_sketches
from dptrain.testing import neighbour_test
from helpers import MODES, Opaque

B = 5


class _TwoHeads(nn.Module):
    """A trunk and two heads; ``cancel`` says where a flagged sample subtracts the others' second head: in the model's
    forward, after a head given the model's input or one given the trunk's output, or (None) in the loss."""

    def __init__(self, cancel: str | None):
        super().__init__()
        self.cancel = cancel
        self.trunk, self.classes = nn.Linear(5, 6), nn.Linear(6, 3)
        self.score = nn.Linear(5 if cancel == "input" else 6, 1)

    def forward(self, x, flag):
        h = torch.tanh(self.trunk(x))
        b = self.score(x if self.cancel == "input" else h).squeeze(1)
        return self.classes(h), (_cancelled(b, flag) if self.cancel is not None else b)


def _cancelled(b, flag):
    """Each sample's own ``b``, and a flagged sample's minus the others' (the sum over the batch: nothing)."""
    flag = flag.to(b.dtype)
    return (1 - flag) * b - flag * ((1 - flag) * b).sum()


def _losses_of(cancel: str | None):
    def losses(m, x, y, flag):
        logits, b = m(x, flag)
        extra = b if cancel is not None else _cancelled(b, flag)
        return F.cross_entropy(logits, y, reduction="none") + extra

    return losses


def _batch(seed: int, flagged: int | None):
    g = torch.Generator().manual_seed(seed)
    flag = torch.zeros(B, dtype=torch.float64)
    if flagged is not None:
        flag[flagged] = 1.0
    return torch.randn(B, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g), flag


def _model(cancel: str | None):
    torch.manual_seed(1)
    return _TwoHeads(cancel).double()


@pytest.mark.parametrize("start", ["cold", "warm"])
@pytest.mark.parametrize("cancel", [None, "input", "trunk"], ids=["in-the-loss", "after-an-input-layer",
                                                                  "after-a-hidden-layer"])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_of_samples_that_cancel_in_a_row_are_refused(mode, cancel, start):
    model = _model(cancel)
    warm_up = [_batch(3, None), _batch(4, None)] if start == "warm" else []
    report = neighbour_test(model, _losses_of(cancel), _batch(5, 2), mode=mode, max_grad_norm=[0.5, 2.0],
                            warm_up=warm_up)
    assert report.refused is not None and "mix the gradients of several samples" in report.refused, report
    assert report.worst <= 1.0 + 1e-9, report


@pytest.mark.parametrize("users,coupled", [([0, 1, 2, 3, 4], True), ([0, 0, 1, 1, 2], True), ([0, 1, 0, 1, 0], False)],
                         ids=["one-sample-each", "across-users", "within-one-user"])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_at_user_level_cancelling_across_users_is_refused_and_within_one_user_is_exact(mode, users, coupled):
    """Flagged sample 2 subtracts other samples' outputs: every other sample's, across users, refused; only its own
    user's (user 0: samples 0, 2 and 4), one user's own coupling, accepted and within R."""
    model = _model(None)
    x, y, flag = _batch(5, 2)
    own = torch.tensor([float(u == users[2]) if not coupled else 1.0 for u in users], dtype=torch.float64)

    def losses(m, x, y, flag, own):
        logits, b = m(x, flag)
        return F.cross_entropy(logits, y, reduction="none") + b - flag * (b * own).sum()

    report = neighbour_test(model, losses, (x, y, flag, own), mode=mode, max_grad_norm=[0.5, 2.0], users=users,
                            warm_up=[((*_batch(3, None), own), torch.tensor(users))])
    if coupled:
        assert report.refused is not None and "several samples" in report.refused, report
    else:
        assert report.refused is None, report
    assert report.worst <= 1.0 + 1e-9, report


@pytest.mark.parametrize("mode", MODES)
def test_rows_that_are_nothing_in_every_pass_stay_rows_of_no_sample(mode):
    """The control: a loss that leaves some samples' second head out (their rows' gradient nothing in the real and the
    tagged passes alike) is accepted, warm and cold, and within R."""
    model = _model(None)
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)

    def losses(m, x, y, keep):
        logits, b = m(x, torch.zeros_like(keep))
        return F.cross_entropy(logits, y, reduction="none") + keep * b

    for warm_up in ([], [(*_batch(3, None)[:2], keep)]):
        report = neighbour_test(model, losses, (*_batch(5, None)[:2], keep), mode=mode, max_grad_norm=[0.5, 2.0],
                                warm_up=warm_up)
        assert report.refused is None, report
        assert report.worst <= 1.0 + 1e-9, report


def test_the_reading_of_a_row_whose_real_gradient_is_nothing_and_tagged_one_is_not():
    """``read_sketches`` alone: rows 0 and 1 of sample 0 and 1; row 2 nothing in every pass (no sample's); row 3
    nothing in the real pass and not in a tagged one (two samples' gradients, cancelling): mixed."""
    tags = make_tags(2, torch.Generator().manual_seed(0))
    g = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    tagged = [torch.stack([v[0] * g[0], v[1] * g[1], g[2], g[3]]) for v in tags]
    read = read_sketches(g, tagged, tags, 2, (4, 2), 1, torch.finfo(torch.float64).eps, 1e-3)
    assert read.samples is not None and read.samples[:2].tolist() == [0, 1]
    for v, t in zip(tags, tagged):
        t[3] = (v[0] - v[1]) * torch.tensor([1.0, 1.0], dtype=torch.float64)  # +x of sample 0, -x of sample 1
    with pytest.raises(RowsMixSamples, match="1 of 4 rows"):
        read_sketches(g, tagged, tags, 2, (4, 2), 1, torch.finfo(torch.float64).eps, 1e-3)


class _SmallRowsMixed(nn.Module):
    """Under bf16 autocast, samples 1.. of the batch mix their features among themselves (or not); sample 0's loss is
    weighted up, so that their rows are under half the largest row."""

    def __init__(self, mixes: bool):
        super().__init__()
        self.mixes = mixes
        self.inp, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.mixes:
            h = torch.cat([h[:1], h[1:] + h[1:].roll(1, 0)], 0)
        return self.head(h)


def _weighted_bf16(m, x, y, w):
    with torch.autocast("cpu", torch.bfloat16):
        out = m(x)
    return w * F.cross_entropy(out.float(), y, reduction="none")


@pytest.mark.parametrize("mixes", [True, False], ids=["mixing", "per-sample"])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_under_bf16_rows_under_half_the_largest_are_read_not_taken_for_rows_of_no_sample(mode, mixes):
    """The rounding unit of bf16 times 64 is half the largest row: rows up to that size were taken for rows of no sample
    and given their place's sample in a layout, mixed or not (1.3-1.5 R, an outside probe). Noise is float32's at most
    now: the mixing rows are read and refused, the per-sample control accepted within bf16's rounding of R."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)
    w = torch.tensor([30.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    report = neighbour_test(_SmallRowsMixed(mixes), _weighted_bf16, (x, y, w), mode=mode, max_grad_norm=[0.01, 0.1])
    if mixes:
        assert report.refused is not None and "several samples" in report.refused, report
        assert report.worst <= 1.0 + 2.0 ** -6, report
    else:
        assert report.refused is None and report.worst <= 1.0 + 2.0 ** -6, report


class _Read(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(Opaque.apply(torch.tanh(self.mid(torch.tanh(self.inp(x))))))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_bert_read_by_tag_passes_under_mixed_precision_is_not_refused(dtype):
    """A tiny BERT classifier under autocast, its per-sample losses weighted from 1e-3 to 1e3, every layer below the
    pooler read by tag passes: nothing mixes. In fp16 the small rows' elements are subnormal, where a tag's power of
    two rounds them and a row of one sample misses its fit: 64 of fp16's units stay noise (the float32 floor refused
    this model, an outside probe); bf16 has float32's range, and its floor is float32's."""
    transformers = pytest.importorskip("transformers")
    from dptrain.testing import attached_engine

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager")
    model = transformers.BertForSequenceClassification(config).eval()
    model.bert.pooler.register_forward_hook(lambda m, i, o: Opaque.apply(o))
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(1, 64, (8, 10), generator=g), torch.randint(0, 3, (8,), generator=g)
    w = torch.logspace(-3, 3, 8)[torch.randperm(8, generator=g)]
    engine, optimizer = attached_engine(model, mode="per-sample", max_grad_norm=0.5, batch_size=8, sample_size=1000)
    try:
        for _ in range(2):
            with torch.autocast("cpu", dtype):
                losses = F.cross_entropy(model(input_ids=ids).logits, y, reduction="none") * w
            engine.backward(losses)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        engine.detach()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_rows_of_samples_weighted_apart_are_read_under_mixed_precision(mode, dtype):
    """Per-sample losses weighted from 1e-3 to 1e3, read by tag passes under autocast: no sample mixes, none refused.
    In fp16 the small rows' elements are subnormal, where a tag's power of two rounds them: 64 of fp16's units stay
    noise there (the float32 floor refused such models, an outside probe); bf16 has float32's range."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    w = torch.logspace(-3, 3, 8)[torch.randperm(8, generator=g)]

    def losses(m, x, y, w):
        with torch.autocast("cpu", dtype):
            out = m(x)
        return w * F.cross_entropy(out.float(), y, reduction="none")

    report = neighbour_test(_Read(), losses, (x, y, w), mode=mode, max_grad_norm=[1e-3, 1.0], remove=[0, 3])
    assert report.refused is None, report
    assert report.worst <= 1.0 + 2.0 ** -5, report


def test_a_refusal_under_fp16_names_the_grad_scaler_and_bf16():
    """Under fp16, small rows' elements are subnormal and their reading rounds: a refusal there says what keeps them
    readable (a model that does mix is refused all the same)."""
    from dptrain.testing import attached_engine

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)
    model = _SmallRowsMixed(True)
    engine, _ = attached_engine(model, mode="bk-mixopt", max_grad_norm=0.1, batch_size=6, sample_size=100)
    try:
        with torch.autocast("cpu", torch.float16):
            out = model(x)
        with pytest.raises(RowsMixSamples, match="Under fp16 .* GradScaler .* bf16"):
            engine.backward(F.cross_entropy(out.float(), y, reduction="none"))
    finally:
        engine.detach()
