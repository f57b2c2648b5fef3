"""A covered layer call's inputs and output as its hooks look at them (``layer_hooks``): whether a gradient is required
among them, whether the output is one of the layer's own parameters, a table broadcast over the batch among them, and
a sequence-first call's tensors with the batch first."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..layers.numerics import swap01
from .broadcast import BroadcastRows, rows_of
from .calls import LayerState


def requires_grad_in(values) -> bool:
    """Whether a tensor among ``values`` (a call's arguments, containers looked into) requires gradients."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple, dict)) and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(v)):
            return True
    return False


def of_own_parameter(tensor: torch.Tensor, state: LayerState) -> bool:
    """Whether ``tensor`` is one of the layer's trainable parameters or a view of one."""
    base = tensor._base if tensor._is_view() else tensor
    return any(base is p for p in state.params.values())


def broadcast_rows_of(inputs: tuple) -> tuple:
    """A layer call's inputs ((args, kwargs), or a capture site's tensors) with each BroadcastRows replaced by its rows
    over the batch (a quick look first: this runs at every layer call)."""
    flat = (*inputs[0], *inputs[1].values()) if len(inputs) == 2 and isinstance(inputs[1], dict) else inputs
    for a in flat:
        if type(a) is BroadcastRows or isinstance(a, (list, tuple, dict)):
            return pytree.tree_map_only(BroadcastRows, rows_of, inputs)
    return inputs


def batch_to_front(inputs, batch: int | None, state: LayerState):
    """Tensors [T, B, ...] of a sequence-first model as [B, T, ...] (every tensor, if the batch is unknown)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() < 2:
            return inputs
        if batch is None:
            return swap01(inputs)
        first, second = inputs.shape[0] == batch, inputs.shape[1] == batch
        if first and second:
            if getattr(state.rule, "rows_fold_into_tokens", False):
                # the rows are read over both leading axes (rows.py): [T, B, ...] and [B, T, ...] alike
                return inputs
            raise ValueError(
                f"{state.path} ({type(state.module).__name__}) got a tensor of shape "
                f"{tuple(inputs.shape)} in a sequence-first model (batch_first=False) whose batch is {batch}: with "
                f"as many positions as samples the engine cannot tell which axis is the batch, and the rule "
                f"{type(state.rule).__name__} cannot take its rows in either layout. Use another batch size for "
                "this step, or freeze this layer"
            )
        return swap01(inputs) if second else inputs
    if isinstance(inputs, tuple):
        return tuple(batch_to_front(x, batch, state) for x in inputs)
    if isinstance(inputs, dict):
        return {k: batch_to_front(v, batch, state) for k, v in inputs.items()}
    return inputs
