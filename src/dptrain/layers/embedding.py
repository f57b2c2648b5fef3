"""nn.Embedding: the input is a one-hot matrix that is never formed.

For sample i with token ids x_i[t] and output gradients g_i[t], the weight gradient is the
scatter-add of g_i[t] into row x_i[t]. Its ghost norm is sum_{t,s} [x_t == x_s] g_t . g_s;
the padding row receives no gradient (torch zeroes it), so its positions are masked out.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .numerics import OneHot, float32_at_least
from .protocol import LayerDims, LayerRule
from .registry import register_layer


@register_layer
class EmbeddingRule(LayerRule):
    module_types = (nn.Embedding,)
    rows_fold_into_tokens = True
    param_names = ("weight",)

    def validate(self, module):
        if module.scale_grad_by_freq:
            raise ValueError(
                "nn.Embedding(scale_grad_by_freq=True) scales each gradient by token counts over the whole "
                "batch, which mixes samples and breaks per-sample clipping: set scale_grad_by_freq=False"
            )
        if module.sparse:
            raise ValueError(
                "nn.Embedding(sparse=True) is not supported: private gradients are dense after noise; use sparse=False"
            )
        if module.max_norm is not None:
            raise ValueError(
                "nn.Embedding(max_norm=...) renormalises the weight in place during the forward; "
                "this is not supported under private training: use max_norm=None"
            )

    def capture(self, module, inputs, output):
        ids = inputs[0]
        if ids.dim() == 0:
            raise ValueError("nn.Embedding got a single token id: private training needs ids of shape [B, ...]")
        return ids.detach()

    def expand_batch(self, module, activation, output, batch):
        return activation.expand(batch, *activation.shape[1:]), output.expand(batch, *output.shape[1:])

    def dims(self, module, activation, output):
        return LayerDims(T=math.prod(activation.shape[1:]), p=module.embedding_dim, d=module.num_embeddings)

    def operands(self, module, activation, grad_output):
        ids = activation.reshape(activation.shape[0], math.prod(activation.shape[1:]))
        g = grad_output.reshape(ids.shape[0], ids.shape[1], module.embedding_dim)
        if module.padding_idx is not None:
            g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
        return ids, g

    def ghost_sq_norm(self, module, ops):
        ids, g = ops
        g = float32_at_least(g)
        same_token = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g.dtype)
        return (same_token * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

    def per_sample_grads(self, module, ops, names):
        ids, g = ops
        B, T, p = g.shape
        per_sample = g.new_zeros(B, module.num_embeddings, p)
        per_sample.scatter_add_(1, ids.unsqueeze(-1).expand(B, T, p), g)
        return {"weight": per_sample}

    def weight_factors(self, module, ops):
        ids, g = ops
        return OneHot(ids, module.num_embeddings), g
