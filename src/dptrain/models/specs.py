"""Model specs of the ``dptrain`` command (``cnn``, ``timm:NAME``, ...), read without importing torch.

The CLI checks a spec here before it loads torch, so a misspelt model answers at once;
``build`` makes the model a valid spec names.
"""
from __future__ import annotations

from .. import _checks

BUILTIN_MODELS = ("cnn", "mlp")
MODEL_SOURCES = ("torchvision", "timm", "hf")
MODEL_SPEC_HELP = "cnn, mlp, torchvision:NAME, timm:NAME or hf:NAME"
IMAGE_MODEL_HELP = "cnn, mlp, torchvision:NAME or timm:NAME"
# The head an hf: model is built with (build.build_text_model); "auto": the model type's language-model head
HF_HEADS = ("auto", "causal-lm", "masked-lm", "seq2seq-lm", "sequence-classification", "token-classification", "none")


class ModelSpecError(ValueError):
    """A model spec that names no model, or whose optional package is missing."""


def parse_spec(spec: str, valid: str = MODEL_SPEC_HELP) -> tuple[str, str]:
    """``"torchvision:resnet18"`` -> ``("torchvision", "resnet18")``; built-ins -> ``("builtin", name)``.

    ``valid`` is what the error lists (image datasets take no ``hf:`` model).
    """
    if spec in BUILTIN_MODELS:
        return "builtin", spec
    source, sep, name = spec.partition(":")
    if not sep or source not in MODEL_SOURCES or not name:
        raise ModelSpecError(str(_checks.unknown("model", spec, (valid,))))
    return source, name


def parse_image_spec(spec: str) -> tuple[str, str]:
    """As ``parse_spec``, for an image dataset: ``hf:`` models are text models."""
    source, name = parse_spec(spec, IMAGE_MODEL_HELP)
    if source == "hf":
        raise ModelSpecError(f"{spec!r} is a text model; image datasets need {IMAGE_MODEL_HELP}")
    return source, name
