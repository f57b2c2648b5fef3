"""Three ways the graph's proof took a mixing step for a per-sample one (an outside probe, every mode, silent):

- ``F.pad`` reaches the batch's axis where its pairs are as many as the dimensions: ``F.pad(h, (0, 0, 1, -1))`` of
  ``[B, d]`` shifts every sample onto the next, its shape kept. Constant padding had the rule of a convolution
  ("nothing mixes the first axis"): 1.7 R, cold and warm. Its pairs are now read.
- A rank that changes under broadcasting: ``g [B, 1, D]`` expanded to ``[B, B, D]`` keeps each row one sample,
  ``g [B, D]`` puts every sample in each row, with the same node types. The memo's key held no ranks but at views: the
  proof made on the first was reused on the second, 1.2-1.4 R, warm only. A broadcasting node's ranks are now in it.
- A user's ``torch.autograd.Function`` named like a torch operation (``Clone``, ``Expand``, ``Mm``) took that
  operation's rule, its rows proven apart whatever it did: 2.6 R. Named ``Gather`` or ``Index``, the walk failed on an
  attribute the Function does not have (an ``AttributeError`` naming neither). A user's Function now has no rule: its
  rows are read by tag passes, as any unknown node's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import attached_engine, neighbour_test
from helpers import MODES

B = 6


def _data(seed: int, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, *shape, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (B,), generator=g)


def _losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


def _check(model, batch, mode, warm_up, mixes: bool):
    report = neighbour_test(model, _losses, batch, mode=mode, max_grad_norm=[0.05, 1.0], warm_up=warm_up)
    if mixes:
        assert report.refused is not None and "several samples" in report.refused, report
    else:
        assert report.refused is None, report
    assert report.worst <= 1.0 + 1e-9, report


class _Padded(nn.Module):
    """A layer, then its output plus its output padded by ``pad``; tokens ``[B, T, d]`` or rows ``[B, d]``."""

    def __init__(self, pad: tuple):
        super().__init__()
        self.pad = pad
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + F.pad(h, self.pad)
        return self.head(h if h.dim() == 2 else h.mean(1))


@pytest.mark.parametrize("start", ["cold", "warm"])
@pytest.mark.parametrize("pad,tokens,mixes", [
    ((0, 0, 1, -1), False, True),       # [B, d]: each sample gets the previous one's row
    ((0, 0, 0, 0, 1, -1), True, True),  # [B, T, d]: the same along the batch, three pairs for three dimensions
    ((0, 0, 1, -1), True, False),       # [B, T, d]: a token shift within each sample (RWKV's)
    ((1, -1), False, False),            # along the features
], ids=["rows-shifted-along-the-batch", "tokens-shifted-along-the-batch", "token-shift", "features-shifted"])
@pytest.mark.parametrize("mode", MODES)
def test_constant_padding_that_reaches_the_batch_is_refused_and_other_padding_exact(mode, pad, tokens, mixes, start):
    torch.manual_seed(0)
    model = _Padded(pad).double()
    shape = (4, 6) if tokens else (6,)
    warm_up = [_data(1, *shape), _data(2, *shape)] if start == "warm" else []
    _check(model, _data(3, *shape), mode, warm_up, mixes)


class _Expanded(nn.Module):
    """``g = LayerNorm(x)`` expanded to ``[B, B, D]``, the mean over the second axis: per sample for ``x [B, 1, D]``,
    every sample's mean for ``x [B, D]`` (broadcasting aligns ``g`` from the right)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.norm, self.head = nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        g = self.norm(x)
        n = x.shape[0]
        if self.how == "expand":
            z = g.expand(n, n, 6)
        elif self.how == "added":
            z = g + torch.zeros(n, n, 6, dtype=g.dtype)
        else:  # (one input with a gradient: the mask, which needs none, broadcasts it)
            z = g.masked_fill(torch.zeros(n, n, 6, dtype=torch.bool), 0.0)
        return self.head(z.mean(1))


@pytest.mark.parametrize("how", ["expand", "added", "masked-fill"], ids=["expand", "added-to-a-larger-tensor",
                                                                         "masked-fill-by-a-larger-mask"])
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_changes_under_broadcasting_is_proven_again(mode, how):
    """Warm steps at ``x [B, 1, D]`` (per sample, proven and remembered), then ``x [B, D]``: refused, as cold. The
    control, warm steps and step alike at ``[B, 1, D]``, is exact."""
    torch.manual_seed(0)
    model = _Expanded(how).double()
    warm_up = [_data(1, 1, 6), _data(2, 1, 6)]
    _check(model, _data(3, 6), mode, warm_up, mixes=True)
    _check(model, _data(3, 1, 6), mode, warm_up, mixes=False)


def _function(name: str, mixes: bool):
    """An honest ``autograd.Function`` called ``name``: its backward is its forward's exact vector-Jacobian product; it
    mixes each sample with the batch's last-to-first order, or doubles each row."""

    def forward(ctx, h):
        return h + h.flip(0) if mixes else h * 2

    def backward(ctx, g):
        return g + g.flip(0) if mixes else g * 2

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


class _WithFunction(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.fn.apply(torch.tanh(self.inp(x))))


NAMES = ["Clone", "Expand", "Reshape", "Mm", "Add", "Gather", "Index", "Softmax", "Cat", "Slice", "_TagRows"]


@pytest.mark.parametrize("mixes", [True, False], ids=["mixing", "per-sample"])
@pytest.mark.parametrize("name", NAMES)
def test_a_users_function_named_like_a_torch_operation_gets_no_rule(name, mixes):
    torch.manual_seed(0)
    model = _WithFunction(_function(name, mixes)).double()
    for mode in ("bk-mixopt", "ghost"):
        _check(model, _data(3, 6), mode, [_data(1, 6)], mixes)


def test_the_proof_of_a_model_with_a_users_function_is_remembered_and_reused():
    """A Function with no rule is read by tag passes; the rest of the graph's proof is still memoised."""
    torch.manual_seed(0)
    model = _WithFunction(_function("Clone", False)).double()
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        for seed in range(3):
            x, y = _data(seed, 6)
            engine.backward(_losses(model, x, y))
            optimizer.step()
            optimizer.zero_grad()
        memo = engine._rows.proofs
        assert memo.made == 1 and memo.reused == 2, (memo.made, memo.reused)
    finally:
        engine.detach()


class _MeanThenExpanded(nn.Module):
    """A rank that changes before a mean and a slice (whose output ranks the key does not read: they follow from their
    input's) and meets the broadcast after them: ``x [B, 1, 1, D]`` gives ``g [B, 1, D]``, per sample once expanded;
    ``x [B, 1, D]`` gives ``g [B, D]``, every sample in each row."""

    def __init__(self):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        g = self.norm(x).mean(1)[..., :6]
        n = x.shape[0]
        return self.head(g.expand(n, n, 6).mean(1))


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_rank_change_carried_through_a_mean_and_a_slice_is_proven_again(mode):
    torch.manual_seed(0)
    model = _MeanThenExpanded().double()
    warm_up = [_data(1, 1, 1, 6), _data(2, 1, 1, 6)]
    _check(model, _data(3, 1, 6), mode, warm_up, mixes=True)
    _check(model, _data(3, 1, 1, 6), mode, warm_up, mixes=False)


def test_a_double_backwards_node_gets_no_rule_of_the_operation_it_differentiates():
    """A gradient penalty's graph holds nodes of the backward itself (``NativeLayerNormBackwardBackward0``): named after
    the operation they differentiate, they took its rule (a select's maps the axes the other way). They get none."""
    from dptrain.rows import rules

    x = torch.randn(3, 4, requires_grad=True)
    (g,) = torch.autograd.grad(F.layer_norm(x, (4,)).square().sum(), x, create_graph=True)
    names = set()
    stack = [g.grad_fn]
    while stack:
        node = stack.pop()
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions if n is not None)
    doubles = [n for n in names if n.count("Backward") > 1]
    assert doubles and all(rules.rule_of_name(n) is None for n in doubles), names
    assert rules.rule_of_name("NativeLayerNormBackward0") is not None
    assert rules.rule_of_name("SelectBackwardBackward0") is None


class _NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _next_token_losses(m, ids):
    """A language model's per-sequence loss; sequences of one token have no next token: ``logits[:, :-1]`` is
    empty, and the losses are 0 with a graph."""
    logits = m(ids)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_a_view_of_no_element_is_left_to_the_reading(mode):
    """A view of an empty tensor (``logits[:, :-1]`` at T = 1) has no flattened order to follow: the proof failed on a
    modulo by zero (an outside probe). It is left unproven; the step is taken, cold and after steps of T = 4, within
    the bound at every R."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 11, (4, 1), generator=g)
    warm_up = [torch.randint(0, 11, (4, 4), generator=g)]
    for start in ([], warm_up):
        report = neighbour_test(_NextToken(), _next_token_losses, batch, mode=mode, max_grad_norm=[1e-3, 1e3],
                                warm_up=start)
        assert report.refused is None, report
        assert report.worst <= 1.0 + 1e-9, report
