"""The planner (dptrain.planning): the per-layer decision of each mode (ghost norm or instantiation, and how the
clipped gradient is formed) from the shapes of each call, by space or by time, and ``plan()``, which reports the
decisions the engine makes without running a backward.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import attached_engine
from helpers import MODES, get_case, per_sample


# =========================================================================== per-layer decisions
class DecisionNet(nn.Module):
    """emb: p=16, d=50 | wide: p=d=32 | narrow: p=2, d=32 | norm: LayerNorm(2); all on T tokens."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 32)
        self.wide = nn.Linear(32, 32)
        self.narrow = nn.Linear(32, 2)
        self.norm = nn.LayerNorm(2)

    def forward(self, ids):
        h = torch.tanh(self.up(self.emb(ids)))
        return self.norm(self.narrow(torch.tanh(self.wide(h))))


# name: (p, d) of the weight as a matrix; None for the norm layer (never a ghost norm)
DECISION_SHAPES = {"emb": (16, 50), "up": (32, 16), "wide": (32, 32), "narrow": (2, 32), "norm": None}


def decision_losses(model, ids):
    B, T = ids.shape
    return F.cross_entropy(model(ids).reshape(-1, 2), (ids % 2).reshape(-1), reduction="none").reshape(B, T)


def decisions_for(mode, T, decision_rule="space", B=3):
    torch.manual_seed(0)
    model = DecisionNet()
    engine, _ = attached_engine(model, mode=mode, max_grad_norm=1.0, batch_size=4, decision_rule=decision_rule)
    ids = torch.randint(0, 50, (B, T))
    engine.backward(decision_losses(model, ids))
    engine.detach()
    return {d.name: d for d in engine.last_decisions()}, model, ids


def prefers_ghost_by_space(T, p, d):
    return 2 * T * T < p * d


def prefers_ghost_by_time(T, p, d):
    """Mixed-ghost paper, Table 1 (per sample): ghost 2T^2(d+p+1) - 1 vs instantiation 2(T+1)pd."""
    return 2 * T * T * (d + p + 1) - 1 < 2 * (T + 1) * p * d


@pytest.mark.parametrize("T", [3, 8, 30])
def test_bk_mixopt_picks_ghost_norm_iff_2T2_below_pd(T):
    decisions, _, _ = decisions_for("bk-mixopt", T)
    assert list(decisions) == list(DECISION_SHAPES)
    for name, shape in DECISION_SHAPES.items():
        dec = decisions[name]
        assert dec.T == T
        if shape is None:
            assert (dec.p, dec.d, dec.norm, dec.grad) == (2, 1, "instantiate", "weighted-sum")
            continue
        p, d = shape
        assert (dec.p, dec.d) == (p, d), name
        ghost = prefers_ghost_by_space(T, p, d)
        assert dec.norm == ("ghost" if ghost else "instantiate"), f"{name}: 2T^2={2 * T * T}, pd={p * d}"
        assert dec.grad == ("book-keeping" if ghost else "weighted-sum"), name


def test_decisions_follow_the_shapes_of_each_call():
    """T changes between batches: the same layer switches primitive (no decision cached on batch 1)."""
    torch.manual_seed(0)
    model = DecisionNet()
    engine, optimizer = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0, batch_size=4)
    seen = []
    for T in (3, 30, 3):
        ids = torch.randint(0, 50, (2, T))
        engine.backward(decision_losses(model, ids))
        seen.append(next(d.norm for d in engine.last_decisions() if d.name == "wide"))
        optimizer.step()
    assert seen == ["ghost", "instantiate", "ghost"]


EXPECTED_PRIMITIVES = {
    # mode: (norm for ghost-capable layers: "ghost" | "instantiate" | "space", gradient primitive)
    "per-sample": ("instantiate", "weighted-sum"),
    "fast-grad-clip": ("instantiate", "second-pass"),
    "ghost": ("ghost", "second-pass"),
    "mix-ghost": ("space", "second-pass"),
    "bk": ("ghost", "book-keeping"),
    "bk-mix-ghost": ("space", "book-keeping"),
    "bk-mixopt": ("space", "follow"),
}


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_reports_its_recipe(mode):
    T = 8  # 2T^2 = 128: emb, up and wide prefer the ghost norm, narrow (pd = 64) instantiation
    decisions, _, _ = decisions_for(mode, T)
    norm_rule, grad = EXPECTED_PRIMITIVES[mode]
    for name, shape in DECISION_SHAPES.items():
        dec = decisions[name]
        if shape is None:
            ghost = False
        elif norm_rule == "space":
            ghost = prefers_ghost_by_space(T, *shape)
        else:
            ghost = norm_rule == "ghost"
        assert dec.norm == ("ghost" if ghost else "instantiate"), name
        expected_grad = ("book-keeping" if ghost else "weighted-sum") if grad == "follow" else grad
        assert dec.grad == expected_grad, name


def test_time_rule_uses_the_operation_counts():
    """p = d = 32 at T = 20: the space rule picks the ghost norm (800 < 1024), the time rule does not."""
    T = 20
    space, _, _ = decisions_for("bk-mixopt", T, "space")
    time, _, _ = decisions_for("bk-mixopt", T, "time")
    assert space["wide"].norm == "ghost" and time["wide"].norm == "instantiate"
    for name, shape in DECISION_SHAPES.items():
        if shape is not None:
            expected = "ghost" if prefers_ghost_by_time(T, *shape) else "instantiate"
            assert time[name].norm == expected, name


@pytest.mark.parametrize("mode", MODES)
def test_plan_agrees_with_what_the_engine_did(mode):
    decisions, model, ids = decisions_for(mode, 8)
    planned = dptrain.plan(model, ids, clipping_mode=mode)
    decided = [d.as_dict() for d in decisions.values()]
    assert [d.pop("layout") for d in decided] == ["identity"] * len(decided)  # read by the engine's backward
    assert [p.layout for p in planned] == [None] * len(planned)  # plan() runs no backward
    assert [{k: v for k, v in p.as_dict().items() if k != "layout"} for p in planned] == decided


# =========================================================================== plan() on a small CNN
def test_plan_of_a_small_cnn_matches_hand_computation():
    model = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, 8, 3, padding=1),         # 16x16 out: T=256, p=8,  d=3*9=27
        gn=nn.GroupNorm(2, 8),                       # T=256, p=8 channels, d=1
        relu=nn.ReLU(),
        conv2=nn.Conv2d(8, 16, 3, stride=2, padding=1),  # 8x8 out: T=64, p=16, d=8*9=72
        conv3=nn.Conv2d(16, 16, 1, bias=False),      # T=64, p=16, d=16
        flat=nn.Flatten(),
        fc=nn.Linear(16 * 8 * 8, 10),                # T=1, p=10, d=1024
    ))
    plan = {d.name: d for d in dptrain.plan(model, torch.randn(2, 3, 16, 16), clipping_mode="bk-mixopt")}
    assert list(plan) == ["conv1", "gn", "conv2", "conv3", "fc"]
    expected = {  # name: (type, T, p, d, norm, grad)
        "conv1": ("Conv2d", 256, 8, 27, "instantiate", "weighted-sum"),    # 2*256^2 = 131072 > 216
        "gn": ("GroupNorm", 256, 8, 1, "instantiate", "weighted-sum"),
        "conv2": ("Conv2d", 64, 16, 72, "instantiate", "weighted-sum"),    # 8192 > 1152
        "conv3": ("Conv2d", 64, 16, 16, "instantiate", "weighted-sum"),    # 8192 > 256
        "fc": ("Linear", 1, 10, 1024, "ghost", "book-keeping"),            # 2 < 10240
    }
    for name, (typ, T, p, d, norm, grad) in expected.items():
        dec = plan[name]
        assert (dec.type, dec.T, dec.p, dec.d, dec.norm, dec.grad) == (typ, T, p, d, norm, grad), name
    assert plan["fc"].ghost_cost == 2 and plan["fc"].instantiate_cost == 10240
    assert plan["conv1"].ghost_cost == 2 * 256 * 256 and plan["conv1"].instantiate_cost == 8 * 27


def test_plan_changes_nothing_on_the_model():
    model = get_case("resnet-groupnorm").model
    before = copy.deepcopy(model.state_dict())
    flags = [p.requires_grad for p in model.parameters()]
    dptrain.plan(model, get_case("resnet-groupnorm").batch[0])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(not m._forward_hooks for m in model.modules())


# =========================================================================== plan() decides as the engine
@pytest.mark.parametrize("mode", ["bk-mixopt", "bk-mix-ghost", "mix-ghost"])
@pytest.mark.parametrize("case_name", ["called-twice-parallel", "called-twice-sequential",
                                       "called-twice-conv-embedding", "transformer"])
@pytest.mark.parametrize("decision_rule", ["memory", "space", "time"])
def test_plan_reports_the_decisions_the_engine_makes(float64, case_name, mode, decision_rule):
    case = get_case(case_name)
    planned = dptrain.plan(case.model, *case.batch[:-1], clipping_mode=mode, decision_rule=decision_rule)
    model = copy.deepcopy(case.model)
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, noise_multiplier=0.0, clipping_mode=mode,
                                   decision_rule=decision_rule)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    engine.backward(per_sample(case.losses(model)))
    assert planned == engine.last_decisions()


def test_plan_decides_a_tied_embedding_once_with_every_layers_tokens(float64):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=60, n_positions=40)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 60, (2, 30))
    planned = {d.name: d for d in dptrain.plan(model, ids, clipping_mode="bk-mixopt")}
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, noise_multiplier=0.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    logits = model(ids).logits
    engine.backward(F.cross_entropy(logits.reshape(-1, 60), ids.reshape(-1), reduction="none").view(2, -1))
    done = {d.name: d for d in engine.last_decisions()}
    assert planned == done
    # The tied weight is decided for both layers together: the LM head's and the embedding's tokens.
    assert planned["transformer.wte"].norm == planned["lm_head"].norm
