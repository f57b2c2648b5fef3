"""Private image classification with a timm model, in a plain PyTorch loop.

The model comes from timm unchanged (random weights, nothing downloaded); the training loop
is the usual one plus ``engine.attach`` and ``engine.backward``. Batches are Poisson-sampled,
as the privacy accounting assumes. The images are generated: a bright square whose corner
(one of four) is the class, on noise.

    python examples/timm_classification.py --model vit        # ViT (class token, position embedding)
    python examples/timm_classification.py --model deit       # DeiT with distillation token
    python examples/timm_classification.py --model resnet-gn  # ResNet with GroupNorm instead of BatchNorm
    python examples/timm_classification.py --model convnext   # ConvNeXt (depthwise convs, LayerNorm2d)
    python examples/timm_classification.py --tiny --epochs 1  # the CI smoke run
"""
from __future__ import annotations

import argparse
from functools import partial

import timm
import torch
import torch.nn.functional as F
from timm.layers import GroupNorm

import dptrain
from dptrain.data import poisson_loader

CLASSES = 4


def corner_squares(n: int, size: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    half = size // 2
    for i in range(n):
        r, c = divmod(int(y[i]), 2)
        x[i, :, r * half:(r + 1) * half, c * half:(c + 1) * half] += 1.5
    return torch.utils.data.TensorDataset(x, y)


def build(name: str, size: int, tiny: bool) -> torch.nn.Module:
    width = 16 if tiny else 64
    vit = dict(img_size=size, patch_size=size // 4, embed_dim=width, depth=1 if tiny else 4, num_heads=2,
               num_classes=CLASSES)
    if name == "vit":
        return timm.models.VisionTransformer(**vit)
    if name == "deit":
        return timm.models.deit.VisionTransformerDistilled(**vit)
    if name == "resnet-gn":  # BatchNorm mixes samples: timm builds the ResNet with GroupNorm instead
        return timm.create_model("resnet18", pretrained=False, num_classes=CLASSES,
                                 norm_layer=partial(GroupNorm, num_groups=4))
    if name == "convnext":  # layer scale off: see docs/models.md
        dims = (8, 8, 16, 16) if tiny else (32, 64, 128, 256)
        return timm.models.convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=dims, ls_init_value=None,
                                             num_classes=CLASSES)
    raise ValueError(f"unknown model {name!r}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit", choices=["vit", "deit", "resnet-gn", "convnext"])
    parser.add_argument("--tiny", action="store_true", help="a very small model and dataset (CI)")
    parser.add_argument("--epochs", type=float, default=5)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--clipping-mode", default="bk-mixopt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    size = 32
    train = corner_squares(256 if args.tiny else 4000, size, args.seed)
    test = corner_squares(128 if args.tiny else 1000, size, args.seed + 1)
    batch_size = 32 if args.tiny else 256

    model = build(args.model, size, args.tiny)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    engine = dptrain.PrivacyEngine(
        model, batch_size=batch_size, sample_size=len(train), max_grad_norm=1.0,
        target_epsilon=args.epsilon, epochs=args.epochs, clipping_mode=args.clipping_mode,
    )
    engine.attach(optimizer)
    loader = poisson_loader(train, batch_size=batch_size, generator=torch.Generator().manual_seed(args.seed))

    steps = 0
    model.train()
    while steps < engine.planned_steps:
        for x, y in loader:
            if steps == engine.planned_steps:
                break
            engine.backward(F.cross_entropy(model(x), y, reduction="none"))  # an empty batch adds noise only
            optimizer.step()
            optimizer.zero_grad()
            steps += 1

    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    epsilon = engine.get_epsilon()
    engine.detach()
    print(f"{args.model}: {steps} private steps, test accuracy {accuracy:.3f}, "
          f"epsilon {epsilon:.2f} (delta {engine.target_delta:.1e})")
    return {"accuracy": accuracy, "epsilon": epsilon, "steps": steps}


if __name__ == "__main__":
    main()
