"""The rule the engine uses for each module (``resolve_rule``): a registered one, a recognised one, or the per-sample
fallback; and the modules of a model that the fallback would take (``fallback_modules``)."""
from __future__ import annotations

from torch import nn

from .embedding import recognise_scaled_embedding
from .fallback import FallbackRule, fallback_refusal
from .norms import recognise_rms_norm
from .protocol import LayerRule
from .registry import container_params, find_rule, layer_params, trainable_params


def resolve_rule(module: nn.Module, allow_fallback: bool = True, batch_first: bool = True,
                 name: str | None = None) -> LayerRule | None:
    """The rule the engine uses for ``module``: its registered rule; else, for an embedding that scales its
    lookup by a constant ``embed_scale``, the scaled-embedding rule (checked numerically on its first call); else, for a module shaped like an
    RMS norm, the norm rule (checked numerically on its first call, which hands a module that fails
    to the fallback if allowed, else refuses it); else, if allowed and the module has trainable
    parameters of its own, the generic per-sample fallback (``torch.func``, instantiation only);
    ``None`` when nothing covers it. Recognised norms and fallbacks are built per module.

    ``batch_first``: the engine's option of that name; with ``False`` the engine hands rules the
    tensors of a call with dims 0 and 1 swapped, and the fallback swaps them back to replay it.
    ``name``: the module's path in the model (``""`` for the root), which a fallback's refusals name;
    without it they name the module's class."""
    rule = find_rule(module) or recognise_scaled_embedding(module)
    if rule is not None:
        return rule
    fallback = None
    trainable = trainable_params(module) or any(module.get_parameter(n).requires_grad for n in container_params(module))
    if allow_fallback and trainable and fallback_refusal(module) is None:
        fallback = FallbackRule(module, name=name, batch_first=batch_first)
    norm = recognise_rms_norm(module, fallback)  # a module that fails its check goes to the fallback
    return norm if norm is not None else fallback


def fallback_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose trainable parameters the engine would give to the fallback."""
    covered = layer_params(model)
    return [
        name or "<root>" for name, module in model.named_modules()
        if module in covered and isinstance(resolve_rule(module, True), FallbackRule)
    ]
