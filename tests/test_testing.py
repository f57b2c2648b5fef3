"""dptrain.testing, the test kit: the engine run for one step (``clipped_gradient``, ``attached_engine``), the
threshold that splits the samples (``threshold_between``), the comparison with the oracle (``mismatches``,
``max_relative_error``), and ``assert_rule_exact``, which checks a rule with all of them (on test_layers.py's
``Scale`` and its rule)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import (
    assert_rule_exact,
    attached_engine,
    clipped_gradient,
    max_relative_error,
    mismatches,
    per_sample_gradients,
    reference_clipped_gradient,
    split_batch,
    threshold_between,
)
from test_layers import F64, Scale, ScaleRule

MODES = tuple(dptrain.CLIPPING_MODES)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _data(B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, generator=g, dtype=F64) * 3, torch.randint(0, 3, (B,), generator=g)


def _norms(model, batch):
    grads = per_sample_gradients(model, _losses, batch)
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))


# ---------------------------------------------------------------------------- the runner
@pytest.mark.parametrize("mode", MODES)
def test_clipped_gradient_is_the_oracles_clipped_sum_on_every_path(mode):
    model, batch = _model(), _data(7)
    R = threshold_between(model, _losses, batch)
    expected = reference_clipped_gradient(model, _losses, batch, max_grad_norm=R)
    paths = ["engine"] if dptrain.RECIPES[mode].two_pass else ["engine", "mean", "sum"]
    for path in paths:
        for micro in (1, 3):
            got = clipped_gradient(model, _losses, batch, mode=mode, max_grad_norm=R, path=path, micro_batches=micro)
            assert mismatches(got, expected, rtol=1e-10, relative_to="largest") == [], (path, micro)
    # batches given one by one are micro-batches of one step
    got = clipped_gradient(model, _losses, (batch[0][:3], batch[1][:3]), (batch[0][3:], batch[1][3:]), mode=mode,
                           max_grad_norm=R)
    assert mismatches(got, expected, rtol=1e-10, relative_to="largest") == []


def test_clipped_gradient_leaves_the_model_as_it_was():
    model, batch = _model(), _data(5)
    before = copy.deepcopy(model.state_dict())
    got = clipped_gradient(model, _losses, batch, mode="bk-mixopt", max_grad_norm=0.5)
    assert set(got) == {n for n, _ in model.named_parameters()}
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks) for m in model.modules())


def test_clipped_gradient_at_a_learning_rate_moves_the_model_by_the_step():
    model, batch = _model(), _data(1)
    before = copy.deepcopy(model)
    got = clipped_gradient(model, _losses, batch, mode="ghost", max_grad_norm=0.3, lr=1.0)
    for (name, p), q in zip(model.named_parameters(), before.parameters()):
        torch.testing.assert_close(q - p, got[name], rtol=1e-12, atol=1e-15)
    assert math.sqrt(sum(float(g.square().sum()) for g in got.values())) <= 0.3 * (1 + 1e-9)


def test_clipped_gradient_names_a_parameter_without_a_gradient_and_a_frozen_one_not_at_all():
    model, batch = _model(), _data(4)
    model[0].bias.requires_grad_(False)
    got = clipped_gradient(model, _losses, batch, mode="bk", max_grad_norm=1.0)
    assert "0.bias" not in got and set(got) == {"0.weight", "2.weight", "2.bias"}


def test_clipped_gradient_with_noise_and_a_batch_size_is_the_private_gradient():
    model, batch = _model(), _data(4)
    clean = clipped_gradient(model, _losses, batch, mode="bk-mixopt", max_grad_norm=1.0)
    averaged = clipped_gradient(model, _losses, batch, mode="bk-mixopt", max_grad_norm=1.0, batch_size=4)
    assert mismatches(averaged, {n: g / 4 for n, g in clean.items()}, rtol=1e-12) == []
    noisy = [clipped_gradient(model, _losses, batch, mode="bk-mixopt", max_grad_norm=1.0, noise_multiplier=1.0,
                              seed=s) for s in (1, 1, 2)]
    assert mismatches(noisy[0], noisy[1], rtol=0.0) == []  # seeded
    assert mismatches(noisy[0], noisy[2], rtol=0.0) != []


def test_clipped_gradient_checks_its_arguments():
    model, batch = _model(), _data(3)
    with pytest.raises(ValueError, match="path must be one of engine, mean, sum, got 'plain'"):
        clipped_gradient(model, _losses, batch, mode="bk", max_grad_norm=1.0, path="plain")
    with pytest.raises(TypeError, match="at least one batch"):
        clipped_gradient(model, _losses, mode="bk", max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="needs two backward passes"):  # the engine's own refusal comes through
        clipped_gradient(model, _losses, batch, mode="ghost", max_grad_norm=1.0, path="mean")
    assert all(p.grad is None for p in model.parameters())
    assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())  # detached


def test_attached_engine_gives_the_clipped_sum_at_the_step_and_holds_every_parameter():
    model, batch = _model(), _data(5)
    R = threshold_between(model, _losses, batch)
    model[0].requires_grad_(False)  # held by the optimizer all the same: unfrozen later (staged fine-tuning)
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=R)
    try:
        assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
        model[0].requires_grad_(True)
        engine.backward(_losses(model, *batch))
        optimizer.step()
        got = {n: p.grad for n, p in model.named_parameters()}
        assert engine.steps_taken == 1
    finally:
        engine.detach()
    assert mismatches(got, reference_clipped_gradient(model, _losses, batch, max_grad_norm=R), rtol=1e-10,
                      relative_to="largest") == []


def test_split_batch_cuts_consecutive_chunks_of_any_batch():
    x, y = torch.arange(10.0).view(5, 2), torch.arange(5)
    chunks = split_batch((x, y), 2)
    assert [tuple(c[1].tolist()) for c in chunks] == [(0, 1), (2, 3, 4)]  # round(5 / 2) = 2
    assert split_batch((x, y), 1)[0][0] is x
    (a, b, c) = split_batch({"x": x, "n": 3}, 3)
    assert [len(part["x"]) for part in (a, b, c)] == [2, 1, 2] and a["n"] == 3


# ---------------------------------------------------------------------------- the threshold
@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise", [["0"], ["2"]]])
def test_threshold_between_clips_some_samples_and_not_others_away_from_every_norm(style):
    model, batch = _model(), _data(7)
    R = threshold_between(model, _losses, batch, clipping_style=style)
    grads = per_sample_gradients(model, _losses, batch)
    groups = {"all-layer": [list(grads)], "param-wise": [[n] for n in grads]}.get(
        style if isinstance(style, str) else "", [["0.weight", "0.bias"], ["2.weight", "2.bias"]])
    norms = torch.cat([math.sqrt(len(groups)) * torch.sqrt(sum(grads[n].flatten(1).square().sum(1) for n in group))
                       for group in groups])
    assert bool((norms > R).any()) and bool((norms < R).any())
    assert float((norms / R - 1).abs().min()) > 1e-7


def test_threshold_between_takes_the_gap_nearest_the_median():
    model, batch = _model(), _data(6)
    norms = sorted(_norms(model, batch).tolist())
    R = threshold_between(model, _losses, batch)
    assert R == pytest.approx(math.sqrt(norms[2] * norms[3]), rel=1e-12)  # of 6: between the 3rd and the 4th
    model, batch = _model(), _data(5)
    norms = sorted(_norms(model, batch).tolist())
    R = threshold_between(model, _losses, batch)
    assert R == pytest.approx(math.sqrt(norms[1] * norms[2]), rel=1e-12)  # of 5: the first of two as near


def test_threshold_between_needs_two_different_norms():
    x = torch.ones(4, 4, dtype=F64)
    with pytest.raises(ValueError, match="same gradient norm"):
        threshold_between(_model(), _losses, (x, torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="same gradient norm"):
        threshold_between(_model(), _losses, _data(1))


# ---------------------------------------------------------------------------- the comparison
def test_mismatches_names_every_parameter_that_differs_and_how():
    expected = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([[0.5]]), "c": torch.zeros(3)}
    assert mismatches({k: v.clone() for k, v in expected.items()}, expected, rtol=0.0) == []
    got = {"a": torch.tensor([1.0, float("nan")]), "b": torch.zeros(1), "extra": torch.zeros(1)}
    lines = mismatches(got, expected, rtol=1e-3, what="bk")
    assert lines == [
        "bk: 'extra' is not a parameter of the oracle's",
        "bk: 'a' differs by nan at entry 1 (allowed 0.002; largest entry of the oracle's 2)",
        "bk: 'b' has shape (1,), the oracle's (1, 1)",
        "bk: 'c' got no gradient",
    ]
    assert mismatches({"a": torch.tensor([1.0, -2.0]), "b": None}, {"a": expected["a"], "b": expected["b"]},
                      rtol=0.0) == ["'b' got no gradient"]


def test_mismatches_relative_to_each_entry_or_to_the_largest():
    expected = {"big": torch.tensor([100.0]), "small": torch.tensor([1e-3])}
    got = {"big": torch.tensor([100.0]), "small": torch.tensor([1e-3 + 1e-6])}
    assert len(mismatches(got, expected, rtol=1e-4)) == 1  # 1e-3 relative to its own entry
    assert mismatches(got, expected, rtol=1e-4, relative_to="largest") == []  # 1e-8 of the largest
    assert mismatches(got, expected, rtol=0.0, atol=2e-6) == []
    zeros = {"w": torch.zeros(2, dtype=F64)}
    assert len(mismatches({"w": torch.full((2,), 1e-300, dtype=F64)}, zeros, rtol=1.0, relative_to="largest")) == 1
    with pytest.raises(ValueError, match="relative_to"):
        mismatches(got, expected, rtol=0.0, relative_to="mean")


def test_mismatches_compares_in_the_wider_dtype():
    expected = {"w": torch.tensor([1.0], dtype=torch.float32)}
    assert len(mismatches({"w": torch.tensor([1.0 + 1e-12], dtype=F64)}, expected, rtol=1e-13)) == 1
    assert mismatches({"w": torch.tensor([1.0], dtype=torch.bfloat16)}, expected, rtol=0.0) == []


def test_max_relative_error_is_relative_to_the_largest_entry():
    expected = {"a": torch.tensor([4.0, 1.0]), "b": torch.tensor([2.0])}
    rel, name = max_relative_error({"a": torch.tensor([4.0, 1.5]), "b": torch.tensor([1.0])}, expected)
    assert (rel, name) == (0.25, "b")
    assert max_relative_error({"a": torch.tensor([4.0, float("nan")]), "b": torch.tensor([2.0])}, expected)[1] == "a"
    assert max_relative_error({"z": torch.tensor([0.5])}, {"z": torch.zeros(1)}) == (0.5, "z")  # absolute at zero
    with pytest.raises(AssertionError, match="parameter names differ"):
        max_relative_error({"a": expected["a"]}, expected)


# ---------------------------------------------------------------------------- assert_rule_exact
def test_assert_rule_exact_passes_a_correct_rule_and_registers_it_only_for_the_check():
    module = Scale(4)
    x = torch.randn(5, 3, 4)  # float32: the check runs on a float64 copy
    assert dptrain.find_rule(module) is None
    assert_rule_exact(module, x, rule=ScaleRule)
    assert dptrain.find_rule(module) is None  # removed again
    assert module.weight.grad is None and module.weight.dtype == F64  # the module itself is left alone


def test_assert_rule_exact_names_every_mode_path_and_parameter_that_differ():
    class OffByOnePercent(ScaleRule):
        def per_sample_grads(self, module, ops, names):
            return {"weight": 1.01 * ops[0].sum(1)}

    with pytest.raises(AssertionError) as info:
        assert_rule_exact(Scale(4), torch.randn(5, 3, 4, dtype=F64), rule=OffByOnePercent)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("Scale: the engine's clipped gradient differs from the oracle's")
    expected = [f"{mode} through engine.backward" for mode in dptrain.CLIPPING_MODES]
    expected += [f"{mode} through loss.backward" for mode in dptrain.CLIPPING_MODES
                 if not dptrain.RECIPES[mode].two_pass]
    assert sorted(line.strip().split(":")[0] for line in lines[1:]) == sorted(expected)
    assert all("'weight' differs by" in line for line in lines[1:])


def test_assert_rule_exact_finds_a_wrong_clipped_grads_in_the_modes_that_use_it():
    class WrongClippedGrads(ScaleRule):
        def clipped_grads(self, module, ops, factors):
            return {"weight": ops[0].sum((0, 1))}  # the factors forgotten

    with pytest.raises(AssertionError) as info:
        assert_rule_exact(Scale(4), torch.randn(6, 2, 4, dtype=F64), rule=WrongClippedGrads)
    failed = {line.strip().split(" through ")[0] for line in str(info.value).splitlines()[1:]}
    # the book-keeping modes call clipped_grads; the others (and bk-mixopt, which follows an instantiated
    # norm with the weighted sum) sum per-sample gradients or back-propagate a second time
    assert failed == {"bk", "bk-mix-ghost"}


def test_assert_rule_exact_refuses_a_module_no_rule_covers():
    with pytest.raises(AssertionError, match=r"(?s)per-sample through engine.backward: the engine raised "
                                             r"ValueError.*Scale.*no layer rule"):
        assert_rule_exact(Scale(4), torch.randn(5, 3, 4))
    with pytest.warns(UserWarning, match="per-sample fallback"):  # the fallback is exact
        assert_rule_exact(Scale(4), torch.randn(5, 3, 4), allow_fallback=True, modes=["bk"])


def test_assert_rule_exact_says_when_the_rule_covers_nothing():
    class OverridingScale(Scale):
        def forward(self, x):
            return 2 * x * self.weight

    with pytest.raises(AssertionError, match="ScaleRule covers no module of OverridingScale.*override forward"):
        assert_rule_exact(OverridingScale(4), torch.randn(5, 3, 4), rule=ScaleRule)


def test_assert_rule_exact_needs_samples_with_different_norms():
    def losses(model, x):
        return model(x).sum(1)

    with pytest.raises(ValueError, match="same gradient norm"):
        assert_rule_exact(nn.Linear(3, 2), torch.ones(4, 3), losses_fn=losses)
    assert_rule_exact(nn.Linear(3, 2), torch.ones(4, 3), losses_fn=losses, max_grad_norm=0.1, modes=["ghost"])


def test_assert_rule_exact_checks_built_in_layers_and_tuple_outputs():
    g = torch.Generator().manual_seed(3)
    assert_rule_exact(nn.Embedding(7, 3, padding_idx=0), torch.randint(0, 7, (6, 4), generator=g))
    assert_rule_exact(nn.GroupNorm(2, 4), torch.randn(4, 4, 3, 3, generator=g))
    with pytest.raises(ValueError, match="no trainable parameters"):
        assert_rule_exact(nn.Sequential(), torch.randn(4, 3, generator=g))
    from dptrain.nn import DPLSTM

    assert_rule_exact(DPLSTM(3, 4, batch_first=True), torch.randn(4, 5, 3, generator=g), modes=["bk-mixopt"])
