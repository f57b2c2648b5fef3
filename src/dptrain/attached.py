"""The engines attached right now, one per model, and torch's global optimizer guard while any is attached.

A second engine on the same model (or on a part of it) would see the first one's ghost-differentiated
backward as ordinary gradients: it is refused at attach. An optimizer other than the attached one that
holds the private model's parameters (built after attach, or a second one) is refused by torch's global
optimizer step pre-hook before it applies anything.
"""
from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# model -> weak reference to the attached engine's PrivateStep (the engine owns it: same lifetime)
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_OPTIMIZER_GUARD: list = []  # the global step pre-hook's handle, while any engine is attached


def refuse_second(model: nn.Module, step) -> None:
    """Refuse to attach ``step``'s engine to ``model`` while another engine is attached to it or a part of it."""
    mine = set(model.modules())
    for root, ref in list(_ATTACHED.items()):
        other = ref()
        if other is None or other is step or other.optimizer is None:
            continue
        if root in mine or model in set(root.modules()):
            raise RuntimeError(
                f"another PrivacyEngine is attached to this model ({type(root).__name__}): two engines on one model "
                "would each see the other's backward as ordinary gradients. Use one engine (one optimizer with "
                "several parameter groups), or call detach() on the other first"
            )


def is_attached(model: nn.Module) -> bool:
    """Whether an engine is attached to ``model``, to a part of it, or to a model it is part of."""
    mine = set(model.modules())
    for root, ref in list(_ATTACHED.items()):
        step = ref()
        if step is not None and step.optimizer is not None and (root in mine or model in set(root.modules())):
            return True
    return False


def add(model: nn.Module, step) -> None:
    _ATTACHED[model] = weakref.ref(step)
    _guard_optimizers()


def remove(model: nn.Module, step) -> bool:
    """Forget ``step``'s engine as the one attached to ``model``; whether it was."""
    ref = _ATTACHED.get(model)
    if ref is None or ref() is not step:
        return False
    del _ATTACHED[model]
    _guard_optimizers()
    return True


def _guard_optimizers() -> None:
    """Every optimizer's step passes the attached engines' check while any engine is attached."""
    attached = any(ref() is not None for ref in _ATTACHED.values())
    if attached and not _OPTIMIZER_GUARD:
        _OPTIMIZER_GUARD.append(register_optimizer_step_pre_hook(_refuse_foreign_optimizers))
    elif not attached and _OPTIMIZER_GUARD:
        _OPTIMIZER_GUARD.pop().remove()


def _refuse_foreign_optimizers(optimizer, args, kwargs) -> None:
    for ref in list(_ATTACHED.values()):
        step = ref()
        if step is not None:
            step.refuse_foreign_optimizer(optimizer)
