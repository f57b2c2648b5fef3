"""nn.Embedding: the input is a one-hot matrix that is never formed.

For sample i with token ids x_i[t] and output gradients g_i[t], the weight gradient is the
scatter-add of g_i[t] into row x_i[t]. Its ghost norm is sum_{t,s} [x_t == x_s] g_t . g_s;
the padding row receives no gradient (torch zeroes it), so its positions are masked out.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .numerics import OneHot, wide_matmul
from .protocol import LayerDims, LayerRule, expand_input_rows
from .registry import register_layer


@register_layer
class EmbeddingRule(LayerRule):
    module_types: tuple[type[nn.Module] | str, ...] = (nn.Embedding,)
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

    expand_batch = expand_input_rows

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
        gram = wide_matmul(g, g.transpose(1, 2))
        same_token = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(gram.dtype)
        return (same_token * gram).sum((1, 2))

    def per_sample_grads(self, module, ops, names):
        ids, g = ops
        B, T, p = g.shape
        per_sample = g.new_zeros(B, module.num_embeddings, p)
        per_sample.scatter_add_(1, ids.unsqueeze(-1).expand(B, T, p), g)
        return {"weight": per_sample}

    def weight_factors(self, module, ops):
        ids, g = ops
        return OneHot(ids, module.num_embeddings), g


def embed_scale(module: nn.Module):
    """The constant ``module`` multiplies its lookup by, if it is shaped like a scaled word embedding: an
    ``nn.Embedding`` subclass with its own forward, no children, one parameter ``weight``, and an
    ``embed_scale`` that is a number or a one-element tensor that needs no gradient; else ``None``."""
    if not isinstance(module, nn.Embedding) or type(module).forward is nn.Embedding.forward:
        return None
    if next(module.children(), None) is not None or [n for n, _ in module.named_parameters(recurse=False)] != ["weight"]:
        return None
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return scale
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.requires_grad:
        return scale
    return None


class NotAScaledEmbedding(ValueError):
    """A module recognised as a scaled embedding by its structure failed the numerical check."""


class ScaledEmbeddingRule(EmbeddingRule):
    """A word embedding whose forward only scales the lookup by a constant ``embed_scale`` (sqrt of the width:
    BART, mBART, M2M100, Gemma and about thirty other families in ``transformers``, each with its own class).
    The table's gradient is that of an ``nn.Embedding`` whose output gradient is ``g * embed_scale``, so it
    keeps the embedding's ghost norm (the fallback would form a vocabulary-sized per-sample gradient).

    Recognised by structure (``embed_scale``), not by class name; that the output is ``scale * lookup`` is
    checked numerically on the first call of each input shape, and a module that fails is refused. One
    instance per module (``dptrain.layers.resolve_rule`` builds it)."""

    module_types = ()

    def __init__(self) -> None:
        self._checked: set[tuple] = set()

    @staticmethod
    def _scale(module, like: torch.Tensor):
        scale = embed_scale(module)
        if isinstance(scale, torch.Tensor):  # the forwards multiply by the buffer in the table's dtype
            scale = scale.to(module.weight.dtype)
        return scale

    def capture(self, module, inputs, output):
        ids = super().capture(module, inputs, output)
        key = (tuple(ids.shape), output.dtype)
        if key not in self._checked and not output.is_meta:  # a meta tensor has shapes only (plan)
            with torch.no_grad():
                expected = F.embedding(ids, module.weight, module.padding_idx) * self._scale(module, output)
            tol = 4 * torch.finfo(output.dtype).eps * float(expected.abs().max()) if expected.numel() else 0.0
            if expected.shape != output.shape or not bool(((output - expected).abs() <= tol).all()):
                raise NotAScaledEmbedding(
                    f"{type(module).__name__} looks like a scaled word embedding (an nn.Embedding with an embed_scale) "
                    "but its output is not embed_scale times the lookup, so the embedding rule would give wrong "
                    "per-sample gradients: register a rule for it with dptrain.register_layer, or freeze its weight"
                )
            self._checked.add(key)
        return ids

    def operands(self, module, activation, grad_output):
        return super().operands(module, activation, grad_output * self._scale(module, grad_output))


def recognise_scaled_embedding(module: nn.Module) -> ScaledEmbeddingRule | None:
    """A rule for a module shaped like a scaled word embedding (``embed_scale``), or ``None``."""
    return ScaledEmbeddingRule() if embed_scale(module) is not None else None
