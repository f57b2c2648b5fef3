"""Layer rules: one file per layer family, found through the class hierarchy."""
from .base import LayerDims, LayerRule, find_rule, register_layer, registered_rules, trainable_params
from . import linear, conv, embedding, norms, hf, timm  # noqa: F401  (registers the built-in rules)

__all__ = ["LayerDims", "LayerRule", "find_rule", "register_layer", "registered_rules", "trainable_params"]
