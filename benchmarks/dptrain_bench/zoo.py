"""The benchmark models at the papers' sizes (and scaled down for a CPU), their batches and per-sample losses."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0  # the weights, the batches and the engines' noise


def cifar_cnn(num_classes: int = 10, image_size: int = 32) -> nn.Sequential:
    """The CIFAR-10 CNN of Papernot et al. (2021) / Tramer & Boneh (2021), 550,570 parameters at 32x32.

    The mixed-ghost paper's Table 4 benchmarks it as "CNN [45, 35] 0.551M": six 3x3 convs
    (32, 32, M, 64, 64, M, 128, 128, M) with tanh and 2x2 max-pooling, then 128 -> 10.
    """
    layers: list[nn.Module] = []
    channels = 3
    for v in (32, 32, "M", 64, 64, "M", 128, 128, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.Tanh()]
            channels = v
    side = image_size // 8
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * side * side, 128), nn.Tanh(), nn.Linear(128, num_classes))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(channels, 32), channels)


def vgg11_gn(num_classes: int = 10, head: str = "cifar", hidden: int = 4096) -> nn.Module:
    """torchvision's ``vgg11_bn`` with every BatchNorm replaced by GroupNorm (dptrain refuses BatchNorm).

    ``head="cifar"``: the 32x32 model of the papers' CIFAR runs (kuangliu/pytorch-cifar, 9.2M
    parameters): the 1x1 feature map goes straight into ``Linear(512, num_classes)``.
    ``head="imagenet"``: torchvision's classifier (7x7 average pool, two hidden layers of width
    ``hidden`` with dropout), as the papers use at 224x224.
    """
    import torchvision

    model = torchvision.models.vgg11_bn(weights=None, num_classes=num_classes)
    for i, layer in enumerate(model.features):
        if isinstance(layer, nn.BatchNorm2d):
            model.features[i] = _group_norm(layer.num_features)
    if head == "cifar":
        model.avgpool = nn.Identity()
        model.classifier = nn.Linear(512, num_classes)
    elif hidden != 4096:
        model.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, hidden), nn.ReLU(True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(),
            nn.Linear(hidden, num_classes),
        )
    return model


def resnet18_gn(num_classes: int = 10) -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=num_classes, norm_layer=_group_norm)


def timm_vit(name: str, num_classes: int = 10, image_size: int = 224) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=image_size)


def gpt2(layers: int, width: int, heads: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024, use_cache=False)
    return GPT2LMHeadModel(config)


def roberta(layers: int, width: int, heads: int, num_labels: int = 2) -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
        intermediate_size=4 * width, num_labels=num_labels,
    )
    return RobertaForSequenceClassification(config)


@dataclass(frozen=True)
class Task:
    """How to build a model, draw its batches and compute its per-sample losses."""

    kind: str                   # "image", "lm" or "seq-cls"
    build: Callable[[], nn.Module]
    image_size: int = 32
    seq_len: int = 0
    vocab: int = 0
    num_classes: int = 10

    def make_batch(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        if self.kind == "image":
            return {
                "x": torch.randn(batch_size, 3, self.image_size, self.image_size, generator=generator,
                                 device=generator.device),
                "y": torch.randint(0, self.num_classes, (batch_size,), generator=generator, device=generator.device),
            }
        # token ids from 3 up: skip RoBERTa's special ids (padding 1 would shift its positions)
        ids = torch.randint(3, self.vocab, (batch_size, self.seq_len), generator=generator, device=generator.device)
        if self.kind == "lm":
            return {"ids": ids}
        return {"ids": ids, "y": torch.randint(0, self.num_classes, (batch_size,), generator=generator,
                                               device=generator.device)}

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], batched_positions: bool = False) -> torch.Tensor:
        """``batched_positions``: give GPT-2 its position ids as [B, T] instead of letting it broadcast [1, T]."""
        if self.kind == "image":
            return model(batch["x"])
        if batched_positions and self.kind == "lm":
            ids = batch["ids"]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            return model(input_ids=ids, position_ids=positions).logits
        return model(input_ids=batch["ids"]).logits

    def per_sample_loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] losses; a sequence is one sample (its token losses averaged)."""
        if self.kind == "lm":
            B, T, V = output.shape
            tokens = F.cross_entropy(output[:, :-1].reshape(-1, V), batch["ids"][:, 1:].reshape(-1), reduction="none")
            return tokens.view(B, T - 1).mean(1)
        return F.cross_entropy(output, batch["y"], reduction="none")


def _image_task(build, image_size):
    return Task("image", build, image_size=image_size)


@dataclass(frozen=True)
class BenchConfig:
    """One model at one size and physical batch, with its number of warm-up and timed steps."""

    name: str
    description: str
    batch_size: int
    warmup: int
    steps: int
    task: Callable[[], Task] = field(repr=False, compare=False)


def _configs(scale: str) -> list[BenchConfig]:
    """The benchmark models at the papers' sizes; ``cpu`` scales them down so the whole suite runs on two cores."""
    cpu = scale == "cpu"
    out: list[BenchConfig] = []
    if cpu:  # the CPU targets come first, at exactly the sizes their targets are set for
        out.append(BenchConfig(
            "gpt2-t64", "GPT-2 (HF config) 4 layers, width 256, 4 heads, vocab 50257 (tied), T=64", 16, 3, 10,
            lambda: Task("lm", lambda: gpt2(4, 256, 4), seq_len=64, vocab=50257)))
    out.append(BenchConfig(
        "vgg11-gn-32", "VGG-11 (vgg11_bn with GroupNorm), CIFAR head Linear(512, 10), 32x32", 32 if cpu else 256,
        3, 10, lambda: _image_task(vgg11_gn, 32)))
    out.append(BenchConfig(
        "cifar-cnn", "CIFAR-10 CNN of Papernot et al. / Tramer & Boneh (6 conv, tanh; 0.551M params), 32x32",
        64 if cpu else 256, 2 if cpu else 3, 5 if cpu else 10, lambda: _image_task(cifar_cnn, 32)))
    out.append(BenchConfig(
        "resnet18-gn-32", "ResNet-18 (torchvision, GroupNorm), 32x32", 32 if cpu else 256,
        2 if cpu else 3, 5 if cpu else 10, lambda: _image_task(resnet18_gn, 32)))
    vgg224 = (lambda: vgg11_gn(head="imagenet", hidden=512)) if cpu else (lambda: vgg11_gn(head="imagenet"))
    out.append(BenchConfig(
        "vgg11-gn-224",
        "VGG-11 (vgg11_bn with GroupNorm), torchvision head" + (" with hidden width 512 (scaled from 4096)" if cpu else "")
        + ", 224x224", 4 if cpu else 32, 1 if cpu else 3, 3 if cpu else 10, lambda: _image_task(vgg224, 224)))
    out.append(BenchConfig(
        "resnet18-gn-224", "ResNet-18 (torchvision, GroupNorm), 224x224", 4 if cpu else 32,
        1 if cpu else 3, 3 if cpu else 10, lambda: _image_task(resnet18_gn, 224)))
    if not cpu:  # the GPU table's second ResNet-18 row: where the fixed cost per layer matters less
        out.append(BenchConfig(
            "resnet18-gn-224-b128", "ResNet-18 (torchvision, GroupNorm), 224x224, batch 128", 128, 3, 10,
            lambda: _image_task(resnet18_gn, 224)))
    vit = "vit_tiny_patch16_224" if cpu else "vit_base_patch16_224"
    out.append(BenchConfig(
        "vit-224", f"ViT timm {vit}, random weights, 224x224", 4 if cpu else 32, 1 if cpu else 3, 3 if cpu else 10,
        lambda: _image_task(lambda: timm_vit(vit), 224)))
    gpt_size = (4, 256, 4) if cpu else (12, 768, 12)
    gpt_name = "GPT-2 (HF config) " + ("4 layers, width 256 (scaled from GPT-2 small)" if cpu else "small (12 layers, 768)")
    for T, b_cpu, b_full in ((100, 8, 32), (1000, 2, 4)):
        out.append(BenchConfig(
            f"gpt2-t{T}", f"{gpt_name}, vocab 50257 (tied), T={T}", b_cpu if cpu else b_full,
            1 if cpu else 3, 3 if cpu else 10,
            lambda T=T: Task("lm", lambda: gpt2(*gpt_size), seq_len=T, vocab=50257)))
    rob_size = (4, 256, 4) if cpu else (12, 768, 12)
    out.append(BenchConfig(
        "roberta-256",
        "RoBERTa " + ("4 layers, width 256 (scaled from base)" if cpu else "base") + " sequence classification, T=256",
        4 if cpu else 32, 1 if cpu else 3, 3 if cpu else 10,
        lambda: Task("seq-cls", lambda: roberta(*rob_size), seq_len=256, vocab=50265, num_classes=2)))
    return out


def smoke_config(batch_size: int = 4, steps: int = 2) -> BenchConfig:
    """A tiny configuration (the CIFAR CNN on 8x8 images) for tests of the harness itself."""
    return BenchConfig("smoke-cnn", "CIFAR CNN on 8x8 images (harness smoke test)", batch_size, 1, steps,
                       lambda: _image_task(lambda: cifar_cnn(image_size=8), 8))


def configs_for(scale: str) -> dict[str, BenchConfig]:
    out = {c.name: c for c in _configs(scale)}
    smoke = smoke_config()
    out[smoke.name] = smoke
    return out
