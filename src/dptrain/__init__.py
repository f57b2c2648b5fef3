"""dptrain: differentially private training for any PyTorch loop, exact and fast.

The public names are imported on first use (PEP 562), not here: the ``dptrain`` command
imports this package first, and ``dptrain --help`` should not wait for torch.
"""
from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "PrivacyEngine": "engine",
    "fix": "fixer",
    "planned_fixes": "fixer",
    "register_layer": "layers",
    "unregister_layer": "layers",
    "find_rule": "layers",
    "LayerRule": "layers",
    "LayerDims": "layers",
    "AffineNormRule": "layers",
    "LayerDecision": "planning",
    "plan": "planning",
    "plan_noise": "correlated",
    "validate": "validation",
    "find_problems": "validation",
    "CLIPPING_MODES": "algorithms",
    "RECIPES": "algorithms",
    "CLIPPING_FNS": "clipping",
    "CLIPPING_STYLES": "clipping",
}

__all__ = [
    "PrivacyEngine",
    "fix",
    "planned_fixes",
    "nn",
    "register_layer",
    "unregister_layer",
    "find_rule",
    "LayerRule",
    "LayerDims",
    "AffineNormRule",
    "LayerDecision",
    "plan",
    "plan_noise",
    "validate",
    "find_problems",
    "CLIPPING_MODES",
    "CLIPPING_FNS",
    "CLIPPING_STYLES",
    "RECIPES",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # a submodule (dptrain.nn, dptrain.data, dptrain.testing, ...), as an eager import made it available
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
