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
from .layers import resolve_rule
from .layers.base import LayerDims, layer_params

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
    norm: str   # "ghost", "instantiate", or "fallback" (instantiated by replaying the call, torch.func)
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
    return ("ghost" if ghost else "fallback" if dims.fallback else "instantiate"), grad


def plan(model: nn.Module, *example_args, clipping_mode: str = "bk-mixopt", decision_rule: str = "space",
         allow_fallback: bool = True, **example_kwargs) -> list[LayerDecision]:
    """What ``clipping_mode`` would do per trainable layer for inputs shaped like the example.

    Runs one forward pass without gradients; a module called several times is reported
    once per call. Nothing on the model is changed.
    """
    if clipping_mode not in RECIPES:
        raise ValueError(f"unknown clipping_mode {clipping_mode!r}; valid: {', '.join(RECIPES)}")
    recipe = RECIPES[clipping_mode]
    decisions: list[LayerDecision] = []
    handles = []
    covered = layer_params(model)
    for name, module in model.named_modules():
        params = covered.get(module, {})
        rule = resolve_rule(module, allow_fallback) if params else None
        if rule is None:
            continue

        def record(mod, inputs, tensor, site=None, _name=name, _rule=rule, _params=params):
            if site is None:
                args, kwargs = inputs
                activation = _rule.capture_call(mod, args, kwargs, tensor)
            else:
                activation = _rule.capture_at(mod, site, inputs, tensor)
            dims = _rule.dims(mod, activation, tensor)
            norm, grad = decide(recipe, dims, decision_rule, "weight" in _params)
            decisions.append(LayerDecision(_name, type(mod).__name__, dims.T, dims.p, dims.d * dims.blocks,
                                           dims.ghost_cost, dims.instantiate_cost, norm, grad))

        if rule.captures_input:  # read where the engine reads: capture sites (activation source, gradient target)
            for k, site in enumerate(rule.capture_sites(module)):
                kept: dict = {}
                if site.source is not None and site.source_input:
                    handles.append(site.source.register_forward_pre_hook(
                        lambda src, inputs, _kept=kept: _kept.__setitem__("x", inputs[0])))
                elif site.source is not None:
                    handles.append(site.source.register_forward_hook(
                        lambda src, inputs, output, _kept=kept: _kept.__setitem__("x", output)))

                def at_target(target, inputs, _module=module, _record=record, _k=k, _kept=kept,
                              _sourced=site.source is not None):
                    _record(_module, (_kept.pop("x"),) if _sourced else inputs, inputs[0], _k)

                handles.append(site.target.register_forward_pre_hook(at_target))
        else:
            handles.append(module.register_forward_hook(
                lambda mod, args, kwargs, output, _record=record: _record(mod, (args, kwargs), output),
                with_kwargs=True))
    try:
        with torch.no_grad():
            model(*example_args, **example_kwargs)
    finally:
        for h in handles:
            h.remove()
    return decisions
