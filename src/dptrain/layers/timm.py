"""Rules for timm's own layers and for the parameters its models hold outside any layer.

Nothing here imports timm: rules name their classes as strings. Covered: timm's LayerNorm,
its channels-first LayerNorm2d (ConvNeXt), GroupNorm / GroupNorm1 and RmsNorm variants;
LayerScale / LayerScale2d; the class / register / distillation tokens and absolute position
embeddings of VisionTransformer (ViT, DeiT, DeiT-distilled), Beit and CrossVit, which timm
keeps on the model itself and adds to the tokens before the position dropout.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import LayerDims, LayerRule, register_layer
from .hf import TokenParamsRule, _check_positions
from .norms import GroupNormRule, LayerNormRule, _AffineNormRule, _TrailingDimsNorm


# --------------------------------------------------------------------------- norms
@register_layer
class TimmLayerNormRule(LayerNormRule):
    """timm's LayerNorm: nn.LayerNorm's computation (optionally through apex / a fused kernel)."""

    module_types = ("timm.layers.norm.LayerNorm",)


@register_layer
class TimmLayerNormFp32Rule(LayerNormRule):
    """LayerNormFp32: normalises in float32 whatever the input dtype, as the forward does."""

    module_types = ("timm.layers.norm.LayerNormFp32",)

    def normalized(self, module, x):
        return F.layer_norm(x.float(), module.normalized_shape, eps=module.eps).to(x.dtype)


@register_layer
class TimmLayerNorm2dRule(_AffineNormRule):
    """LayerNorm2d: a LayerNorm over the channels of an NCHW tensor (ConvNeXt's stem, downsampling
    and head norms). The affine parameters act per channel, at every spatial position."""

    module_types = ("timm.layers.norm.LayerNorm2d",)

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() != 4:
            raise ValueError(f"LayerNorm2d expects inputs [B, C, H, W], got shape {tuple(x.shape)}")
        return x.detach()

    def dims(self, module, activation, output):
        return LayerDims(T=math.prod(activation.shape[2:]), p=activation.shape[1], d=1, ghost_supported=False)

    def channels_last(self, module, t):
        return t.permute(0, 2, 3, 1)

    def normalized(self, module, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), module.normalized_shape, eps=module.eps).permute(0, 3, 1, 2)


@register_layer
class TimmLayerNorm2dFp32Rule(TimmLayerNorm2dRule):
    module_types = ("timm.layers.norm.LayerNorm2dFp32",)

    def normalized(self, module, x):
        return super().normalized(module, x.float()).to(x.dtype)


@register_layer
class TimmGroupNormRule(GroupNormRule):
    """timm's GroupNorm (channels as first argument) and GroupNorm1: nn.GroupNorm's computation."""

    module_types = ("timm.layers.norm.GroupNorm", "timm.layers.norm.GroupNorm1")


@register_layer
class TimmRmsNormRule(_TrailingDimsNorm):
    module_types = ("timm.layers.norm.RmsNorm",)
    param_names = ("weight",)

    def normalized(self, module, x):
        dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
        return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + module.eps)


@register_layer
class TimmRmsNorm2dRule(TimmLayerNorm2dRule):
    """RmsNorm2d: RMS over the channels of an NCHW tensor, one weight per channel."""

    module_types = ("timm.layers.norm.RmsNorm2d",)
    param_names = ("weight",)

    def normalized(self, module, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + module.eps)


# --------------------------------------------------------------------------- layer scale
class _ScaleRule(LayerRule):
    """y = x * gamma with one gamma per channel: dL_i/dgamma = sum over positions of x_i * g_i."""

    param_names = ("gamma",)

    def validate(self, module):
        if module.inplace:
            raise ValueError(
                f"{type(module).__name__}(inplace=True) overwrites its input, which the per-sample gradient of "
                "gamma needs: build the model with inplace layer scale off"
            )

    def channels_last(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def dims(self, module, activation, output):
        n = module.gamma.numel()
        return LayerDims(T=activation.numel() // max(1, activation.shape[0] * n), p=n, d=1, ghost_supported=False)

    def operands(self, module, activation, grad_output):
        prod = self.channels_last(activation.to(grad_output.dtype) * grad_output)
        return (prod.reshape(prod.shape[0], -1, module.gamma.numel()),)

    def per_sample_grads(self, module, ops, names):
        return {"gamma": ops[0].sum(1)}

    def clipped_grads(self, module, ops, factors):
        return {"gamma": factors["gamma"].to(ops[0].dtype) @ ops[0].sum(1)}


@register_layer
class LayerScaleRule(_ScaleRule):
    module_types = ("timm.layers.layer_scale.LayerScale",)


@register_layer
class LayerScale2dRule(_ScaleRule):
    module_types = ("timm.layers.layer_scale.LayerScale2d",)

    def channels_last(self, t):
        return t.permute(0, 2, 3, 1)


# --------------------------------------------------------------------------- tokens on the model
_KNOWN_POS_EMBED = {
    # the token layouts of these _pos_embed implementations are written out in slots()
    "timm.models.vision_transformer.VisionTransformer._pos_embed": "vit",
    "timm.models.deit.VisionTransformerDistilled._pos_embed": "distilled",
}


@register_layer
class TimmVisionTransformerRule(TokenParamsRule):
    """VisionTransformer (ViT, DeiT, DeiT-III, with register tokens) and VisionTransformerDistilled.

    ``_pos_embed`` puts the class token, then register tokens (or DeiT's distillation token),
    then the patches, and adds ``pos_embed`` to every token or, with ``no_embed_class``, to the
    patches only; its result goes through ``pos_drop``, whose input gradient gives them all.
    """

    module_types = ("timm.models.vision_transformer.VisionTransformer",)
    param_names = ("cls_token", "reg_token", "dist_token", "pos_embed")

    def _layout(self, module) -> str | None:
        fn = type(module)._pos_embed
        return _KNOWN_POS_EMBED.get(f"{fn.__module__}.{fn.__qualname__}")

    def validate(self, module):
        if self._layout(module) is None:
            raise ValueError(
                f"{type(module).__name__} overrides VisionTransformer._pos_embed, so where its tokens and position "
                "embedding land is unknown: register a rule for it, or freeze cls_token / reg_token / pos_embed"
            )
        if module.dynamic_img_size and module.pos_embed is not None and module.pos_embed.requires_grad:
            raise ValueError(
                "dynamic_img_size=True resamples pos_embed to each input size (bicubic interpolation), whose per-sample "
                "gradient is not supported: build the model with dynamic_img_size=False, or freeze pos_embed"
            )

    def hook_target(self, module):
        # without a position embedding _pos_embed returns before pos_drop; patch_drop comes right after
        return module.pos_drop if module.pos_embed is not None else module.patch_drop

    def slots(self, module, tokens):
        prefix = ["cls_token", "dist_token"] if self._layout(module) == "distilled" else ["cls_token", "reg_token"]
        out, start = {}, 0
        for name in prefix:
            param = getattr(module, name, None)
            if param is not None:
                out[name] = slice(start, start + param.shape[1])
                start += param.shape[1]
        if module.pos_embed is not None:
            out["pos_embed"] = _check_positions(module, tokens, module.pos_embed, start if module.no_embed_class else 0)
        return out


@register_layer
class TimmBeitRule(TokenParamsRule):
    """Beit: class token then patches, plus an optional absolute position embedding, before pos_drop."""

    module_types = ("timm.models.beit.Beit",)
    param_names = ("cls_token", "pos_embed")

    def hook_target(self, module):
        return module.pos_drop

    def slots(self, module, tokens):
        out = {"cls_token": slice(0, 1)}
        if module.pos_embed is not None:
            out["pos_embed"] = _check_positions(module, tokens, module.pos_embed, 0)
        return out


@register_layer
class TimmCrossVitRule(TokenParamsRule):
    """CrossVit: each branch puts its class token before its patches, adds its position embedding
    and goes through the shared pos_drop; the branch of a call is told by its token shape."""

    module_types = ("timm.models.crossvit.CrossVit",)
    param_names = ("cls_token_0", "cls_token_1", "pos_embed_0", "pos_embed_1")

    def validate(self, module):
        if module.num_branches != 2:
            raise ValueError(f"CrossVit with {module.num_branches} branches is not supported (timm builds two)")
        if module.pos_embed_0.shape == module.pos_embed_1.shape:
            raise ValueError(
                "CrossVit branches with the same token count and width cannot be told apart at pos_drop: use "
                "different patch sizes or widths per branch, or freeze the class tokens and position embeddings"
            )

    def hook_target(self, module):
        return module.pos_drop

    def slots(self, module, tokens):
        for i in range(2):
            pos = getattr(module, f"pos_embed_{i}")
            if tuple(tokens.shape[1:]) == tuple(pos.shape[1:]):
                return {f"cls_token_{i}": slice(0, 1), f"pos_embed_{i}": slice(0, pos.shape[1])}
        raise ValueError(
            f"CrossVit: a sequence of shape {tuple(tokens.shape[1:])} at pos_drop matches neither branch's position "
            "embedding"
        )
