"""dptrain: differentially private training for any PyTorch loop, exact and fast.

The package, by concern (docs/architecture.md draws it):

- the public face: ``engine`` (``PrivacyEngine``), ``losses``, ``data``, ``accounting``, ``correlated``, ``layers``,
  ``nn``, ``models`` (``fix``, ``validate``), ``testing``, ``audit``, ``integrations``, ``cli``;
- behind it: ``core`` (one private step's machinery), ``rows`` (which sample each row of a layer call belongs to),
  ``privacy`` (what a run has spent and may spend) and ``_checks`` (the argument checks, one message style).

The public names are imported on first use (PEP 562), not here: the ``dptrain`` command
imports this package first, and ``dptrain --help`` should not wait for torch.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "PrivacyEngine": "engine",
    "fix": "models.fixer",
    "planned_fixes": "models.fixer",
    "register_layer": "layers",
    "unregister_layer": "layers",
    "find_rule": "layers",
    "LayerRule": "layers",
    "LayerDims": "layers",
    "AffineNormRule": "layers",
    "LayerDecision": "core.planning",
    "plan": "core.planning",
    "plan_noise": "correlated",
    "validate": "models.validation",
    "find_problems": "models.validation",
    "CLIPPING_MODES": "core.algorithms",
    "RECIPES": "core.algorithms",
    "CLIPPING_FNS": "core.clipping",
    "CLIPPING_STYLES": "core.clipping",
}

# Where each module stood before the package was grouped by concern: ``dptrain.<old>`` still imports it (the same
# module object, so that a patch of one is a patch of the other, and a checkpoint pickled with the old path loads).
_MOVED = {
    **{name: f"core.{name}" for name in (
        "algorithms", "attached", "backward", "broadcast", "calls", "capture", "clipping", "config", "deferred",
        "distributed", "graph_nodes", "hooks_aside", "layer_hooks", "noise", "pipeline", "plan_report", "planning",
        "precision", "runner", "state_writes", "step", "trainable")},
    **{name: f"privacy.{name}" for name in ("budget", "ledger", "loader_checks", "sampling")},
    "privacy_report": "privacy.report",
    "fixer": "models.fixer",
    "validation": "models.validation",
    "model_specs": "models.specs",
    "cyclic": "data.cyclic",
    "neighbours": "testing.neighbours",
    "checks": "_checks",
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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``dptrain.<old>`` (``_MOVED``) as the module where it stands now, loaded on first use."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder: exec_module puts the moved module in its place

    def exec_module(self, module) -> None:
        old = module.__name__.rpartition(".")[2]
        sys.modules[module.__name__] = importlib.import_module(f".{_MOVED[old]}", __name__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


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
