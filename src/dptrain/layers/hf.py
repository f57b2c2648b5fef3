"""Rules for Hugging Face transformers' own layers, matched by qualified class name.

Nothing here imports transformers: a rule names its class as a string, so models from
the optional ``transformers`` extra are covered when present and nothing is paid otherwise.
"""
from __future__ import annotations

import math

import torch

from .base import LayerDims, register_layer
from .linear import LinearRule
from .norms import _AffineNormRule


@register_layer
class Conv1DRule(LinearRule):
    """GPT-2's ``Conv1D``: a linear layer whose weight is stored transposed, [in, out]."""

    module_types = ("transformers.pytorch_utils.Conv1D",)

    def dims(self, module, activation, output):
        return LayerDims(T=math.prod(activation.shape[1:-1]), p=module.nf, d=module.nx)

    def per_sample_grads(self, module, ops, names):
        out = super().per_sample_grads(module, ops, names)
        if "weight" in out:
            out["weight"] = out["weight"].transpose(1, 2)
        return out

    def weight_factors(self, module, ops):
        a, g = ops
        return a, g

    def clipped_grads(self, module, ops, factors):
        out = super().clipped_grads(module, ops, factors)
        if "weight" in out:
            out["weight"] = out["weight"].t()
        return out


@register_layer
class HFRMSNormRule(_AffineNormRule):
    """T5's and Llama's RMS norms: weight * x / sqrt(mean(x^2) + eps), statistics in float32."""

    module_types = (
        "transformers.models.t5.modeling_t5.T5LayerNorm",
        "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    )
    param_names = ("weight",)

    def dims(self, module, activation, output):
        n = module.weight.numel()
        return LayerDims(T=activation.numel() // max(1, activation.shape[0] * n), p=n, d=1, ghost_supported=False)

    def channels_last(self, module, t):
        return t

    def capture(self, module, inputs, output):
        return inputs[0].detach()

    def normalized(self, module, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        xhat = x * torch.rsqrt(variance + module.variance_epsilon)
        return xhat.to(module.weight.dtype) if module.weight.dtype in (torch.float16, torch.bfloat16) else xhat

