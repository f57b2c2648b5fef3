"""Evaluation without gradients costs what it costs without the engine: the layers' hooks are set aside for it.

A module with any forward hook is called through torch's slow path (about 6 us a call on a CPU), even when the
hook returns at once, as the engine's layer hooks do where gradients are disabled. A model call under
``torch.no_grad()`` or ``torch.inference_mode()`` records nothing, so for its duration the covered layers' hook
dictionaries are replaced by copies without the engine's layer hooks (the user's own hooks stay, in their order),
and put back when the model call returns or raises. Only the model's own hooks run: one slow call per forward.

Not set aside: the model's hooks (they set this up, about 15 us a forward on a CPU), and the checks that refuse a
module's call whatever the gradient mode (a BatchNorm in training mode would update its running statistics from
private data). A hook registered on a covered layer *during* such a call stays registered afterwards, but its handle
can no longer remove it (it names the dictionary the layer held meanwhile): register hooks outside evaluation.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

_DICTS = ("_forward_pre_hooks", "_forward_hooks")


class HooksAside:
    """The layer hooks set aside during one model call, and how to put them back."""

    def __init__(self) -> None:
        #: per dictionary holding layer hooks: (module's __dict__, the dict's name, the module's own dict, its keys
        #: when the plan was made, the copy it holds meanwhile (the user's hooks, often none), and the copy's length);
        #: made again when the hooks change
        self._plan: list[tuple[dict, str, OrderedDict, frozenset, OrderedDict, int]] | None = None
        self._aside = False

    def forget_modules(self) -> None:
        """Hooks were added: the dictionaries that hold layer hooks are looked up again at the next evaluation."""
        self._plan = None

    @staticmethod
    def _make_plan(model: nn.Module, layer_hook_ids: set[int]) -> list:
        plan = []
        for module in model.modules():
            for name in _DICTS:
                hooks = getattr(module, name)
                if any(k in layer_hook_ids for k in hooks):
                    kept = OrderedDict((k, h) for k, h in hooks.items() if k not in layer_hook_ids)
                    plan.append((module.__dict__, name, hooks, frozenset(hooks), kept, len(kept)))
        return plan

    @staticmethod
    def _stale(plan: list) -> bool:
        """A hook was added or removed since the plan: where only the engine's hooks were, a user's hook can only be
        added (the length); elsewhere the keys are compared."""
        for _, _, hooks, keys, _, kept_len in plan:  # (a loop: this runs at every evaluation's model call)
            if len(hooks) != len(keys) if not kept_len else hooks.keys() != keys:
                return True
        return False

    def set_aside(self, model: nn.Module, layer_hook_ids: set[int]) -> None:
        if self._aside:  # (a model call inside one: already set aside)
            return
        plan = self._plan
        if plan is None or self._stale(plan):
            plan = self._plan = self._make_plan(model, layer_hook_ids)
        for attributes, name, _, _, kept, _ in plan:  # (straight into __dict__: nn.Module.__setattr__ is slow)
            attributes[name] = kept
        self._aside = True

    def put_back(self) -> None:
        if not self._aside:
            return
        self._aside = False
        assert self._plan is not None  # (set aside by its plan)
        for attributes, name, hooks, _, kept, kept_len in self._plan:
            attributes[name] = hooks
            if len(kept) != kept_len:
                # a hook registered during the call: it stays registered, on the module's own dictionary
                hooks.update((k, h) for k, h in kept.items() if k not in hooks)
                self._plan = None
