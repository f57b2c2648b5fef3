"""dptrain: differentially private training for any PyTorch loop, exact and fast."""
from .algorithms import CLIPPING_MODES, RECIPES
from .clipping import CLIPPING_FNS, CLIPPING_STYLES
from . import nn
from .engine import PrivacyEngine
from .fixer import fix, planned_fixes
from .layers import LayerDims, LayerRule, find_rule, register_layer
from .planning import LayerDecision, plan
from .validation import find_problems, validate

__version__ = "0.1.0"

__all__ = [
    "PrivacyEngine",
    "fix",
    "planned_fixes",
    "nn",
    "register_layer",
    "find_rule",
    "LayerRule",
    "LayerDims",
    "LayerDecision",
    "plan",
    "validate",
    "find_problems",
    "CLIPPING_MODES",
    "CLIPPING_FNS",
    "CLIPPING_STYLES",
    "RECIPES",
]
