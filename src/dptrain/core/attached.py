"""The engines attached right now, one per model, and torch's global optimizer guard while any is attached.

A second engine on the same model (or on a part of it) would see the first one's ghost-differentiated
backward as ordinary gradients: it is refused at attach. So is an engine whose model shares a trainable
parameter with another attached engine's model (a shared encoder of two task models), at attach and when
a shared parameter becomes trainable. An optimizer other than the attached one that
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


def refuse_shared(model: nn.Module, step) -> None:
    """Refuse while a trainable parameter of ``model`` is also in another attached engine's model.

    Each engine would clip only its own model's part of a sample's gradient and add its own noise: the shared
    parameters would receive two releases per step, the per-sample bound of neither covers their sum, each
    engine's hooks on the shared layers would record the other model's calls, and each accountant would count
    only its own steps. (A frozen shared module is harmless: no engine hooks or clips it.)
    """
    trainable = {p for p in model.parameters() if p.requires_grad}
    if not trainable:
        return
    for root, ref in list(_ATTACHED.items()):
        other = ref()
        if other is None or other is step or other.optimizer is None or root is model:
            continue
        shared = [p for p in root.parameters() if p in trainable]
        if shared:
            here, there = _owner(model, shared[0]), _owner(root, shared[0])
            module = dict(model.named_modules())[here]
            raise RuntimeError(
                f"module {here or 'the model'!r} ({type(module).__name__}) of this model is also in the model of another "
                f"attached PrivacyEngine ({type(root).__name__}, as {there or 'the model'!r}), and it has trainable "
                f"parameters ({len(shared)} shared): each engine would clip only its own model's part of a sample's "
                "gradient and add its own noise, so a sample's influence through the shared parameters is bounded by "
                "neither engine (nor counted by either accountant alone), and each engine's hooks would record the "
                "other model's calls. Put the shared module and both heads in one model (its forward returns both "
                "outputs), back-propagate each sample's summed losses (engine.backward(loss_a + loss_b)) and train it "
                "with one engine and one optimizer; or freeze the shared module, or detach() the other engine first"
            )


def _owner(model: nn.Module, p) -> str:
    """The name of the module in ``model`` that registers ``p`` (the first one, if it is tied)."""
    for name, module in model.named_modules():
        if any(q is p for q in module.parameters(recurse=False)):
            return name
    return ""


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
