"""Refusals that lead to the fix: what a user who took a common wrong turn reads. A model's own scalar loss given to
engine.backward, the same loss expanded to [B], a model with many BatchNorms, an optimizer built before
dptrain.fix(model)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.models.validation import find_problems, grouped_problems
from dptrain.rows import RowsMixSamples

B = 4


def _attached(model):
    engine = dptrain.PrivacyEngine(model, batch_size=B, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    return engine


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


# ------------------------------------------------------------------ one scalar given where per-sample losses go
def test_a_models_own_labels_loss_given_to_engine_backward_points_to_per_sample_losses():
    model = _gpt2()
    engine = _attached(model)
    ids = torch.randint(0, 40, (B, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError) as refusal:
        engine.backward(model(input_ids=ids, labels=ids).loss)
    message = str(refusal.value)
    assert "got a scalar" in message and "labels=" in message
    assert "reduction='none'" in message and "dptrain.losses.sequence_losses(logits, labels, shift=True)" in message
    assert "loss.backward()" not in message  # (the path that refuses a model's own labels= loss)
    assert engine.steps_taken == 0


def test_something_else_than_a_tensor_is_named():
    engine = _attached(_mlp())
    with pytest.raises(ValueError, match=r"shape \[B\], one per sample; got list"):
        engine.backward([1.0, 2.0])


def test_a_models_own_labels_loss_expanded_to_the_batch_is_refused_as_one_scalar():
    model = _gpt2()
    engine = _attached(model)
    ids = torch.randint(0, 40, (B, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RowsMixSamples) as refusal:
        engine.backward(model(input_ids=ids, labels=ids).loss.expand(B))
    message = str(refusal.value)
    assert message.startswith(f"the loss couples samples: the losses are one scalar expanded to [{B}] "
                              "(ExpandBackward0 of NllLossBackward0)"), message
    assert "the mean over the batch's tokens" in message and "reduction='none'" in message
    assert "sequence_losses" in message and "may mix rows" not in message


@pytest.mark.parametrize("spread,names", [
    (lambda loss: loss.expand(B), "ExpandBackward0 of MeanBackward0"),
    (lambda loss: loss * torch.ones(B), "MulBackward0 of MeanBackward0"),
    (lambda loss: loss.reshape(1).repeat(B), "RepeatBackward0 of MeanBackward0"),
], ids=["expand", "times ones", "repeat"])
def test_a_mean_over_the_batch_spread_to_b_losses_is_named_whatever_spreads_it(spread, names):
    model = _mlp()
    engine = _attached(model)
    x, y = _data()
    expected = rf"one scalar expanded to \[{B}\] \({names}\): a mean over the whole batch"
    with pytest.raises(RowsMixSamples, match=expected):
        engine.backward(spread(F.cross_entropy(model(x), y, reduction="none").mean()))


def test_a_loss_coupled_another_way_keeps_its_own_refusal():
    model = _mlp()
    engine = _attached(model)
    x, y = _data()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(RowsMixSamples) as refusal:
        engine.backward(losses * losses.mean())  # a statistic over the batch: per-sample rows, coupled
    assert str(refusal.value).startswith("the loss couples samples: in ") and "one scalar" not in str(refusal.value)


# ------------------------------------------------------------------ many modules with the same problem
class ManyNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)) for _ in range(5)])
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4))

    def forward(self, x):
        return self.head(self.blocks(x))


def test_modules_with_the_same_problem_are_listed_on_one_line():
    model = ManyNorms()
    assert len(find_problems(model)) == 6  # (the programmatic list keeps one entry per module)
    lines = grouped_problems(model)
    assert len(lines) == 2, lines
    assert lines[0].startswith("5 BatchNorm2d modules ('blocks.0.1', 'blocks.1.1', 'blocks.2.1' and 2 more): each "
                               "normalises with statistics of the whole batch"), lines[0]
    assert "dptrain.fix(model)" in lines[0]
    assert lines[1].startswith("the submodule 'head.2' (BatchNorm1d) normalises"), lines[1]
    for refuse in (lambda: dptrain.validate(model), lambda: _attached(model)):
        with pytest.raises(ValueError) as refusal:
            refuse()
        assert str(refusal.value).splitlines()[1:] == [f"- {line}" for line in lines]


def test_a_group_of_exactly_the_shown_paths_says_no_more():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    assert grouped_problems(model) == [
        f"2 BatchNorm1d modules ('1', '2'): each {find_problems(model)[0].split(') ', 1)[1]}"]


# ------------------------------------------------------------------ an optimizer built before dptrain.fix
def test_an_optimizer_built_before_fix_is_told_that_fix_returns_a_copy():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fixed = dptrain.fix(model)
    engine = dptrain.PrivacyEngine(fixed, batch_size=B, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    with pytest.raises(ValueError) as refusal:
        engine.attach(optimizer)
    message = str(refusal.value)
    assert message.startswith("the optimizer holds 6 of its 6 parameters that are not in the model given to the "
                              "engine"), message
    assert "dptrain.fix(model) returns a copy" in message and "model = dptrain.fix(model)" in message
    engine.attach(torch.optim.SGD(fixed.parameters(), lr=0.1))  # the fix it names works
    engine.detach()


def test_a_reentrant_recomputation_that_differs_from_the_forward_is_named_in_the_refusal():
    """Dropout with preserve_rng_state=False under reentrant checkpointing: each recomputation draws another mask, so
    the tag passes read rows as mixed; the refusal says that a recomputation that differs reads so (an outside probe
    found it named only mixups and tables)."""
    from torch.utils.checkpoint import checkpoint

    from dptrain.testing import attached_engine

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def block(self, h):
            return F.dropout(torch.tanh(self.mid(h)), 0.3, training=True)

        def forward(self, x):
            return self.head(checkpoint(self.block, self.inp(x), use_reentrant=True, preserve_rng_state=False))

    torch.manual_seed(0)
    model = Net()
    engine, _ = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        with pytest.raises(ValueError, match="recomputation that differs from the forward"):
            engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    finally:
        engine.detach()
