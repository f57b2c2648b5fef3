#!/usr/bin/env python
"""Time the convolution rule's kernels against the alternatives, per layer shape (CPU or GPU).

The conv rule instantiates per-sample weight gradients (module 4) with the convolution's
weight-gradient kernel and the batch folded into the groups, and forms the clipped gradient
2b(C) with that kernel on C-scaled output gradients. Whether the folded groups beat a loop over
samples or unfolded patches with a batched matrix product depends on the backend (cuDNN's
grouped kernels, oneDNN on the CPU); this script measures it on ResNet-18 and VGG-11 layer
shapes at 224x224, and checks that the alternatives agree.

    python benchmarks/conv_kernels.py --batch 32                # cuda when available
    python benchmarks/conv_kernels.py --device cpu --batch 4 --out conv_kernels.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

try:
    from dptrain.layers.conv import ConvRule, unfold_patches, weight_grad
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from dptrain.layers.conv import ConvRule, unfold_patches, weight_grad

# (name, C_in, C_out, input side, kernel, stride, padding)
SHAPES = [
    ("resnet18 stem", 3, 64, 224, 7, 2, 3),
    ("resnet18 layer1", 64, 64, 56, 3, 1, 1),
    ("resnet18 layer2", 128, 128, 28, 3, 1, 1),
    ("resnet18 layer3", 256, 256, 14, 3, 1, 1),
    ("resnet18 layer4", 512, 512, 7, 3, 1, 1),
    ("vgg11 conv1", 3, 64, 224, 3, 1, 1),
    ("vgg11 conv2", 64, 128, 112, 3, 1, 1),
]


def timed(fn, device, repeats):
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_sample_folded(conv, x, g):
    return weight_grad(conv, x, g, batch_groups=True)


def per_sample_loop(conv, x, g):
    return torch.stack([weight_grad(conv, x[i:i + 1], g[i:i + 1]) for i in range(x.shape[0])])


def per_sample_unfold(conv, x, g):
    patches = unfold_patches(conv, x)  # [B, C_in*K, L]
    return torch.einsum("bpl,bdl->bpd", g.flatten(2), patches).reshape(x.shape[0], *conv.weight.shape)


def clipped_conv(conv, x, g, c):
    return weight_grad(conv, x, g * c.view(-1, 1, 1, 1))


def clipped_unfold(conv, x, g, c):
    patches = unfold_patches(conv, x)
    return torch.einsum("bpl,bdl->pd", g.flatten(2) * c.view(-1, 1, 1), patches).reshape(conv.weight.shape)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rule = ConvRule()
    rows = []
    print(f"conv rule kernels on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, batch {args.batch}, float32, median of {args.repeats} (ms)\n")
    print("| layer | per-sample: folded groups | loop | unfold+einsum | clipped: conv kernel | unfold+einsum "
          "| ghost norm (— where T is too large for it) | non-private weight grad |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cin, cout, side, k, stride, pad in SHAPES:
        torch.manual_seed(0)
        conv = nn.Conv2d(cin, cout, k, stride=stride, padding=pad).to(device)
        x = torch.randn(args.batch, cin, side, side, device=device)
        with torch.no_grad():
            g = torch.randn_like(conv(x))
        c = torch.rand(args.batch, device=device)
        ops = rule.operands(conv, x, g)
        folded = per_sample_folded(conv, x, g)
        scale = folded.abs().max().item()
        agree = max((per_sample_unfold(conv, x, g) - folded).abs().max().item(),
                    (clipped_unfold(conv, x, g, c) - clipped_conv(conv, x, g, c)).abs().max().item()) / scale
        if agree > 1e-3:
            raise AssertionError(f"{name}: the kernels disagree (relative {agree:.2g})")
        row = {"layer": name, "batch": args.batch, "relative_disagreement": agree}
        candidates = {
            "per_sample_folded": functools.partial(per_sample_folded, conv, x, g),
            "per_sample_loop": functools.partial(per_sample_loop, conv, x, g),
            "per_sample_unfold": functools.partial(per_sample_unfold, conv, x, g),
            "clipped_conv": functools.partial(clipped_conv, conv, x, g, c),
            "clipped_unfold": functools.partial(clipped_unfold, conv, x, g, c),
            "ghost_norm": functools.partial(rule.ghost_sq_norm, conv, ops),
            "non_private": functools.partial(weight_grad, conv, x, g),
        }
        T = g[0, 0].numel()
        if 2 * T * T > 64 * conv.weight.numel():  # far past where any decision rule takes the ghost norm
            del candidates["ghost_norm"]
        for key in ("per_sample_folded", "per_sample_loop", "per_sample_unfold", "clipped_conv", "clipped_unfold",
                    "ghost_norm", "non_private"):
            row.setdefault(key + "_ms", None)
        for key, fn in candidates.items():
            try:
                row[key + "_ms"] = timed(fn, device, args.repeats) * 1e3
            except RuntimeError as exc:  # out of memory: the figure is missing, the others stand
                row[key + "_ms"] = None
                row[key + "_error"] = str(exc).splitlines()[0][:200]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        rows.append(row)
        cells = ["—" if row[k] is None else f"{row[k]:.2f}" for k in row if k.endswith("_ms")]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
