"""Affine normalisation layers: LayerNorm, GroupNorm, InstanceNorm1d/2d/3d, RMSNorm.

Their per-sample gradients are small (one value per channel), so they are always
instantiated: weight grad_i = sum_t xhat_i[t] * g_i[t], bias grad_i = sum_t g_i[t], with
xhat the normalised input recomputed from the saved input in the backward (Lee & Kifer
section 5.5). None of them mixes samples: the statistics are per sample.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerDims, LayerRule, accumulation_dtype, float32_at_least, register_layer, weighted_sum


class _AffineNormRule(LayerRule):
    """Operands are the per-sample sums over positions (sum_t xhat * g, sum_t g) as [B, 1, n], with
    n = the parameter's size: the per-sample gradients themselves, one row per call.

    They are formed in float32 (or wider) from low-precision activations and output gradients, as
    torch's own normalisation kernels accumulate them, and are tiny, so nothing of size T is kept.
    """

    def normalized(self, module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def channels_last(self, module, t: torch.Tensor) -> torch.Tensor:
        """[B, ..., n] view with the parameter's elements in the last dim."""
        raise NotImplementedError

    def operands(self, module, activation, grad_output):
        x = activation
        xhat = self.normalized(module, x)
        acc = accumulation_dtype(xhat.dtype, grad_output.dtype)
        B = x.shape[0]

        def summed(t):
            t = self.channels_last(module, t)
            return t.reshape(B, math.prod(t.shape[1:-1]), t.shape[-1]).sum(1, keepdim=True, dtype=acc)

        return summed(xhat.to(acc) * grad_output.to(acc)), summed(grad_output)

    def per_sample_grads(self, module, ops, names):
        scaled, g = ops
        out = {}
        if "weight" in names:
            out["weight"] = scaled.sum(1).reshape(scaled.shape[0], *module.weight.shape)
        if "bias" in names:
            out["bias"] = g.sum(1).reshape(g.shape[0], *module.bias.shape)
        return out

    def clipped_grads(self, module, ops, factors):
        per_sample = self.per_sample_grads(module, ops, set(factors))
        return {n: weighted_sum(factors[n], t) for n, t in per_sample.items()}


class _TrailingDimsNorm(_AffineNormRule):
    """Norms whose parameter covers the trailing ``normalized_shape`` dims (LayerNorm, RMSNorm)."""

    def dims(self, module, activation, output):
        n = math.prod(module.normalized_shape)
        return LayerDims(T=activation.numel() // max(1, activation.shape[0] * n), p=n, d=1, ghost_supported=False)

    def channels_last(self, module, t):
        k = len(module.normalized_shape)
        return t.reshape(*t.shape[: t.dim() - k], math.prod(module.normalized_shape))

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() <= len(module.normalized_shape):
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} with no batch dimension "
                f"before normalized_shape={tuple(module.normalized_shape)}"
            )
        return x.detach()


@register_layer
class LayerNormRule(_TrailingDimsNorm):
    module_types = (nn.LayerNorm,)

    def normalized(self, module, x):  # statistics in float32 for bf16/fp16 inputs, as torch's kernel
        return F.layer_norm(float32_at_least(x), module.normalized_shape, eps=module.eps)


if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_layer
    class RMSNormRule(_TrailingDimsNorm):
        module_types = (nn.RMSNorm,)
        param_names = ("weight",)

        def normalized(self, module, x):
            # torch computes in float32 for bf16/fp16 inputs, and its default eps is that of the
            # computation dtype (float32), not finfo(bfloat16).eps = 2^-7 (which, on activations of
            # small scale, would change the normalised values far beyond rounding)
            x = float32_at_least(x)
            eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
            dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
            return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)


class _ChannelNorm(_AffineNormRule):
    """Norms of [B, C, *spatial] inputs with one parameter per channel."""

    def dims(self, module, activation, output):
        return LayerDims(T=math.prod(activation.shape[2:]), p=activation.shape[1], d=1, ghost_supported=False)

    def channels_last(self, module, t):
        return t.reshape(t.shape[0], t.shape[1], math.prod(t.shape[2:])).transpose(1, 2)


@register_layer
class GroupNormRule(_ChannelNorm):
    module_types = (nn.GroupNorm,)

    def capture(self, module, inputs, output):
        return inputs[0].detach()

    def normalized(self, module, x):
        return F.group_norm(float32_at_least(x), module.num_groups, eps=module.eps)


@register_layer
class InstanceNormRule(_ChannelNorm):
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() != module._get_no_batch_dim() + 1:
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} without a batch dimension; "
                "private training needs batched inputs [B, C, ...]"
            )
        return x.detach()

    def normalized(self, module, x):
        return F.instance_norm(float32_at_least(x), eps=module.eps)
