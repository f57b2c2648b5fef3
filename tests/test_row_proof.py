"""The proofs from the autograd graph (dptrain.rows.proof) are sound: where one says a tensor's rows sit in some layout,
each sample's loss reaches exactly the rows that layout gives that sample, and no other.

Random chains of operations, some keeping rows apart (element-wise, views that fold or move the batch, reductions and
softmaxes over other axes, matrix products with a constant, broadcasting), some mixing them (a mean over the batch,
a flip, a roll or a permutation of the batch axis, a product over the batch axis, a product of two samples' rows). Whatever the prover claims is
checked against the Jacobian computed one loss at a time; a chain that mixes samples is never proven.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dptrain.rows.proof import Rows, prove

B, T, D = 3, 4, 5


def _apply(op: str, h: torch.Tensor, axis: int, weight: torch.Tensor):
    """(h after op, where the batch sits now, whether the op may have mixed the samples)."""
    if op == "tanh":
        return torch.tanh(h), axis, False
    if op == "scale":
        return h * 1.5 + 0.25, axis, False
    if op == "broadcast-add" and h.dim() >= 2 and h.shape[-1] <= D:
        return h + weight[0, : h.shape[-1]], axis, False
    if op == "transpose-last" and h.dim() >= 3:
        return h.transpose(-1, -2), axis if axis < h.dim() - 2 else (h.dim() - 1 if axis == h.dim() - 2 else h.dim() - 2), False
    if op == "move-batch" and h.dim() >= 2 and axis == 0:
        return h.transpose(0, 1), 1, False
    if op == "fold" and h.dim() == 3 and axis == 0:
        return h.reshape(h.shape[0] * h.shape[1], h.shape[2]), 0, False
    if op == "index-positions" and h.dim() >= 2 and axis != h.dim() - 1:  # picks within each sample, any index
        return h.index_select(-1, torch.tensor([2, 0, 0, 1])[: h.shape[-1]] % h.shape[-1]), axis, False
    if op == "mask-positions" and h.dim() == 3 and axis == 0:  # a boolean mask over the positions
        return h[:, torch.arange(h.shape[1]) % 2 == 0], axis, False
    if op == "index-batch" and axis == 0:  # rows picked by an index: mixes
        return h[torch.tensor([1, 0, 2])[: h.shape[0]] % h.shape[0]], axis, True
    if op == "attention" and h.dim() == 3 and axis == 0:  # fused attention within each sample
        q = h.unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q).squeeze(1), axis, False
    if op == "attention-over-batch" and h.dim() == 3 and axis == 0:  # queries meet every sample's keys: mixes
        q = h.transpose(0, 1).unsqueeze(0)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).squeeze(0).transpose(0, 1), axis, True
    if op == "bmm-rows" and h.dim() == 3 and axis == 1:  # the rows of a batched product's left factor
        return torch.bmm(h, weight[: h.shape[-1], :4].expand(h.shape[0], -1, -1)), axis, False
    if op == "rms-norm-last":  # Llama's RMSNorm: a mean over the last axis, kept and broadcast (saved as -1)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), axis, axis == h.dim() - 1
    if op == "softmax-last":
        return torch.softmax(h, -1) if axis != h.dim() - 1 else h, axis, False
    if op == "sum-last" and h.dim() >= 2 and axis != h.dim() - 1:
        return h.sum(-1), axis, False
    if op == "matmul-constant" and h.shape[-1] <= D and axis == h.dim() - 1:  # over the batch axis itself: mixes
        return h @ weight[: h.shape[-1], : h.shape[-1]], axis, True
    if op == "matmul-constant" and h.shape[-1] <= D:
        return h @ weight[: h.shape[-1], :4], axis, False
    # the ones that mix the samples: the batch is lost
    if op == "mean-over-batch":
        return h - h.mean(axis, keepdim=True), axis, True
    if op == "flip-batch":
        return h.flip(axis), axis, True
    if op == "roll-batch":
        return h.roll(1, axis), axis, True
    if op == "permute-batch":
        return h.index_select(axis, torch.tensor(list(range(h.shape[axis]))[::-1])), axis, True
    if op == "outer" and h.dim() == 2 and axis == 0:
        return h @ h.T, axis, True
    return h, axis, False


OPS = ["tanh", "scale", "broadcast-add", "transpose-last", "move-batch", "fold", "rms-norm-last", "softmax-last",
       "sum-last", "index-positions", "mask-positions", "index-batch", "attention", "attention-over-batch", "bmm-rows",
       "matmul-constant", "mean-over-batch", "flip-batch", "roll-batch", "permute-batch", "outer"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=6), seed=st.integers(0, 1000))
@example(ops=["move-batch", "transpose-last", "matmul-constant"], seed=0)  # a product over the batch axis, last
def test_a_proven_layout_is_the_true_one_and_mixing_is_never_proven(ops, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(D, D, generator=g, dtype=torch.float64)
    h, axis, mixed = x, 0, False
    for op in ops:
        h, axis, mixes = _apply(op, h, axis, weight)
        if mixes:
            mixed = True
            break
    # per-sample losses: rows of the batch axis (folded rows in blocks of T), summed over everything else
    rows = h.shape[axis]
    per_row = h.movedim(axis, 0).reshape(rows, -1).square().sum(1)
    losses = per_row.reshape(B, rows // B).sum(1) if rows != B else per_row
    proof = prove([(losses.grad_fn, losses.output_nr, Rows(0))], B)
    leaf = next(((n, nr) for (n, nr) in proof.edges if getattr(n, "variable", None) is x), None)
    claimed = proof.edges.get(leaf) if leaf is not None else None
    if mixed:  # an operation on the batch axis: never proven, whatever it did
        assert not isinstance(claimed, Rows), (ops, claimed)
    if isinstance(claimed, Rows):  # (not proven is allowed: the tag passes read it)
        assert _is_per_sample(x, losses, claimed), (ops, claimed)


def _is_per_sample(x: torch.Tensor, losses: torch.Tensor, rows: Rows) -> bool:
    """Whether each loss's gradient with respect to ``x`` is non-zero only in the rows ``rows`` gives its sample."""
    owner = torch.arange(x.shape[rows.axis]) // rows.inner % B
    for i in range(B):
        (grad,) = torch.autograd.grad(losses[i], x, retain_graph=True)
        touched = grad.abs().movedim(rows.axis, 0).reshape(x.shape[rows.axis], -1).amax(1) > 0
        if bool((touched & (owner != i)).any()):
            return False
    return True


def test_a_full_sum_over_the_batch_is_never_proven():
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    losses = (x * x.sum(0)).sum(1)
    proof = prove([(losses.grad_fn, losses.output_nr, Rows(0))], B)
    leaf = next(e for e in proof.edges if getattr(e[0], "variable", None) is x)
    assert leaf in proof.unproven and not isinstance(proof.edges[leaf], Rows)


@pytest.mark.parametrize("sliced,kept", [(lambda t: t[:], True), (lambda t: t[0:B], True),
                                         (lambda t: t.narrow(0, 0, B), True), (lambda t: t[0:100], True),
                                         (lambda t: t[1:], False), (lambda t: t[:-1], False),
                                         (lambda t: t[::2], False)],
                         ids=["[:]", "[0:B]", "narrow", "[0:100]", "[1:]", "[:-1]", "[::2]"])
def test_a_slice_of_the_batch_axis_is_proven_only_where_it_keeps_every_row(sliced, kept):
    """torch 2.8's GPT-2 slices its hidden states whole along the batch axis (``x[:, ...]``): that keeps each row
    where it is. A slice that drops or skips rows leaves rows that are not the losses' own: never proven."""
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    h = sliced(x * 1.0)
    losses = h.square().sum(1)
    proof = prove([(losses.grad_fn, losses.output_nr, Rows(0))], losses.shape[0])
    leaf = next(((n, nr) for (n, nr) in proof.edges if getattr(n, "variable", None) is x), None)
    claimed = proof.edges.get(leaf) if leaf is not None else None
    assert isinstance(claimed, Rows) == kept
    if kept:
        assert claimed == Rows(0) and _is_per_sample(x, losses, claimed)


@pytest.mark.parametrize("ops", [["rms-norm-last"], ["tanh", "rms-norm-last", "softmax-last"], ["index-positions"],
                                 ["mask-positions"], ["attention"], ["move-batch", "bmm-rows"], ["fold", "tanh"],
                                 ["broadcast-add", "sum-last"]])
def test_operations_that_keep_rows_apart_are_proven(ops):
    """What the benchmarks' models do between their layers is proven, not left to tag passes at every step (a mean
    over the last axis, saved by autograd as the unsigned 2**64 - 1, once read as the batch axis)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(D, D, generator=g, dtype=torch.float64)
    h, axis = x, 0
    for op in ops:
        h, axis, mixes = _apply(op, h, axis, weight)
        assert not mixes
    rows = h.shape[axis]
    per_row = h.movedim(axis, 0).reshape(rows, -1).square().sum(1)
    losses = per_row.reshape(B, rows // B).sum(1) if rows != B else per_row
    proof = prove([(losses.grad_fn, losses.output_nr, Rows(0))], B)
    leaf = next((n, nr) for (n, nr) in proof.edges if getattr(n, "variable", None) is x)
    assert proof.edges[leaf] == Rows(0), (ops, proof.edges[leaf], proof.stopped_at)
