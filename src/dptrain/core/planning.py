"""Per-layer decision between the ghost norm and per-sample gradient instantiation.

Space rule (mixed-ghost paper eq. 4.1; book-keeping paper section 3.2): ghost norm iff
2T^2 < p*d. Time rule (mixed-ghost paper Table 1, one layer): ghost norm costs
2BT^2(d+p+1) - B operations, instantiation 2B(T+1)pd; pick the cheaper. Memory rule (the
default): the space rule, plus what each choice keeps alive until the clipping factors are
known — where the gradient stage follows the norm (BK-MixOpt), the ghost norm keeps the
layer's output gradient (T*p per sample) for its book-keeping, instantiation keeps the
per-sample gradient (p*d); the layer input is kept either way, as non-private autograd does.

Decisions are made per backward from the real shapes, since T changes between batches; the
engine and ``plan()`` decide through the same function, ``decide_parameter``: a module called
several times is one layer with its calls' tokens together, and a weight shared by several
layers is decided once, for all of them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .. import _checks
from ..layers.protocol import LayerDims
from .algorithms import DEFAULT_CLIPPING_MODE, RECIPES, Grad, GradVia, Norm, NormVia, Recipe
from .plan_report import Plan

DECISION_RULES = ("memory", "space", "time")
DEFAULT_DECISION_RULE = "memory"


def ghost_time(dims: LayerDims) -> int:
    return dims.blocks * (2 * dims.T * dims.T * (dims.d + dims.p + 1) - 1)


def instantiate_time(dims: LayerDims) -> int:
    return dims.blocks * 2 * (dims.T + 1) * dims.p * dims.d


def prefers_ghost(dims: LayerDims, rule: str = "space", keeps_operands: bool = False) -> bool:
    """True when the ghost norm is the better primitive for this layer call.

    ``keeps_operands``: the ghost norm's gradient stage is book-keeping while instantiation's is
    the weighted sum (BK-MixOpt), so the memory rule also counts the kept output gradient.
    """
    if not dims.ghost_supported:
        return False
    if rule == "memory" and keeps_operands:
        return dims.ghost_cost + dims.T * dims.p * dims.blocks < dims.instantiate_cost
    if rule in ("space", "memory"):
        return dims.ghost_cost < dims.instantiate_cost
    if rule == "time":
        return ghost_time(dims) < instantiate_time(dims)
    raise _checks.unknown("decision_rule", rule, DECISION_RULES)


@dataclass(frozen=True)
class LayerDecision:
    """What the engine did for one layer in the last backward."""

    name: str
    type: str
    T: int
    p: int
    d: int
    ghost_cost: int
    instantiate_cost: int
    norm: Norm  # ghost, instantiate, or fallback (instantiated by replaying the call, torch.func)
    grad: Grad  # book-keeping, weighted-sum or second-pass
    #: how the layer's rows mapped to samples in the last backward: identity, a regrouped layout (tokens folded
    #: in blocks or interleaved, transposed, rows picked by the data), per user; None in plan(), which runs no
    #: backward (layouts are read from the gradient, at the first backward). An observation, not part of the
    #: decision: plan() and the engine compare equal without it
    layout: str | None = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> dict:
        """The decision as a plain dict of its fields (JSON-able)."""
        return asdict(self)


@functools.lru_cache(maxsize=4096)  # (a pure function of frozen values, asked for every parameter of every backward)
def decide(recipe: Recipe, dims: LayerDims, decision_rule: str, weight_trainable: bool) -> tuple[Norm, Grad]:
    """(norm primitive, gradient primitive) a recipe uses for one layer call.

    The ghost norm applies to the weight; biases and norm layers are always instantiated
    (their per-sample gradients are as small as the norm computation itself).
    """
    keeps = recipe.grad is GradVia.FOLLOW_NORM
    ghost = weight_trainable and dims.ghost_supported and (
        recipe.norm is NormVia.GHOST or (recipe.norm is NormVia.MIXED and prefers_ghost(dims, decision_rule, keeps))
    )
    if recipe.grad is GradVia.SECOND_PASS:
        grad = Grad.SECOND_PASS
    elif recipe.grad is GradVia.WEIGHTED_SUM or (recipe.grad is GradVia.FOLLOW_NORM and not ghost):
        grad = Grad.WEIGHTED_SUM
    else:
        grad = Grad.BOOK_KEEPING
    return (Norm.GHOST if ghost else Norm.FALLBACK if dims.fallback else Norm.INSTANTIATE), grad


def join_dims(dims: list[LayerDims]) -> LayerDims:
    """The sizes of several calls of one module taken as one call with all their tokens."""
    return dims[0] if len(dims) == 1 else dataclasses.replace(dims[0], T=sum(d.T for d in dims))


def decide_parameter(recipe: Recipe, decision_rule: str, parts: list[tuple[str, LayerDims, bool]],
                     shape: tuple[int, ...]) -> tuple[LayerDims, Norm, Grad]:
    """(sizes, norm primitive, gradient primitive) for one parameter in one backward.

    ``parts``: for every layer that uses the parameter, (its name for the parameter, its calls'
    joined sizes, whether its rule can factor the weight's per-sample gradient). A parameter of
    one layer is decided on that layer's sizes; a weight shared by several layers (tied
    embeddings) on the whole weight, with every layer's tokens, and its ghost norm needs every
    layer to factor it.
    """
    if len(parts) == 1:
        name, dims, _ = parts[0]
        ghost_ok = name == "weight" and dims.ghost_supported
    else:
        dims = LayerDims(T=sum(d.T for _, d, _ in parts), p=shape[0], d=math.prod(shape[1:]))
        ghost_ok = all(n == "weight" and factorable for n, _, factorable in parts)
    norm, grad = decide(recipe, dims, decision_rule, ghost_ok)
    return dims, norm, grad


def fallback_costs(decisions: list[LayerDecision]) -> dict[str, int]:
    """{layer: numbers stored per sample} for the layers the per-sample fallback covers. The fallback has no
    ghost norm: in every mode it instantiates the per-sample gradient of the module's own parameters, B times
    their size for a batch of B, on top of what the mode itself stores."""
    return {d.name: d.instantiate_cost for d in decisions if d.norm == Norm.FALLBACK}


def plan(model: nn.Module, *example_args, clipping_mode: str = DEFAULT_CLIPPING_MODE,
         decision_rule: str = DEFAULT_DECISION_RULE, allow_fallback: bool = True, batch_first: bool = True,
         **example_kwargs) -> Plan:
    """What ``clipping_mode`` would do per trainable layer for inputs shaped like the example.

    Runs one forward pass without gradients through the engine's own capture (a dry run: every
    call's sizes, nothing switched or hooked for a backward) and decides as the engine does
    (``decide_parameter``): a module called several times is one layer, its calls' tokens
    together. Nothing on the model is changed.

    Returns a :class:`~dptrain.core.plan_report.Plan`: the list of :class:`LayerDecision` in call order, whose
    ``str()`` is the table ``dptrain plan`` prints (``print(dptrain.plan(model, x))``) and ``report()`` its data.
    """
    _checks.choice("clipping_mode", clipping_mode, tuple(RECIPES))
    _checks.choice("decision_rule", decision_rule, DECISION_RULES)
    recipe = RECIPES[clipping_mode]
    # the engine's own layer set and capture (they import this module's neighbours)
    from .capture import Capture
    from .trainable import layer_states, parameter_users

    states = layer_states(model, allow_fallback, batch_first)
    capture = Capture(model, None, on_model_call=lambda: None, on_output_grad=lambda: None,
                      batch_first=batch_first, dry=True)
    capture.install(states)
    try:
        with torch.no_grad():
            model(*example_args, **example_kwargs)
        called = list(capture.called)
        joined = {id(s): join_dims([c.dims for c in s.calls]) for s in called}
    finally:
        capture.remove()
    chosen: dict[int, tuple[LayerDecision, bool]] = {}  # per layer: its decision, whether it has a ghost norm
    for p, uses in parameter_users(called).items():
        parts = [(name, joined[id(s)], s.rule.factorable(s.module)) for s, name in uses]
        _, norm, grad = decide_parameter(recipe, decision_rule, parts, tuple(p.shape))
        # the ghost recipe takes the ghost norm wherever there is one: whether this layer has one at all
        ghost_available = decide_parameter(RECIPES["ghost"], decision_rule, parts, tuple(p.shape))[1] == Norm.GHOST
        for s, name in uses:  # a layer is described by its weight's decision (or its first parameter's)
            if name != "weight" and ("weight" in s.params or id(s) in chosen):
                continue
            d = joined[id(s)]
            chosen[id(s)] = (LayerDecision(s.name, type(s.module).__name__, d.T, d.p, d.d * d.blocks, d.ghost_cost,
                                           d.instantiate_cost, norm, grad), ghost_available)
    planned = [s for s in called if id(s) in chosen]
    title = f"{type(model).__name__}, {describe_inputs(example_args, example_kwargs)}"
    return Plan([chosen[id(s)][0] for s in planned], ghost_available=[chosen[id(s)][1] for s in planned],
                parameters=[list(s.params) for s in planned], clipping_mode=clipping_mode,
                decision_rule=decision_rule, title=title)


def describe_inputs(args: tuple, kwargs: dict) -> str:
    """``input [1, 3, 8, 8]`` or ``input_ids [1, 128], attention_mask [1, 128]``: the example's tensors' shapes."""
    named = [("input", a) for a in args] + list(kwargs.items())
    shapes = [f"{name} {list(value.shape)}" for name, value in named if isinstance(value, torch.Tensor)]
    return ", ".join(shapes) or "no tensor input"
