"""The proof memo proves each view of a remembered proof again, alone, before reusing it (``rows.memo._views_hold``): a
reshape to a size of the code's (``reshape(4, -1)``) keeps each row one sample at B = 4 and puts two samples in a row at
B = 8, where an op along the row then mixes them. Keyed by the node types alone, the B = 4 proof was reused at B = 8
(2.1-2.6 R in an outside probe, silent; the same step cold was refused). A reshape that folds tokens into the batch
keeps its proof from one batch size and sequence length to another.

A saved dimension is relative to the rank: ``h.squeeze()`` of ``[B, 8, T]`` keeps the rank at T = 2 and drops T at
T = 1, where ``softmax(-2)`` then runs along the batch. The graph's types are the same, and autograd saves the -2 as
it was given; a proof made at T = 2 was reused at T = 1 (1.06-1.86 R in an outside probe, every mode, user level
too; the same step cold was refused). Each view's ranks and each saved dimension's rank are now in what a proof is
reused by."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import attached_engine, neighbour_test
from helpers import MODES


class _FixedRows(nn.Module):
    """Rows reshaped to a fixed number (4: one sample a row at B = 4, two at B = 8; 8: two rows a sample at B = 4, two
    samples a row at B = 16), an op along each row, then back to the batch."""

    def __init__(self, along: str, rows: int = 4):
        super().__init__()
        self.along, self.rows = along, rows
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        rows = h.reshape(self.rows, -1)
        rows = rows.cumsum(-1) if self.along == "cumsum" else rows - rows.mean(-1, keepdim=True)
        return self.head(rows.reshape(x.shape[0], -1))


class _Folded(nn.Module):
    """Tokens folded into the batch ([B * T, d]) through a layer and back: per sample at every batch size."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):  # [B, T, 6]
        B, T, _ = x.shape
        h = torch.tanh(self.inp(x.reshape(B * T, 6))).reshape(B, T, 8)
        return self.head(h.mean(1))


def _data(B: int, seed: int, tokens: int | None = None):
    g = torch.Generator().manual_seed(seed)
    shape = (B, 6) if tokens is None else (B, tokens, 6)
    return torch.randn(*shape, generator=g) * 2, torch.randint(0, 3, (B,), generator=g)


def _losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


@pytest.mark.parametrize("along", ["cumsum", "centre"])
@pytest.mark.parametrize("mode", MODES)
def test_a_proof_at_one_batch_size_is_not_reused_where_a_fixed_reshape_puts_two_samples_in_a_row(float64, along,
                                                                                                   mode):
    torch.manual_seed(0)
    report = neighbour_test(_FixedRows(along), _losses, _data(8, 0), mode=mode, max_grad_norm=1.0,
                            warm_up=[_data(4, 1), _data(4, 2)])  # (B = 4: each row one sample, proven)
    assert report.refused is not None, f"{along}/{mode}: {report.worst:.3f} R, not refused"


def test_tokens_folded_into_the_batch_keep_their_proof_across_batch_sizes(float64):
    """Batch sizes 4, 6, 5, 8, 4 (as Poisson sampling gives) and sequence lengths that change (a multiple of the batch
    size, or equal to it, at some steps): one proof, reused at every other step; the clipped sums the oracle's."""
    torch.manual_seed(0)
    model = _Folded()
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        for step, (B, T) in enumerate([(4, 3), (6, 12), (5, 5), (8, 3), (4, 8)]):
            x, y = _data(B, step, tokens=T)
            engine.backward(_losses(model, x, y))
            optimizer.step()
            optimizer.zero_grad()
        memo = engine._rows.proofs
        assert memo.made == 1 and memo.reused == 4, (memo.made, memo.reused)
    finally:
        engine.detach()
    report = neighbour_test(_Folded(), _losses, _data(6, 9, tokens=4), mode="bk-mixopt",
                            warm_up=[_data(4, 7, tokens=4), _data(5, 8, tokens=2)])
    assert report.refused is None and report.worst <= 1 + 1e-9, report


class _TimeMajor(nn.Module):
    """Tokens time-major ([T, B, d]) folded into one axis ([T * B, d]: a sample's rows interleaved) and back."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):  # [B, T, 6]
        B, T, _ = x.shape
        folded = x.transpose(0, 1).reshape(T * B, 6)
        h = torch.tanh(self.inp(folded)).reshape(T, B, 8)
        return self.head(h.mean(0))


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_fixed_reshape_in_blocks_is_proven_again_where_it_puts_two_samples_in_a_row(float64, mode):
    torch.manual_seed(0)
    report = neighbour_test(_FixedRows("centre", rows=8), _losses, _data(16, 0), mode=mode, max_grad_norm=1.0,
                            warm_up=[_data(4, 1), _data(4, 2)])  # (B = 4: blocks of two rows, proven)
    assert report.refused is not None, f"{mode}: {report.worst:.3f} R, not refused"


def test_interleaved_rows_keep_their_proof_across_batch_sizes(float64):
    torch.manual_seed(0)
    model = _TimeMajor()
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        for step, (B, T) in enumerate([(4, 3), (6, 2), (5, 5), (3, 4)]):
            x, y = _data(B, step, tokens=T)
            engine.backward(_losses(model, x, y))
            optimizer.step()
            optimizer.zero_grad()
        memo = engine._rows.proofs
        assert memo.made == 1 and memo.reused == 3, (memo.made, memo.reused)
    finally:
        engine.detach()
    report = neighbour_test(_TimeMajor(), _losses, _data(5, 9, tokens=3), mode="bk-mixopt",
                            warm_up=[_data(4, 7, tokens=3)])
    assert report.refused is None and report.worst <= 1 + 1e-9, report


class _SqueezedRows(nn.Module):
    """A layer's output squeezed (a size-1 sequence dropped), an op along dim -2 (the channels while T > 1, the batch at
    T = 1), then back to [B, 8, T]."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.inp, self.head = nn.Conv1d(6, 8, 1), nn.Conv1d(8, 3, 1)

    def forward(self, x):  # [B, 6, T]
        B, _, T = x.shape
        g = torch.tanh(self.inp(x)).squeeze()
        if self.op == "softmax":
            g = g.softmax(-2) * g
        elif self.op == "centre":
            g = g - g.mean(-2, keepdim=True)
        elif self.op == "cumsum":
            g = g.cumsum(-2)
        elif self.op == "sort":
            g = g.sort(-2)[0]
        else:
            g = g * 2
        return self.head(g.reshape(B, 8, T)).mean(-1)


def _sequences(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 6, T, generator=g) * 2, torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("op", ["softmax", "centre", "cumsum", "sort"])
@pytest.mark.parametrize("mode", MODES)
def test_a_proof_is_not_reused_where_a_squeeze_moves_what_a_negative_dimension_names(float64, op, mode):
    torch.manual_seed(0)
    warm = [_sequences(2, 1), _sequences(2, 2)]  # (T = 2: dim -2 is the channels, proven per sample)
    report = neighbour_test(_SqueezedRows(op), _losses, _sequences(1, 0), mode=mode, max_grad_norm=1.0, warm_up=warm)
    assert report.refused is not None, f"{op}/{mode}: {report.worst:.3f} R, not refused"


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_squeeze_that_moves_a_dimension_onto_the_batch_is_refused_at_user_level(float64, mode):
    torch.manual_seed(0)
    users = torch.tensor([0, 0, 1, 1, 2, 3])  # (a warm-up batch at user level: the batch and its users)
    report = neighbour_test(_SqueezedRows("centre"), _losses, _sequences(1, 0), mode=mode, max_grad_norm=1.0,
                            users=users, warm_up=[(_sequences(2, 1), users), (_sequences(2, 2), users)])
    assert report.refused is not None, f"{mode}: {report.worst:.3f} R, not refused"


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_squeeze_without_an_op_across_its_rows_is_exact_warm_and_cold(float64, mode):
    """The control: the same model with an element-wise op where the others mix, T = 2, 2 then 1, and T = 1 alone."""
    torch.manual_seed(0)
    for warm in ([_sequences(2, 1), _sequences(2, 2)], []):
        report = neighbour_test(_SqueezedRows("none"), _losses, _sequences(1, 0), mode=mode, max_grad_norm=1.0,
                                warm_up=warm)
        assert report.refused is None and report.worst <= 1 + 1e-9, (mode, len(warm), report.worst, report.refused)


def test_the_key_tells_a_negative_dimension_at_two_ranks_apart():
    """softmax(-2) of a [B, T, d] input and of a [B, d] one: the same node types and the same saved -2, which names T
    in one and the batch in the other. The memo's key holds the rank beside a dimension counted from the end (a
    positive one names the same axis at any rank, and stays out of it)."""
    from dptrain.rows import memo

    def key(shape, dim):
        x = torch.randn(*shape, requires_grad=True)
        out = x.softmax(dim).sum()
        return memo._structure([(out.grad_fn, 0, None)], shape[0], None)[2]

    assert key((4, 3, 5), -2) != key((4, 5), -2)
    assert key((4, 3, 5), 1) == key((4, 3, 7), 1)  # (sizes stay out of the key: a sequence length changes)
