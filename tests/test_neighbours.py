"""dptrain.testing.neighbour_test, DP's own definition as a test of one's own step: its default R (one that clips
every sample, one that clips some, one that clips none, from the batch's own per-sample norms) and its default of
removing every sample catch the detached couplings that hide at any single R (a softmax re-weighting, a top-k
selection), and an honest per-sample loss passes at each of them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import assert_neighbours_bounded, neighbour_test, per_sample_gradients
from dptrain.testing.neighbours import CLIPS_EVERY, CLIPS_NONE, CLIPS_SOME

B = 16


def _model_and_batch(seed: int, size: int = B):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return model, (torch.randn(size, 6, dtype=torch.float64), torch.randint(0, 3, (size,)))


def honest(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def softmax_weighted(model, x, y):
    """Each loss weighted by a softmax over the batch's losses, detached: no gradient shows the coupling."""
    losses = honest(model, x, y)
    return losses * torch.softmax(losses, 0).detach()


def top_k(model, x, y):
    """Hard-example mining: only the 4 largest losses of the batch train, chosen by a detached score."""
    losses = honest(model, x, y)
    keep = torch.zeros_like(losses)
    keep[losses.detach().topk(4).indices] = 1.0
    return losses * keep


def _at(report, label: str) -> float:
    (R,) = [R for R, what in report.thresholds.items() if what == label]
    return R


@pytest.mark.parametrize("seed", [0, 1])
def test_the_default_catches_a_detached_softmax_reweighting_on_a_batch_of_16(float64, seed):
    model, batch = _model_and_batch(seed)
    report = neighbour_test(model, softmax_weighted, batch)
    assert report.worst > 1.05, report
    # where every sample is clipped, the clipping undoes any positive weight: that R alone would pass it
    every = report.distances[_at(report, CLIPS_EVERY)]
    assert len(every) == B and all(d == pytest.approx(1.0, rel=1e-9) for d in every.values()), report
    R, _, _ = report.worst_case
    assert report.thresholds[R] == CLIPS_SOME
    with pytest.raises(AssertionError, match=rf"more than 1\) at R=.* \({CLIPS_SOME}\)"):
        assert_neighbours_bounded(model, softmax_weighted, batch)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_default_catches_a_detached_top_k_selection_on_a_batch_of_16(float64, seed):
    model, batch = _model_and_batch(seed)
    report = neighbour_test(model, top_k, batch)
    assert report.worst > 1.05, report
    with pytest.raises(AssertionError, match="removing sample"):
        assert_neighbours_bounded(model, top_k, batch)


def test_an_honest_loss_passes_at_each_default_r_and_each_r_clips_what_it_says(float64):
    model, batch = _model_and_batch(0)
    report = assert_neighbours_bounded(model, honest, batch, rtol=1e-9)
    assert list(report.thresholds.values()) == [CLIPS_EVERY, CLIPS_SOME, CLIPS_NONE]
    grads = per_sample_gradients(model, honest, batch)  # (the oracle: one sample at a time)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    every, some, none = report.thresholds
    assert every < float(norms.min()) and float(norms.max()) < none
    assert bool((norms < some).any()) and bool((norms > some).any())
    for R in report.thresholds:
        assert sorted(report.distances[R]) == list(range(B)), "every sample is removed by default"
    # clipped, each sample moves the sum by exactly R; unclipped, by its own norm
    assert all(d == pytest.approx(1.0, rel=1e-9) for d in report.distances[every].values())
    for k, d in report.distances[none].items():
        assert d == pytest.approx(float(norms[k]) / none, rel=1e-9)
    for k, d in report.distances[some].items():
        assert d == pytest.approx(min(1.0, float(norms[k]) / some), rel=1e-9)
    text = str(report)
    assert all(f"R={R:.4g} ({what})" in text for R, what in report.thresholds.items()), text


def test_users_are_removed_whole_at_rs_chosen_from_their_summed_gradients(float64):
    model, batch = _model_and_batch(2, size=8)
    users = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    report = assert_neighbours_bounded(model, honest, batch, users=users, rtol=1e-9)
    grads = per_sample_gradients(model, honest, batch)
    summed = {n: torch.stack([g[users == u].sum(0) for u in range(4)]) for n, g in grads.items()}
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in summed.values()))
    assert _at(report, CLIPS_EVERY) < float(norms.min()) and float(norms.max()) < _at(report, CLIPS_NONE)
    assert sorted(report.distances[_at(report, CLIPS_EVERY)]) == [0, 1, 2, 3]
    assert all(d == pytest.approx(1.0, rel=1e-9) for d in report.distances[_at(report, CLIPS_EVERY)].values())


def test_a_given_r_is_the_only_one_tested(float64):
    model, batch = _model_and_batch(0, size=4)
    report = neighbour_test(model, honest, batch, max_grad_norm=0.5, remove=[1])
    assert report.thresholds == {0.5: "given"} and list(report.distances[0.5]) == [1]
    report = neighbour_test(model, honest, batch, max_grad_norm=(1e-3, 1e3), remove=[1])
    assert list(report.thresholds) == [1e-3, 1e3]
    assert report.distances[1e-3][1] == pytest.approx(1.0, rel=1e-9)


def test_losses_without_gradient_leave_no_r_to_choose(float64):
    model, batch = _model_and_batch(0, size=4)
    with pytest.raises(ValueError, match="every sample's gradient is zero"):
        neighbour_test(model, lambda m, x, y: honest(m, x, y) * 0, batch)
    with pytest.raises(ValueError, match=r"one loss per sample, \[4\]"):
        neighbour_test(model, lambda m, x, y: honest(m, x, y).mean(), batch)


class _WithDropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.inp, self.drop, self.head = nn.Linear(6, 8), nn.Dropout(p), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.inp(x))))


def test_losses_that_draw_random_numbers_are_refused_naming_the_draws(float64):
    """Dropout shifts the other samples' masks when one is removed (an honest network read 1.3 R at p = 0.1): the test
    refuses it, naming dropout; at p = 0 the same network is tested, and within R."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))

    def losses(m, x, y):
        return F.cross_entropy(m(x), y, reduction="none")

    with pytest.raises(ValueError, match="dropout"):
        neighbour_test(_WithDropout(0.1).double(), losses, (x, y), max_grad_norm=1.0)
    report = neighbour_test(_WithDropout(0.0).double(), losses, (x, y), max_grad_norm=1.0)
    assert report.refused is None and 0 < report.worst <= 1 + 1e-9, report
    drawn = neighbour_test(_WithDropout(0.5).double(), losses, (x, y), max_grad_norm=0.01, allow_random_draws=True)
    assert drawn.worst > 1.01, drawn  # (what the refusal spares: the draws, read as a distance)


class _Checkpointed(nn.Module):
    """A block under reentrant activation checkpointing, which ``torch.autograd.grad`` cannot go through."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        return self.head(checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True))


def test_the_default_rs_are_read_through_reentrant_checkpointing(float64):
    """The default R were read with ``torch.autograd.grad``, which reentrant checkpointing refuses: the test failed
    on such a model before running any step (an outside probe). Read with ``backward()``, they clip what they say."""
    torch.manual_seed(0)
    model = _Checkpointed().double()
    batch = (torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,)))
    report = neighbour_test(model, honest, batch)
    assert list(report.thresholds.values()) == [CLIPS_EVERY, CLIPS_SOME, CLIPS_NONE]
    grads = per_sample_gradients(model, honest, batch)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    every, _, none = report.thresholds
    assert every < float(norms.min()) and float(norms.max()) < none
    assert report.refused is None and report.worst <= 1.0 + 1e-9, report
    assert all(p.grad is None for p in model.parameters()), "the model is never changed"
