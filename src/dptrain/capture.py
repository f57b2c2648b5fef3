"""Forward/backward hooks that record, per layer call, the activation and the output gradient.

Ghost differentiation (book-keeping paper, section 2.1): a layer's parameters are switched
to ``requires_grad=False`` for the duration of its own forward call only, so autograd
records no parameter-gradient work (the non-private gradient is never computed) while
output gradients still flow; the engine forms every parameter gradient itself. A layer
whose input does not require grad (the first trainable layer) then gets its output
attached to an engine-owned "origin" leaf, so back-propagation still reaches it. Outside
its layer's call a parameter keeps requiring grad, so any other use of it reaches autograd
and is caught by the engine instead of escaping clipping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .distributed import is_dtensor
from .layers.base import LayerDims, LayerRule


@dataclass
class Call:
    """One forward call of a covered module, and later its output gradient."""

    activation: Any
    dims: LayerDims
    batch_size: int
    version: int | None = None  # the activation's version counter when it was captured
    forward_batch: int | None = None  # batch size of the model call this layer call belonged to
    grad: torch.Tensor | None = None


@dataclass
class LayerState:
    name: str
    module: nn.Module
    rule: LayerRule
    params: dict[str, nn.Parameter]
    calls: list[Call] = field(default_factory=list)


class _Origin(torch.autograd.Function):
    """Identity on ``x`` that makes it require grad through ``anchor`` (no gradient flows back)."""

    @staticmethod
    def forward(ctx, anchor, x):
        if x._is_view():  # marking a view dirty would detach it from its base's history
            return x.clone()
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, None


class Capture:
    """Installs and removes the hooks on the covered modules; the engine reacts to gradients."""

    def __init__(self, model: nn.Module, layers: list[LayerState],
                 on_grad: Callable[[LayerState, Call, torch.Tensor], None], params_by_name: bool = False):
        self.model = model
        self.params_by_name = params_by_name
        self.layers = layers
        self.on_grad = on_grad
        self._handles: list[Any] = []
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._switched: dict[int, list[list[nn.Parameter]]] = {}
        self._sources: dict[tuple[int, int], torch.Tensor] = {}  # capture-site activations awaiting their target
        #: batch size of the model's current forward call, read from its first tensor argument
        self.forward_batch: int | None = None

    def install(self, extra_checks: list[tuple[nn.Module, Callable]] = ()) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._record_batch, with_kwargs=True))
        for state in self.layers:
            self._handles.append(state.module.register_forward_pre_hook(self._make_pre_hook(state)))
            self._handles.append(
                state.module.register_forward_hook(self._make_post_hook(state), always_call=True, with_kwargs=True)
            )
            if state.rule.captures_input:
                for k, site in enumerate(state.rule.capture_sites(state.module)):
                    if site.source is not None and site.source_input:
                        hook = self._make_source_hook(state, k, from_input=True)
                        self._handles.append(site.source.register_forward_pre_hook(hook))
                    elif site.source is not None:
                        hook = self._make_source_hook(state, k, from_input=False)
                        self._handles.append(site.source.register_forward_hook(hook))
                    self._handles.append(
                        site.target.register_forward_pre_hook(self._make_input_hook(state, k, site.source is not None))
                    )
        for module, check in extra_checks:
            self._handles.append(module.register_forward_pre_hook(check))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for state in self.layers:
            state.calls.clear()
        self._sources.clear()

    def _record_batch(self, module, args, kwargs):
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        self.forward_batch = first.shape[0] if first is not None else None

    def _anchor(self, device: torch.device) -> torch.Tensor:
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = torch.zeros((), device=device, requires_grad=True)
            self._anchors[device] = anchor
        return anchor

    def _make_pre_hook(self, state: LayerState):
        def pre_hook(module, inputs):
            if torch.is_grad_enabled():
                params = self._current_params(state) if self.params_by_name else state.params.values()
                switched = [p for p in params if p.requires_grad]
                for p in switched:
                    p.requires_grad_(False)
                self._switched.setdefault(id(module), []).append(switched)

        return pre_hook

    @staticmethod
    def _current_params(state: LayerState) -> list[nn.Parameter]:
        """The parameter objects registered during this call (FSDP2's unsharded ones)."""
        params = [state.module.get_parameter(name) for name in state.params]
        if any(is_dtensor(p) for p in params):
            raise NotImplementedError(
                f"{state.name!r} runs its forward with DTensor parameters (tensor parallelism): the engine's "
                "rules need the full weight in every call. Shard with fully_shard (FSDP2) only"
            )
        return params

    def _restore(self, module: nn.Module) -> None:
        stack = self._switched.get(id(module))
        if stack:
            for p in stack.pop():
                p.requires_grad_(True)

    def _make_post_hook(self, state: LayerState):
        def post_hook(module, args, kwargs, output):
            self._restore(module)
            if state.rule.captures_input or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return None
            return self._record(state, module, (args, kwargs), output)

        return post_hook

    def _make_source_hook(self, state: LayerState, site: int, from_input: bool):
        """Keeps a capture site's activation (its source's output or first input) until its target runs."""

        def keep(source, tensor):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{state.name}: the activation source {type(source).__name__} of capture site "
                                f"{site} gave {type(tensor).__name__}, not a tensor")
            self._sources[(id(state), site)] = tensor.detach()

        def source_pre_hook(source, inputs):
            if torch.is_grad_enabled():
                keep(source, inputs[0] if inputs else None)

        def source_hook(source, inputs, output):
            if torch.is_grad_enabled():
                keep(source, output)

        return source_pre_hook if from_input else source_hook

    def _make_input_hook(self, state: LayerState, site: int = 0, has_source: bool = False):
        """For rules that read the gradient of a tensor entering a submodule (``capture_sites``)."""

        def input_hook(target, inputs):
            if not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], torch.Tensor):
                return None
            captured = inputs
            if has_source:
                kept = self._sources.pop((id(state), site), None)
                if kept is None:
                    raise RuntimeError(
                        f"{state.name}: {type(target).__name__} ran before the activation source of capture site "
                        f"{site}: the rule's capture_sites do not match this module's forward"
                    )
                captured = (kept,)
            return (self._record(state, state.module, captured, inputs[0], site), *inputs[1:])

        return input_hook

    def _record(self, state: LayerState, module: nn.Module, inputs: tuple, tensor: torch.Tensor,
                site: int | None = None) -> torch.Tensor:
        """Keep the activation, and hook the gradient of ``tensor`` (a layer output, or a hooked input)."""
        if site is None:
            args, kwargs = inputs
            activation = state.rule.capture_call(module, args, kwargs, tensor)
        else:
            activation = state.rule.capture_at(module, site, inputs, tensor)
        if not tensor.requires_grad:
            tensor = _Origin.apply(self._anchor(tensor.device), tensor)
        if tensor.dim() and tensor.shape[0] == 1 and (self.forward_batch or 1) > 1:
            expanded = state.rule.expand_batch(module, activation, tensor, self.forward_batch)
            if expanded is not None:
                activation, tensor = expanded
        dims = state.rule.dims(module, activation, tensor)
        version = activation._version if isinstance(activation, torch.Tensor) else None
        call = Call(activation, dims, tensor.shape[0] if tensor.dim() else 0, version, self.forward_batch)
        state.calls.append(call)
        tensor.register_hook(lambda g: self.on_grad(state, call, g))
        return tensor
