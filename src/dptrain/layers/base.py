"""Where the layer-rule API used to live in one file; kept so that ``dptrain.layers.base`` imports keep
working. The contract is in ``protocol.py``, the registry in ``registry.py`` and the numeric helpers
in ``numerics.py``: new code imports from those (or from ``dptrain.layers``).
"""
from __future__ import annotations

from .numerics import (  # noqa: F401
    OneHot, accumulation_dtype, factor_gram, factor_weighted_sum, flatten_tokens, float32_at_least, scale_samples,
    shared_sq_norm, weighted_sum,
)
from .protocol import CaptureSite, LayerDims, LayerRule, positional_inputs  # noqa: F401
from .registry import (  # noqa: F401
    container_params, covering_base, find_rule, layer_params, register_layer, trainable_params, unregister_layer,
)

__all__ = [
    "CaptureSite", "LayerDims", "LayerRule", "OneHot", "accumulation_dtype", "container_params", "covering_base",
    "factor_gram", "factor_weighted_sum", "find_rule", "flatten_tokens", "float32_at_least", "layer_params",
    "positional_inputs", "register_layer", "scale_samples", "shared_sq_norm", "trainable_params", "unregister_layer",
    "weighted_sum",
]
