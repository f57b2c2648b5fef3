"""Layer rules: one file per layer family, found through the class hierarchy.

Writing a rule: ``protocol.py`` (``LayerRule``, ``LayerDims``), ``registry.py`` (``register_layer``,
``unregister_layer``), ``numerics.py`` (the helpers the built-in rules share); ``norms.AffineNormRule`` is
the base of every normalisation rule. ``dptrain.testing.assert_rule_exact`` checks a rule in every mode.

The rules know nothing of the engine that runs them: this package imports nothing of dptrain but ``_checks``.
"""
from __future__ import annotations

from .protocol import CaptureSite, LayerDims, LayerRule
from .registry import find_rule, register_layer, trainable_params, unregister_layer

# isort: off
from . import linear, conv, embedding, norms, hf, timm  # noqa: F401  (registers the built-in rules, in this order)
# isort: on
from .fallback import FallbackRule, fallback_refusal, in_replay
from .norms import AffineNormRule
from .resolve import fallback_modules, resolve_rule

__all__ = [
    "AffineNormRule", "CaptureSite", "FallbackRule", "LayerDims", "LayerRule", "fallback_modules", "fallback_refusal",
    "find_rule", "in_replay", "register_layer", "resolve_rule", "trainable_params", "unregister_layer",
]
