"""The benchmark models at the papers' sizes (and scaled down for a CPU), their batches and per-sample losses."""
from __future__ import annotations

import contextlib
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
    from torchvision.models.vgg import VGG, cfgs, make_layers

    features = make_layers(cfgs["A"], batch_norm=True)  # vgg11_bn's
    replaced = head == "cifar" or hidden != 4096
    # a head that is replaced below is built on the meta device: filling torchvision's 4096-wide one (120 M weights)
    # takes seconds on a CPU, for nothing
    with torch.device("meta") if replaced else contextlib.nullcontext():
        model = VGG(features, num_classes=num_classes)
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


def gpt2(layers: int, width: int, heads: int, *, vocab: int = 50257, tied: bool = True, dropout: float | None = None,
         train_positions: bool = True) -> nn.Module:
    """HF GPT-2 with random weights. ``tied``: the head shares the token embedding (GPT-2's own);
    ``dropout``: every dropout probability (None: GPT-2's 0.1); ``train_positions=False`` freezes the
    position embedding (issue 43's table: Opacus cannot take the [1, T] position ids of an untied model)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    drop = {} if dropout is None else {"attn_pdrop": dropout, "resid_pdrop": dropout, "embd_pdrop": dropout}
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024, vocab_size=vocab,
                        use_cache=False, tie_word_embeddings=tied, **drop)
    model = GPT2LMHeadModel(config)
    if not train_positions:
        model.transformer.wpe.weight.requires_grad_(False)
    return model


#: Issue 43's Llama (random weights; ``llama(**LLAMA_1B)``). The issue calls it "of 1.1 B parameters"; with 16
#: layers it has 852.6 M (TinyLlama's 1.1 B has 22 layers of this shape). The configuration is the issue's.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000)
#: LoRA on every linear layer of a Llama block (issue 43: r 16, alpha 32).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama(hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
          num_key_value_heads: int, vocab_size: int = 32000, max_position_embeddings: int = 4096) -> nn.Module:
    """HF ``LlamaForCausalLM`` with random weights: grouped-query attention, SwiGLU, RMSNorm, rotary positions.

    ``max_position_embeddings`` is 4096 so that the long-context row (T = 4096) is within the configuration;
    the default rotary embedding computes the same values whatever it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, vocab_size=vocab_size,
                         max_position_embeddings=max_position_embeddings, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def with_lora(model: nn.Module, r: int = 16, alpha: int = 32, targets: tuple[str, ...] = LORA_TARGETS) -> nn.Module:
    """``peft``'s LoRA adapters on ``targets`` (the base weights frozen), no dropout."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets)))


def _basic_block_out_of_place(self, x):
    """torchvision's ``BasicBlock.forward`` with the residual added out of place (Opacus' hooks refuse ``+=``)."""
    identity = x if self.downsample is None else self.downsample(x)
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    return self.relu(out + identity)


def without_inplace_ops(model: nn.Module) -> nn.Module:
    """In-place activations turned off and ResNet's residual adds made out of place, on this model only:
    what Opacus' and fastDP's backward hooks need. Issue 43's table trains this model in every arm."""
    import types

    from torchvision.models.resnet import BasicBlock

    for module in model.modules():
        if getattr(module, "inplace", False) is True:
            module.inplace = False
        if isinstance(module, BasicBlock):
            module.forward = types.MethodType(_basic_block_out_of_place, module)
    return model


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
    # position ids of a language model: None gives them as [B, T] to the Opacus arms only (which need every layer's
    # input batched) and lets the model broadcast its own [1, T] elsewhere; True or False: the same for every arm
    batched_positions: bool | None = None

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
        """``batched_positions``: give GPT-2 its position ids as [B, T] instead of letting it broadcast [1, T]
        (the task's own ``batched_positions``, where set, decides instead)."""
        if self.kind == "image":
            return model(batch["x"])
        if self.batched_positions is not None:
            batched_positions = self.batched_positions
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
    autocast: str | None = None   # the forward and loss under ``torch.autocast`` to this dtype ("bfloat16")
    build_on_device: bool = False  # build the model under ``torch.device(device)`` (a 0.85 B Llama takes long on a CPU)

    def autocast_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.autocast) if self.autocast else None


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
    if not cpu:  # issue 43's Llama, bf16 autocast, built on the GPU; the per-sample loss is each sequence's token mean
        described = ("issue 43's Llama (HF LlamaForCausalLM, 16 layers, width 2048, GQA 16/4 heads, SwiGLU 5632, vocab "
                     "32000: 852.6 M parameters), bf16 autocast")
        for name, lora, T, batch in (("llama-1b-t256", False, 256, 8), ("llama-1b-lora-t256", True, 256, 8),
                                     ("llama-1b-t4096", False, 4096, 2)):
            build = (lambda: with_lora(llama(**LLAMA_1B))) if lora else (lambda: llama(**LLAMA_1B))
            out.append(BenchConfig(
                name, described + (", LoRA r 16 on every linear layer" if lora else ", full fine-tuning") + f", T={T}",
                batch, 3, 10, lambda build=build, T=T: Task("lm", build, seq_len=T, vocab=LLAMA_1B["vocab_size"],
                                                             batched_positions=False),
                autocast="bfloat16", build_on_device=True))
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
