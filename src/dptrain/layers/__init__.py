"""Layer rules: one file per layer family, found through the class hierarchy."""
from __future__ import annotations
from torch import nn

from .base import LayerDims, LayerRule, find_rule, register_layer, registered_rules, trainable_params
from . import linear, conv, embedding, norms, hf, timm  # noqa: F401  (registers the built-in rules)

__all__ = [
    "LayerDims", "LayerRule", "find_rule", "resolve_rule", "register_layer", "registered_rules", "trainable_params",
]


def resolve_rule(module: nn.Module, allow_fallback: bool = True) -> LayerRule | None:
    """The rule the engine uses for ``module``: its registered rule, else (if allowed and the module
    qualifies) the generic per-sample fallback; ``None`` when neither covers it."""
    return find_rule(module)
