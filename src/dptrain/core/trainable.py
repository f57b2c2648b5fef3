"""The trainable set: which layers the engine covers now, who uses each parameter, and the clipping groups.

One immutable value (``TrainableSet``), built by one function (``build_trainable_set``) and shared by
the engine, the capture hooks, every backward and ``plan()``. Staged fine-tuning freezes and
unfreezes between steps, so the engine reads the set again at every model call: ``TrainableKey``
tells cheaply whether it changed (the model's parameters, walked again only after a module or
parameter was registered anywhere in the process, and their ``requires_grad`` flags).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from ..layers import resolve_rule
from ..layers.registry import layer_params
from .calls import LayerState
from .clipping import build_groups, group_threshold


def layer_states(model: nn.Module, allow_fallback: bool, batch_first: bool,
                 previous: Mapping[int, LayerState] | None = None) -> list[LayerState]:
    """A ``LayerState`` per covered module with a rule, in ``named_modules`` order; a module covered before keeps
    its state (its rule and its pending calls)."""
    covered = layer_params(model)  # own parameters, and descendants' ones a rule claims
    states = []
    for name, module in model.named_modules():
        if module not in covered:
            continue
        state = previous.get(id(module)) if previous else None
        if state is None or state.module is not module:
            rule = resolve_rule(module, allow_fallback, batch_first=batch_first, name=name)
            if rule is None:  # refused by the engine's validation; plan() leaves it out
                continue
            state = LayerState(name, module, rule, covered[module])
        else:
            state.params = covered[module]
        states.append(state)
    return states


def parameter_users(layers: list[LayerState]) -> dict[nn.Parameter, tuple[tuple[LayerState, str], ...]]:
    """Every covered parameter with the layers that use it and their names for it (several: tied weights)."""
    users: dict[nn.Parameter, list[tuple[LayerState, str]]] = {}
    for state in layers:
        for name, p in state.params.items():
            users.setdefault(p, []).append((state, name))
    return {p: tuple(u) for p, u in users.items()}


@dataclass(frozen=True)
class TrainableSet:
    """The covered layers and parameters trainable now, and their clipping groups.

    A parameter shared by several layers (tied weights) is clipped once, its per-sample gradient being
    the sum of every layer's; its first user names it (``param_name``) and places it in a group.
    """

    layers: tuple[LayerState, ...]
    users: Mapping[nn.Parameter, tuple[tuple[LayerState, str], ...]]
    group_of: Mapping[nn.Parameter, int]
    groups: tuple[tuple[nn.Parameter, ...], ...]
    threshold: float  # each group's clipping threshold
    key: tuple  # the TrainableKey it was built for
    #: ids of the layers none of whose parameters another layer uses (reduced as soon as their gradient arrives)
    sole: frozenset[int] = frozenset()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def param_name(self, p: nn.Parameter) -> str:
        state, name = self.users[p][0]
        return f"{state.name}.{name}" if state.name else name

    def state_of(self) -> dict[int, LayerState]:
        return {id(s.module): s for s in self.layers}


def build_trainable_set(model: nn.Module, *, allow_fallback: bool, batch_first: bool, clipping_style,
                        max_grad_norm: float, key: tuple, previous: TrainableSet | None = None) -> TrainableSet:
    """The trainable set of ``model`` now (the engine validates the model first)."""
    layers = layer_states(model, allow_fallback, batch_first, previous.state_of() if previous else None)
    users = parameter_users(layers)
    param_of = {(u[0][0].name, u[0][1]): p for p, u in users.items()}
    groups = build_groups(clipping_style, [s.name for s in layers], list(param_of)) if users else []
    return TrainableSet(
        layers=tuple(layers),
        users=users,
        group_of={param_of[k]: g for g, group in enumerate(groups) for k in group},
        groups=tuple(tuple(param_of[k] for k in group) for group in groups),
        threshold=group_threshold(max_grad_norm, max(1, len(groups))),
        key=key,
        sole=frozenset(id(s) for s in layers if all(len(users[p]) == 1 for p in s.params.values())),
    )


class TrainableKey:
    """Identifies a model's trainable set cheaply: its parameter list (walked again only after a module or
    parameter was registered into an attached model, which ``_Registrations`` counts) and their ``requires_grad``
    flags. A walk that finds the same parameters keeps the key: a forward that builds containers of the model's
    modules (Llama's ``self.layers[:n]``) changes nothing."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._params: list[nn.Parameter] | None = None
        self._seen = -1

    def __call__(self) -> tuple:
        if self._seen != _Registrations.version or self._params is None:
            params = list(self.model.parameters())
            if self._params is None or len(params) != len(self._params) or any(
                    a is not b for a, b in zip(params, self._params)):
                self._params = params
            self._seen = _Registrations.version
        return (id(self._params), *(p.requires_grad for p in self._params))

    @staticmethod
    def watch(model: nn.Module) -> None:
        _Registrations.watch(model)

    @staticmethod
    def unwatch() -> None:
        _Registrations.unwatch()


def registrations() -> int:
    """Changes whenever a module or parameter is registered into an attached model's modules: a key for caches of
    what a model holds (``TrainableKey``, ``state_writes.StateWrites``)."""
    return _Registrations.version


class _Registrations:
    """Counts module and parameter registrations into the modules of attached models (torch's global registration
    hooks), so each model call can re-read the trainable set from a cached parameter list (walking a large model's
    modules at every call costs milliseconds). A registration into a module of no attached model (a container the
    forward builds, another model) is not counted."""

    version = 0
    _handles: list = []
    _watchers = 0
    #: the modules of the attached models, and those registered into them since
    _members: weakref.WeakSet = weakref.WeakSet()

    @classmethod
    def _module_registered(cls, module, name, submodule):
        if module in cls._members:
            cls.version += 1
            if submodule is not None:
                cls._members.update(submodule.modules())

    @classmethod
    def _parameter_registered(cls, module, name, param):
        if module in cls._members:
            cls.version += 1

    @classmethod
    def watch(cls, model: nn.Module) -> None:
        cls._members.update(model.modules())
        cls.version += 1
        cls._watchers += 1
        if cls._watchers == 1:
            hooks = nn.modules.module
            cls._handles = [hooks.register_module_parameter_registration_hook(cls._parameter_registered),
                            hooks.register_module_module_registration_hook(cls._module_registered)]

    @classmethod
    def unwatch(cls) -> None:
        cls._watchers = max(0, cls._watchers - 1)
        if cls._watchers == 0:
            for handle in cls._handles:
                handle.remove()
            cls._handles = []
            cls._members = weakref.WeakSet()
            cls.version += 1


__all__ = ["TrainableKey", "TrainableSet", "build_trainable_set", "layer_states", "parameter_users"]
