"""nn.Conv1d/2d/3d: stride, dilation, groups, any padding and padding_mode.

The input is unfolded into patches (im2col), which turns the convolution into a linear
layer per group with T = number of output locations and d = C_in/groups * prod(kernel)
(mixed-ghost paper, section 3).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import (
    LayerDims,
    LayerRule,
    accumulation_dtype,
    float32_at_least,
    register_layer,
    scale_samples,
    weighted_sum,
)


def _explicit_padding(module: nn.modules.conv._ConvNd) -> list[int]:
    """F.pad amounts (last dim first) that reproduce the module's padding, 'same' included."""
    pads = getattr(module, "_reversed_padding_repeated_twice", None)
    if pads is not None:
        return [int(p) for p in pads]
    n = len(module.kernel_size)
    if module.padding == "valid":
        return [0] * (2 * n)
    if isinstance(module.padding, str):  # 'same': torch puts the odd pixel on the right
        out = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = d * (k - 1)
            out += [total // 2, total - total // 2]
        return out
    return [int(p) for i in reversed(range(n)) for p in (module.padding[i], module.padding[i])]


def unfold_patches(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """[B, C_in, *spatial] -> [B, C_in * prod(kernel), L] patches, channel-major like the weight."""
    n = len(module.kernel_size)
    pads = _explicit_padding(module)
    if any(pads):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pads, mode=mode)
    if n == 2:
        return F.unfold(x, module.kernel_size, dilation=module.dilation, stride=module.stride)
    # Generic N-d unfold: strided windows per spatial dim; dilation keeps every d-th element.
    for i, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    B, C = x.shape[:2]
    out_sizes = x.shape[2 : 2 + n]
    # [B, C, o_1..o_n, k_1..k_n] -> [B, C, k_1..k_n, o_1..o_n] -> [B, C*K, L]
    perm = [0, 1] + list(range(2 + n, 2 + 2 * n)) + list(range(2, 2 + n))
    return x.permute(perm).reshape(B, C * math.prod(module.kernel_size), math.prod(out_sizes))


@register_layer
class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    token_dim = 3  # operands are [B, groups, features, L]

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() != len(module.kernel_size) + 2:
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} without a batch dimension; "
                "private training needs batched inputs [B, C, ...]: add a batch dimension (x.unsqueeze(0))"
            )
        return x.detach()

    def dims(self, module, activation, output):
        g = module.groups
        T = math.prod(output.shape[2:])
        d = module.in_channels // g * math.prod(module.kernel_size)
        return LayerDims(T=T, p=module.out_channels // g, d=d, blocks=g)

    def operands(self, module, activation, grad_output):
        B, g = activation.shape[0], module.groups
        # the input as the convolution saw it: rounded to the compute dtype under autocast
        patches = unfold_patches(module, activation.to(grad_output.dtype))  # [B, C_in*K, L]
        L = patches.shape[-1]
        a = patches.reshape(B, g, patches.shape[1] // g, L)
        grad = grad_output.reshape(B, g, module.out_channels // g, L)
        return a, grad

    def ghost_sq_norm(self, module, ops):
        a, grad = float32_at_least(ops[0]), float32_at_least(ops[1])
        gram_a = torch.einsum("bgdt,bgds->bgts", a, a)
        gram_g = torch.einsum("bgpt,bgps->bgts", grad, grad)
        return (gram_a * gram_g).sum((1, 2, 3))

    def per_sample_grads(self, module, ops, names):
        a, grad = ops
        B = a.shape[0]
        out = {}
        if "weight" in names:
            w = torch.einsum("bgpt,bgdt->bgpd", grad, a.to(grad.dtype))
            out["weight"] = w.reshape(B, *module.weight.shape)
        if "bias" in names:
            out["bias"] = grad.sum(3, dtype=accumulation_dtype(grad.dtype)).flatten(1)
        return out

    def weight_factors(self, module, ops):
        if module.groups != 1:
            return None
        a, grad = ops
        return grad[:, 0].transpose(1, 2), a[:, 0].transpose(1, 2)

    def clipped_grads(self, module, ops, factors):
        a, grad = ops
        out = {}
        if "weight" in factors:
            weighted = scale_samples(grad, factors["weight"])
            w = torch.einsum("bgpt,bgdt->gpd", weighted, a.to(grad.dtype))
            out["weight"] = w.reshape(module.weight.shape)
        if "bias" in factors:
            out["bias"] = weighted_sum(factors["bias"], grad.sum(3, dtype=accumulation_dtype(grad.dtype)).flatten(1))
        return out
