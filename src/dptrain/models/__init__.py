"""Models: a model made ready for private training, and the models the command line builds by name.

- ``fixer``: ``dptrain.fix`` swaps the modules private training cannot use (BatchNorm, torch's RNNs and attention)
  for ones it can;
- ``validation``: ``dptrain.validate``, what the engine would refuse (a trainable parameter no rule covers);
- ``specs``: the ``dptrain`` command's model specs (``cnn``, ``timm:NAME``, ``hf:NAME``, ...), read without torch;
- ``build``: the model a spec names (built-in, torchvision, timm, Hugging Face with its task head and LoRA).

It may import ``layers``, ``nn`` and ``_checks``. The names are imported on first use (PEP 562), as ``dptrain``'s
are: the command line reads ``specs`` before it loads torch.
"""
from __future__ import annotations

import importlib

# name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("fix", "planned_fixes"), "fixer"),
    **dict.fromkeys(("validate", "find_problems"), "validation"),
    **dict.fromkeys(("BUILTIN_MODELS", "HF_HEADS", "IMAGE_MODEL_HELP", "MODEL_SOURCES", "MODEL_SPEC_HELP",
                     "ModelSpecError", "parse_image_spec", "parse_spec"), "specs"),
    **dict.fromkeys(("BuiltModel", "GrayToRGB", "MLP", "SmallCNN", "build_image_model", "build_text_model",
                     "with_lora"), "build"),
}

__all__ = [
    "BUILTIN_MODELS", "BuiltModel", "GrayToRGB", "HF_HEADS", "IMAGE_MODEL_HELP", "MLP", "MODEL_SOURCES", "MODEL_SPEC_HELP",
    "ModelSpecError", "SmallCNN", "build_image_model", "build_text_model", "find_problems", "fix", "parse_image_spec",
    "parse_spec", "planned_fixes", "validate", "with_lora",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
