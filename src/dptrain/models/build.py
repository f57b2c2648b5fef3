"""Models for the ``dptrain`` command: built-in ones, and torchvision / timm / Hugging Face by name.

A model is named by a *spec*:

- ``cnn``: a small convolutional network with GroupNorm (the default; sized for digits)
- ``mlp``: a two-layer perceptron on the flattened image
- ``torchvision:NAME`` (e.g. ``torchvision:resnet18``), ``timm:NAME``: image models with
  random weights. A model made for one input size (vision transformers: their position
  embedding has one entry per patch) is built for the data's image size.
- ``hf:NAME``: a Hugging Face ``transformers`` model built from its config (random
  weights); NAME is a model type (``bert``, ``gpt2``, ...) or a config on the hub / disk.

For training, ``dptrain.fix`` swaps what the engine refuses: BatchNorm becomes
GroupNorm (BatchNorm normalises with statistics of the whole batch, which mixes samples),
torch's RNN/LSTM/GRU/MultiheadAttention become their dptrain.nn versions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .._checks import first_line
from .specs import ModelSpecError, parse_image_spec, parse_spec

# torchvision builders of fixed-input-size models, and the keyword that sets the size
_TORCHVISION_SIZE_KEYWORD: dict[str, tuple[str, Callable[[int], Any]]] = {"vit_": ("image_size", int), "maxvit_": ("input_size", lambda n: (n, n))}


def _groupnorm_groups(channels: int, preferred: int = 32) -> int:
    """The largest divisor of ``channels`` not above ``preferred`` (GroupNorm needs a divisor)."""
    return math.gcd(channels, preferred)


class SmallCNN(nn.Sequential):
    """Two conv blocks (conv, GroupNorm, ReLU, max-pool) and a linear classifier.

    Small on purpose: under DP the noise grows with the number of parameters, so a
    compact model learns more per unit of privacy. Adaptive pooling makes it work on
    any image size from 4x4 up (8x8 digits, 28x28 MNIST, 32x32 CIFAR).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 32):
        super().__init__(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.GroupNorm(_groupnorm_groups(width, 8), width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.GroupNorm(_groupnorm_groups(2 * width, 8), 2 * width),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 4, num_classes),
        )


class MLP(nn.Sequential):
    def __init__(self, in_features: int, num_classes: int, hidden: int = 128):
        super().__init__(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class GrayToRGB(nn.Module):
    """Repeats a one-channel image over three channels, for ImageNet-style models on MNIST."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.expand(-1, 3, *x.shape[2:]))


@dataclass
class BuiltModel:
    model: nn.Module
    spec: str
    notes: list[str]
    fixed: bool = False  # dptrain.fix changed something (BatchNorm, torch RNN/attention)
    head: str | None = None  # hf: models: the task head built (specs.HF_HEADS)


def _import_optional(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        raise ModelSpecError(
            f"{module} is not installed; install the optional extra: pip install 'dptrain[{extra}]'"
        ) from None


def build_image_model(
    spec: str, in_channels: int, num_classes: int, image_size: int, *, for_training: bool = True
) -> BuiltModel:
    """An image classifier for inputs ``[B, in_channels, H, W]`` with ``num_classes`` outputs.

    ``for_training`` applies ``dptrain.fix`` (see the module docstring); ``dptrain plan``
    keeps the model as published, so its numbers match the papers' tables.
    """
    source, name = parse_image_spec(spec)
    notes: list[str] = []
    if source == "builtin":
        if name == "cnn":
            model: nn.Module = SmallCNN(in_channels, num_classes)
        else:
            model = MLP(in_channels * image_size * image_size, num_classes)
        return BuiltModel(model, spec, notes)
    if source == "torchvision":
        torchvision = _import_optional("torchvision", "vision")
        if name not in torchvision.models.list_models(module=torchvision.models):
            raise ModelSpecError(
                f"torchvision has no classification model {name!r}; see torchvision.models.list_models()"
            )
        size_keyword = next((kw for prefix, kw in _TORCHVISION_SIZE_KEYWORD.items() if name.startswith(prefix)), None)
        if size_keyword is None:
            model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
        else:
            keyword, value = size_keyword
            model = _build_for_size(spec, image_size, lambda: torchvision.models.get_model(
                name, weights=None, num_classes=num_classes, **{keyword: value(image_size)}))
            notes.append(f"built for {image_size}x{image_size} images ({keyword}={value(image_size)})")
        model_channels = 3
    else:
        timm = _import_optional("timm", "timm")
        if not timm.is_model(name):
            raise ModelSpecError(f"timm has no model {name!r}; see timm.list_models()")
        cfg = timm.models.get_pretrained_cfg(name)
        if cfg is not None and cfg.fixed_input_size and tuple(cfg.input_size[1:]) != (image_size, image_size):
            model = _build_for_size(spec, image_size, lambda: timm.create_model(
                name, pretrained=False, num_classes=num_classes, img_size=image_size))
            notes.append(f"built for {image_size}x{image_size} images (its default input is "
                         f"{cfg.input_size[1]}x{cfg.input_size[2]})")
        else:
            model = timm.create_model(name, pretrained=False, num_classes=num_classes)
        model_channels = getattr(model, "default_cfg", {}).get("input_size", (3,))[0]
    if in_channels == 1 and model_channels == 3:
        model = GrayToRGB(model)
        notes.append("grayscale images are repeated over 3 channels for this RGB model")
    elif in_channels != model_channels:
        raise ModelSpecError(f"{spec} expects {model_channels}-channel images, the dataset has {in_channels}")
    fix_notes: list[str] = []
    if for_training:
        model, fix_notes = _fix_for_training(model)
    return BuiltModel(model, spec, notes + fix_notes, fixed=bool(fix_notes))


def _build_for_size(spec: str, image_size: int, build):
    """``build()`` for a model with a fixed input size; a size it cannot take is one line, not a traceback."""
    try:
        return build()
    except (AssertionError, ValueError, RuntimeError, TypeError) as err:  # the libraries' own checks
        raise ModelSpecError(
            f"{spec} takes images of one fixed size and cannot be built for {image_size}x{image_size} "
            f"({first_line(err)}); "
            "use a model without a fixed input size (cnn, torchvision:resnet18, timm:resnet18, ...) or images of a "
            "size it takes"
        ) from None


def _fix_for_training(model: nn.Module) -> tuple[nn.Module, list[str]]:
    from .fixer import fix, planned_fixes

    planned = planned_fixes(model)
    if not planned:
        return model, []
    batchnorms = sum(1 for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    other = len(planned) - batchnorms
    parts = [f"{batchnorms} BatchNorm layers -> GroupNorm (BatchNorm mixes samples)"] if batchnorms else []
    if other:
        parts.append(f"{other} torch RNN/attention modules -> dptrain.nn versions (same function)")
    return fix(model, inplace=True), ["dptrain.fix replaced " + " and ".join(parts)]


# --head -> (the transformers Auto class, the model types it knows: modeling_auto's mapping of names)
_HF_HEAD_CLASSES = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "sequence-classification": ("AutoModelForSequenceClassification",
                                "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token-classification": ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "none": ("AutoModel", "MODEL_MAPPING_NAMES"),
}
# "auto": the first language-model head the model type has (BERT and BART also have a causal one, used less)
_AUTO_HEADS = ("seq2seq-lm", "masked-lm", "causal-lm")
# peft's task type per head: it keeps a classifier head trainable (modules_to_save) and knows the forward's inputs
_PEFT_TASK_TYPES: dict[str | None, str] = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM", "sequence-classification": "SEQ_CLS",
                    "token-classification": "TOKEN_CLS"}


def build_text_model(spec: str, *, head: str = "auto", num_classes: int | None = None,
                     for_training: bool = False) -> BuiltModel:
    """A Hugging Face model from its config, with random weights and its task head (for ``dptrain plan``).

    ``head``: one of ``specs.HF_HEADS``; ``"auto"`` takes the model type's language-model head (seq2seq,
    else masked, else causal: T5 and BART, BERT and RoBERTa, GPT-2 and Llama get the head they are published with,
    an untied ``lm_head`` included), or the bare model when it has none; ``"none"`` is the bare model
    (``AutoModel``). ``num_classes`` sets a classification head's outputs. ``for_training`` applies
    ``dptrain.fix``, as for image models. ``BuiltModel.head`` names the head built.
    """
    from .._checks import choice
    from .specs import HF_HEADS

    choice("head", head, HF_HEADS)  # a ValueError listing the heads
    source, name = parse_spec(spec)
    if source != "hf":
        raise ModelSpecError(f"--seq-len is for hf:NAME models; {spec!r} takes --input-size C H W")
    transformers = _import_optional("transformers", "transformers")
    if name in transformers.CONFIG_MAPPING:
        config = transformers.AutoConfig.for_model(name)  # the model type's defaults: no download
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as err:
            raise ModelSpecError(
                f"cannot load the Hugging Face config {name!r} ({first_line(err)}); give a model type such as "
                "bert or gpt2, a cached hub id or a local directory"
            ) from None
    from transformers.models.auto import modeling_auto

    has = [h for h, (_, mapping) in _HF_HEAD_CLASSES.items()
           if config.model_type in getattr(modeling_auto, mapping)]
    notes: list[str] = []
    if head == "auto":
        head = next((h for h in _AUTO_HEADS if h in has), "none")
        if head == "none":
            notes.append(f"{config.model_type} has no language-model head: the bare model (--head chooses one of "
                         f"{', '.join(has)})")
    elif head not in has:
        raise ModelSpecError(f"{spec} ({config.model_type}) has no {head} head; its heads: {', '.join(has)} "
                             "(--head)")
    if num_classes is not None:
        if head not in ("sequence-classification", "token-classification"):
            raise ModelSpecError(f"--num-classes sets a classification head's outputs; --head {head} has none: add "
                                 "--head sequence-classification or token-classification")
        config.num_labels = num_classes
    model = getattr(transformers, _HF_HEAD_CLASSES[head][0]).from_config(config)
    if head != "none":
        notes.append(f"built with its {head} head: {type(model).__name__}")
    fix_notes: list[str] = []
    if for_training:
        model, fix_notes = _fix_for_training(model)
    return BuiltModel(model, spec, notes + fix_notes, fixed=bool(fix_notes), head=head)


def with_lora(built: BuiltModel, rank: int, targets: list[str] | None = None) -> BuiltModel:
    """``built`` with LoRA adapters of rank ``rank`` (peft): on ``targets`` (module names, or peft's own default
    modules for a known Hugging Face model type); the original weights frozen."""
    peft = _import_optional("peft", "peft")
    task = _PEFT_TASK_TYPES.get(built.head)
    config = peft.LoraConfig(r=rank, target_modules=list(targets) if targets else None, task_type=task)
    try:
        model = peft.get_peft_model(built.model, config)
    except ValueError as err:  # peft's own check: no default modules for this model, or a name that matches none
        raise ModelSpecError(f"LoRA cannot be put on {built.spec} ({first_line(err)}); name the modules to adapt "
                             "with --lora-targets NAME [NAME ...]") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    where = ", ".join(sorted(model.peft_config["default"].target_modules))  # peft's defaults filled in
    note = f"LoRA r={rank} on {where}: {trainable:,} of {total:,} parameters trainable"
    return BuiltModel(model, built.spec, [*built.notes, note], fixed=built.fixed, head=built.head)
