"""nn.Linear with inputs [B, ..., d]: every middle dim is a token axis."""
from __future__ import annotations

import math

import torch
from torch import nn

from .numerics import accumulation_dtype, flatten_tokens, float32_at_least, wide_matmul
from .protocol import LayerDims, LayerRule, expand_input_rows
from .registry import register_layer


def token_products(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``sum_t g_t^T a_t`` per sample, ``[B, p, d]`` from ``g [B, T, p]`` and ``a [B, T, d]``: a linear layer's
    per-sample weight gradients. One ``bmm`` (``einsum`` reaches the same kernel after a few times its host time)."""
    return torch.bmm(g.transpose(1, 2), a)


def gram_inner(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_{t,s} (a_t . a_s)(g_t . g_s) per sample, for a [B, T, d] and g [B, T, p].

    This is ||a^T g||_F^2 computed from two T x T Gram matrices (the ghost norm). With T = 1
    the Grams are scalars and the product of squared norms is all that is needed.
    """
    if a.shape[1] == 1:
        a, g = float32_at_least(a), float32_at_least(g)
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    gram_a = wide_matmul(a, a.transpose(1, 2))
    gram_g = wide_matmul(g, g.transpose(1, 2))
    return (gram_a * gram_g).sum((1, 2))


@register_layer
class LinearRule(LayerRule):
    module_types: tuple[type[nn.Module] | str, ...] = (nn.Linear,)
    rows_fold_into_tokens = True
    expand_batch = expand_input_rows

    def dims(self, module, activation, output):
        T = math.prod(activation.shape[1:-1])
        return LayerDims(T=T, p=module.out_features, d=module.in_features)

    def operands(self, module, activation, grad_output):
        # Under autocast a float32 input enters the matmul rounded to the output's dtype: the
        # per-sample gradient (and its ghost norm) is that of the rounded input.
        return flatten_tokens(activation.to(grad_output.dtype)), flatten_tokens(grad_output)

    def ghost_sq_norm(self, module, ops):
        a, g = ops
        return gram_inner(a, g)

    def per_sample_grads(self, module, ops, names):
        a, g = ops
        out = {}
        if "weight" in names:
            out["weight"] = token_products(g, a.to(g.dtype))
        if "bias" in names:
            out["bias"] = g.sum(1, dtype=accumulation_dtype(g.dtype))
        return out

    def weight_factors(self, module, ops):
        a, g = ops
        return g, a
