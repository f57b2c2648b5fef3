"""Layer rules: one file per layer family, found through the class hierarchy."""
from __future__ import annotations
from torch import nn

from .base import LayerDims, LayerRule, find_rule, register_layer, registered_rules, trainable_params
from . import linear, conv, embedding, norms, hf, timm  # noqa: F401  (registers the built-in rules)
from .fallback import FallbackRule, fallback_modules, fallback_refusal, in_replay
from .norms import recognise_rms_norm

__all__ = [
    "FallbackRule", "LayerDims", "LayerRule", "fallback_modules", "fallback_refusal", "find_rule", "in_replay",
    "register_layer", "registered_rules", "resolve_rule", "trainable_params",
]


def resolve_rule(module: nn.Module, allow_fallback: bool = True) -> LayerRule | None:
    """The rule the engine uses for ``module``: its registered rule; else, for a module shaped like an
    RMS norm, the norm rule (checked numerically on its first call); else, if allowed and the module
    has trainable parameters of its own, the generic per-sample fallback (``torch.func``, instantiation
    only); ``None`` when nothing covers it. Recognised norms and fallbacks are built per module."""
    rule = find_rule(module)
    if rule is not None:
        return rule
    norm = recognise_rms_norm(module)
    if norm is not None:
        return norm
    if allow_fallback and trainable_params(module) and fallback_refusal(module) is None:
        return FallbackRule(module)
    return None
