"""Per-layer decision between the ghost norm and per-sample gradient instantiation.

Space rule (mixed-ghost paper eq. 4.1; book-keeping paper section 3.2): ghost norm iff
2T^2 < p*d. Time rule (mixed-ghost paper Table 1, one layer): ghost norm costs
2BT^2(d+p+1) - B operations, instantiation 2B(T+1)pd; pick the cheaper.
Decisions are made per call from the real shapes, since T changes between batches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .algorithms import RECIPES, GradVia, NormVia, Recipe
from .layers.base import LayerDims, find_rule, trainable_params

DECISION_RULES = ("space", "time")


def ghost_time(dims: LayerDims) -> int:
    return dims.blocks * (2 * dims.T * dims.T * (dims.d + dims.p + 1) - 1)


def instantiate_time(dims: LayerDims) -> int:
    return dims.blocks * 2 * (dims.T + 1) * dims.p * dims.d


def prefers_ghost(dims: LayerDims, rule: str = "space") -> bool:
    """True when the ghost norm is the better primitive for this layer call."""
    if not dims.ghost_supported:
        return False
    if rule == "space":
        return dims.ghost_cost < dims.instantiate_cost
    if rule == "time":
        return ghost_time(dims) < instantiate_time(dims)
    raise ValueError(f"unknown decision rule {rule!r}; valid: {', '.join(DECISION_RULES)}")


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
    norm: str   # "ghost" or "instantiate"
    grad: str   # "book-keeping", "weighted-sum" or "second-pass"

    def as_dict(self) -> dict:
        return asdict(self)


def decide(recipe: Recipe, dims: LayerDims, decision_rule: str, weight_trainable: bool) -> tuple[str, str]:
    """(norm primitive, gradient primitive) a recipe uses for one layer call.

    The ghost norm applies to the weight; biases and norm layers are always instantiated
    (their per-sample gradients are as small as the norm computation itself).
    """
    ghost = weight_trainable and dims.ghost_supported and (
        recipe.norm is NormVia.GHOST or (recipe.norm is NormVia.MIXED and prefers_ghost(dims, decision_rule))
    )
    if recipe.grad is GradVia.SECOND_PASS:
        grad = "second-pass"
    elif recipe.grad is GradVia.WEIGHTED_SUM or (recipe.grad is GradVia.FOLLOW_NORM and not ghost):
        grad = "weighted-sum"
    else:
        grad = "book-keeping"
    return ("ghost" if ghost else "instantiate"), grad


def plan(model: nn.Module, *example_args, clipping_mode: str = "bk-mixopt", decision_rule: str = "space",
         **example_kwargs) -> list[LayerDecision]:
    """What ``clipping_mode`` would do per trainable layer for inputs shaped like the example.

    Runs one forward pass without gradients; a module called several times is reported
    once per call. Nothing on the model is changed.
    """
    if clipping_mode not in RECIPES:
        raise ValueError(f"unknown clipping_mode {clipping_mode!r}; valid: {', '.join(RECIPES)}")
    recipe = RECIPES[clipping_mode]
    decisions: list[LayerDecision] = []
    handles = []
    for name, module in model.named_modules():
        params = trainable_params(module)
        rule = find_rule(module) if params else None
        if rule is None:
            continue

        def record(mod, inputs, tensor, _name=name, _rule=rule, _params=params):
            dims = _rule.dims(mod, _rule.capture(mod, inputs, tensor), tensor)
            norm, grad = decide(recipe, dims, decision_rule, "weight" in _params)
            decisions.append(LayerDecision(_name, type(mod).__name__, dims.T, dims.p, dims.d * dims.blocks,
                                           dims.ghost_cost, dims.instantiate_cost, norm, grad))

        if rule.captures_input:  # the gradient is read at a submodule's input, as the engine does
            target = rule.hook_target(module)
            handles.append(target.register_forward_pre_hook(
                lambda target, inputs, _module=module, _record=record: _record(_module, inputs, inputs[0])))
        else:
            handles.append(module.register_forward_hook(
                lambda mod, inputs, output, _record=record: _record(mod, inputs, output)))
    try:
        with torch.no_grad():
            model(*example_args, **example_kwargs)
    finally:
        for h in handles:
            h.remove()
    return decisions
