"""The row check is sound for every value: nothing read on one step's values is reused on another's (issue 42).

A step whose rows are read by tag passes shows only what its values show: a mixing coefficient that is zero, a mask
that keeps every row, a batch of one sample, users that happen not to meet. Every class here runs warm: ordinary
steps where the coupling is not there (exact, and bounded by DP's own neighbour test at an R that clips every sample
and at one that clips none), then the step where it is (refused, with nothing applied), then an ordinary step again
(exact). The same holds on both backward paths and in every clipping mode.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import attached_engine, neighbour_test, reference_clipped_gradient, reference_user_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, assert_matches, tag_passes_counted

PATHS = [(m, "engine") for m in MODES] + [(m, "mean") for m in SINGLE_BACKWARD_MODES]
REFUSED = r"mixes samples|couples samples|rows .*samples|several samples|reach other"


class Mixing(nn.Module):
    """Two trainable layers around an operation that mixes the batch's samples in proportion to ``coefficient``
    (0: it keeps every sample apart, by its values only; the operations are the same whatever it is)."""

    KINDS = ("mixup of the input", "mixup of features", "where over the batch", "frozen mixing weight",
             "attention across the batch", "mean over the batch")

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.weight = nn.Parameter(torch.zeros(()), requires_grad=False)  # (frozen: the engine never trains it)
        self._coefficient = 0.0

    @property
    def coefficient(self) -> float:
        return self._coefficient

    @coefficient.setter
    def coefficient(self, value: float) -> None:
        self._coefficient = value
        with torch.no_grad():  # (between steps: a forward that writes the model's state is refused)
            self.weight.fill_(value)

    def forward(self, x):
        c, B = self.coefficient, x.shape[0]
        if self.kind == "mixup of the input":
            x = (1 - c) * x + c * x.flip(0)
        h = torch.tanh(self.inp(x))
        if self.kind == "mixup of features":
            h = (1 - c) * h + c * h.flip(0)
        elif self.kind == "where over the batch":  # rows from the next sample where the mask says so
            shifted = torch.arange(B) < round(c * B)
            h = torch.where(shifted[:, None], h.roll(1, 0), h)
        elif self.kind == "frozen mixing weight":
            h = h + self.weight * h.flip(0)
        elif self.kind == "attention across the batch":  # each sample attends to itself only while c is 0
            mask = torch.eye(B, dtype=torch.bool) | (torch.rand(B, B, generator=torch.Generator().manual_seed(1)) < c)
            h = (h @ h.T).masked_fill(~mask, float("-inf")).softmax(-1) @ h
        elif self.kind == "mean over the batch":  # DeepSets
            h = h + c * h.mean(0, keepdim=True)
        return self.head(h)


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _data(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (B,), generator=g)


def _with(coefficient):
    def losses(model, x, y):
        model.coefficient = coefficient
        return _losses(model, x, y)
    return losses


def _step(engine, optimizer, model, batch, path, losses_fn=_losses):
    optimizer.zero_grad()
    losses = losses_fn(model, *batch)
    engine.backward(losses) if path == "engine" else losses.mean().backward()
    optimizer.step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode,path", PATHS)
@pytest.mark.parametrize("kind", Mixing.KINDS)
def test_a_coupling_whose_coefficient_was_zero_is_refused_when_it_starts(float64, kind, mode, path):
    torch.manual_seed(0)
    model = Mixing(kind).double()
    trained = copy.deepcopy(model)
    R = 0.3
    engine, optimizer = attached_engine(trained, mode=mode, max_grad_norm=R,
                                        loss_reduction="sum" if path == "engine" else "mean")
    try:
        for seed in range(3):  # the coupling is not there: exact
            batch = _data(4, seed)
            got = _step(engine, optimizer, trained, batch, path)
            want = reference_clipped_gradient(copy.deepcopy(model), _losses, batch, max_grad_norm=R)
            assert_matches(got, want, rtol=1e-9, what=f"{kind}, coefficient 0, step {seed}")
        trained.coefficient = 0.5
        with pytest.raises((ValueError, RuntimeError), match=REFUSED):
            _step(engine, optimizer, trained, _data(4, 10), path)
        assert engine.steps_taken == 3
        trained.coefficient = 0.0
        batch = _data(4, 11)
        got = _step(engine, optimizer, trained, batch, path)
        want = reference_clipped_gradient(copy.deepcopy(model), _losses, batch, max_grad_norm=R)
        assert_matches(got, want, rtol=1e-9, what=f"{kind}, after the refusal")
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
@pytest.mark.parametrize("kind", Mixing.KINDS)
def test_the_neighbour_bound_holds_before_and_after_the_coupling_starts(float64, kind, mode):
    """DP's own definition, warm: steps without the coupling first, then the step under test, at the neighbour test's
    three R (one that clips every sample, one that clips some, one that clips none), every sample removed. Without the
    coupling, at most R; with it, the step is refused (nothing released)."""
    torch.manual_seed(0)
    model = Mixing(kind).double()
    batch = _data(5, 3)
    warm = [_data(5, 4), _data(5, 5)]
    quiet = neighbour_test(model, _with(0.0), batch, mode=mode, warm_up=warm)
    assert quiet.refused is None and len(quiet.thresholds) == 3 and 0 < quiet.worst <= 1 + 1e-9, (kind, quiet)
    coupled = neighbour_test(model, _with(0.5), batch, mode=mode, warm_up=warm, warm_up_losses=_with(0.0))
    assert coupled.refused is not None and not any(coupled.distances.values()), (kind, coupled)


@pytest.mark.parametrize("mode,path", PATHS)
@pytest.mark.parametrize("kind", ["mixup of features", "mean over the batch", "attention across the batch"])
def test_a_first_batch_of_one_sample_proves_nothing_for_larger_ones(float64, kind, mode, path):
    """One sample cannot show mixing: a first step of one (exact: it is a per-sample step) and then a batch of four
    whose forward mixes them, refused."""
    torch.manual_seed(0)
    model = Mixing(kind).double()
    model.coefficient = 0.5
    trained = copy.deepcopy(model)
    engine, optimizer = attached_engine(trained, mode=mode, max_grad_norm=0.3,
                                        loss_reduction="sum" if path == "engine" else "mean")
    try:
        batch = _data(1, 0)
        got = _step(engine, optimizer, trained, batch, path)
        assert_matches(got, reference_clipped_gradient(copy.deepcopy(model), _losses, batch, max_grad_norm=0.3),
                       rtol=1e-9, what=f"{kind}, one sample")
        with pytest.raises((ValueError, RuntimeError), match=REFUSED):
            _step(engine, optimizer, trained, _data(4, 1), path)
        assert engine.steps_taken == 1
    finally:
        engine.detach()


# ------------------------------------------------------------------------------------------ users
def _grouped_losses(model, x, y, groups):
    """Each example's loss plus the mean loss of its group (``groups``: each example's group): examples of one group
    are coupled by the loss."""
    own = _losses(model, x, y)
    onehot = F.one_hot(torch.unique(groups, return_inverse=True)[1]).to(own.dtype)  # [B, G]
    return own + (onehot @ ((onehot.T @ own) / onehot.sum(0)))


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_user_level_losses_that_meet_within_users_then_across_them(float64, mode):
    """privacy_unit='user': a user's examples may meet in the loss. Steps whose coupled groups are the users (exact
    against the user oracle), with the users changing from step to step, then a step whose groups cross users:
    refused, nothing applied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    trained = copy.deepcopy(model)
    engine, optimizer = attached_engine(trained, mode=mode, max_grad_norm=0.3, privacy_unit="user",
                                        loss_reduction="sum")
    try:
        for seed, users in enumerate([[0, 0, 1, 1, 2], [3, 4, 4, 5, 3], [7, 7, 7, 8, 9]]):
            users = torch.tensor(users)
            batch = (*_data(5, seed), users)  # (the groups coupled by the loss are the users)
            optimizer.zero_grad()
            engine.backward(_grouped_losses(trained, *batch), users=users)
            optimizer.step()
            got = {n: p.grad.clone() for n, p in trained.named_parameters()}
            want = reference_user_clipped_gradient(copy.deepcopy(model), _grouped_losses, batch, users,
                                                   max_grad_norm=0.3)
            assert_matches(got, want, rtol=1e-9, what=f"users {users.tolist()}")
        optimizer.zero_grad()
        with pytest.raises((ValueError, RuntimeError), match="each user.s loss|other users"):
            groups = torch.tensor([0, 0, 0, 1, 1])  # crosses the users [0, 0, 1, 1, 2]
            engine.backward(_grouped_losses(trained, *_data(5, 9), groups), users=torch.tensor([0, 0, 1, 1, 2]))
        assert engine.steps_taken == 3
    finally:
        engine.detach()


# ------------------------------------------------------------------------------------------ inputs in containers
@dataclasses.dataclass
class Features:
    x: torch.Tensor
    scale: float = 1.0


Pair = collections.namedtuple("Pair", ["x", "extra"])


class BatchEncodingLike(UserDict):
    """A mapping that is not a dict, as a tokenizer's ``BatchEncoding`` (a ``UserDict``)."""


def _wrap(kind: str, x: torch.Tensor):
    return {"dict": lambda: {"x": x}, "UserDict": lambda: BatchEncodingLike(x=x),
            "dataclass": lambda: Features(x), "namedtuple": lambda: Pair(x, None),
            "nested": lambda: [{"inputs": BatchEncodingLike(features=Features(x))}]}[kind]()


def _unwrap(kind: str, inputs) -> torch.Tensor:
    return {"dict": lambda: inputs["x"], "UserDict": lambda: inputs["x"], "dataclass": lambda: inputs.x,
            "namedtuple": lambda: inputs.x, "nested": lambda: inputs[0]["inputs"]["features"].x}[kind]()


class FrozenPartFirst(nn.Module):
    """A frozen layer on the input (taken out of a container), a statistic over the batch when ``impute`` (missing
    values filled with the batch's mean), then the trainable layers."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.impute = False

    def forward(self, inputs):
        x = self.frozen(_unwrap(self.kind, inputs))
        if self.impute:
            x = torch.where(x > 0, x.mean(0, keepdim=True), x)
        return self.head(torch.tanh(self.inp(x)))


def _container_losses(kind):
    def losses(model, x, y):
        return F.cross_entropy(model(_wrap(kind, x)), y, reduction="none")
    return losses


@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("ghost", "engine"), ("bk-mixopt", "mean")])
@pytest.mark.parametrize("kind", ["dict", "UserDict", "dataclass", "namedtuple", "nested"])
def test_inputs_in_any_container_are_followed_into_the_frozen_part(float64, kind, mode, path):
    """Exact while the frozen part keeps samples apart; refused once it imputes from a batch statistic; exact again."""
    torch.manual_seed(0)
    model = FrozenPartFirst(kind).double()
    trained = copy.deepcopy(model)
    losses_fn = _container_losses(kind)
    engine, optimizer = attached_engine(trained, mode=mode, max_grad_norm=0.3,
                                        loss_reduction="sum" if path == "engine" else "mean")
    try:
        for seed in range(2):
            batch = _data(4, seed)
            got = _step(engine, optimizer, trained, batch, path, losses_fn)
            want = reference_clipped_gradient(copy.deepcopy(model), losses_fn, batch, max_grad_norm=0.3)
            assert_matches(got, want, rtol=1e-9, what=f"{kind} step {seed}")
        trained.impute = True
        with pytest.raises((ValueError, RuntimeError), match=r"mixes samples before its trainable layers"):
            _step(engine, optimizer, trained, _data(4, 5), path, losses_fn)
        trained.impute = False
        batch = _data(4, 6)
        got = _step(engine, optimizer, trained, batch, path, losses_fn)
        want = reference_clipped_gradient(copy.deepcopy(model), losses_fn, batch, max_grad_norm=0.3)
        assert_matches(got, want, rtol=1e-9, what=f"{kind} after the refusal")
    finally:
        engine.detach()


def test_the_callers_containers_are_left_as_they_were(float64):
    """The input's copy that carries its rows goes into a new container: the caller's objects are not modified."""
    torch.manual_seed(0)
    model = FrozenPartFirst("nested").double()
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=0.3)
    try:
        x, y = _data(4, 0)
        inputs = _wrap("nested", x)
        F.cross_entropy(model(inputs), y, reduction="none")
        assert _unwrap("nested", inputs) is x
    finally:
        engine.detach()


# ------------------------------------------------------------------------------------------ what a step costs
def test_a_model_the_graph_proves_runs_no_tag_pass_and_proves_from_the_memo(float64):
    """A model whose operations all keep rows apart: no step runs a tag pass, and after the first step of each
    structure (a batch of one sample is another one: every size 1 is then the batch's) its proof comes from the
    memo."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=0.3)
    try:
        with tag_passes_counted() as passes:
            for B in [3, 5, 4, 1, 6]:
                optimizer.zero_grad()
                x, y = _data(B, B)
                engine.backward(F.cross_entropy(model(x), y, reduction="none"))
                optimizer.step()
        memo = engine._rows.proofs
    finally:
        engine.detach()
    assert not passes
    assert memo.made == 2 and memo.reused == 3, (memo.made, memo.reused)


# ------------------------------------------------------------------------------------------ torch.compile
class CompiledFunction(torch.autograd.Function):
    """Stands for a region compiled by inductor with donated buffers (its node is named as torch names theirs): opaque
    to the proof (no rule), and its backward refuses to run with the graph retained, with torch's own message, as
    torch's does: the first backward through it that the engine runs is a tag pass, which retains the graph."""

    @staticmethod
    def forward(ctx, h):
        return torch.tanh(h)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "This backward function was compiled with non-empty donated buffers which requires create_graph=False "
            "and retain_graph=False. Please keep backward(create_graph=False, retain_graph=False) across all "
            "backward() function calls, or set torch._functorch.config.donated_buffer=False to disable donated "
            "buffer.")


class _CompiledMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(CompiledFunction.apply(self.inp(x)))


@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk-mixopt", "mean"), ("ghost", "engine")])
def test_a_compiled_region_that_cannot_run_backward_twice_is_refused_naming_the_setting(float64, mode, path):
    """A region the proof cannot see into is read by tag passes, each a backward: with inductor's donated buffers that
    fails inside torch. The refusal names the setting to change, and nothing is applied."""
    torch.manual_seed(0)
    model = _CompiledMiddle().double()
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=0.3,
                                        loss_reduction="sum" if path == "engine" else "mean")
    try:
        with pytest.raises(RuntimeError, match=r"donated_buffer = False.*Nothing of this backward was accumulated"):
            _step(engine, optimizer, model, _data(4, 0), path)
        assert engine.steps_taken == 0
    finally:
        engine.detach()
