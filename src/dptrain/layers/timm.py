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
from torch import nn

from .hf import TokenParamsRule, _check_positions
from .linear import token_products
from .norms import AffineNormRule, GroupNormRule, LayerNormRule, _TrailingDimsNorm
from .numerics import accumulation_dtype
from .protocol import CaptureSite, LayerDims, LayerRule
from .registry import reads_child_params, register_layer


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
class TimmLayerNorm2dRule(AffineNormRule):
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
        return {"gamma": ops[0].sum(1, dtype=accumulation_dtype(ops[0].dtype))}


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
                "dynamic_img_size=True resamples pos_embed to each input size (bicubic interpolation), whose "
                "per-sample gradient is not supported: build the model with dynamic_img_size=False, or freeze "
                "pos_embed"
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


# --------------------------------------------------------------------------- layer scale and attention inside blocks
# These parameters act between two submodules of a block (gamma * f(x), a bias table added to the
# attention scores), so their rules read the activation at one point and the gradient at another:
# the engine's capture sites.


class _ProductScaleRule(LayerRule):
    """Parameters ``gamma`` applied as ``gamma * f(x)`` before a submodule ``t`` (a drop-path): the
    per-sample gradient is sum over positions of ``f(x)_i * g_i`` with ``g`` the gradient at ``t``'s input."""

    captures_input = True

    def scales(self, module) -> list[tuple[str, nn.Module, nn.Module, bool]]:
        """[(parameter name, the module computing f(x), the module receiving gamma * f(x), channels first?)]."""
        raise NotImplementedError

    def capture_sites(self, module):
        return [CaptureSite(target, source=source) for _, source, target, _ in self.scales(module)]

    def capture_at(self, module, site, inputs, tensor):
        return site, inputs[0]

    def dims(self, module, activation, output):
        site, f = activation
        n = getattr(module, self.scales(module)[site][0]).numel()
        return LayerDims(T=f.numel() // max(1, f.shape[0] * n), p=n, d=1, ghost_supported=False)

    def operands(self, module, activation, grad_output):
        site, f = activation
        name, _, _, channels_first = self.scales(module)[site]
        if channels_first:
            grad_output = grad_output.movedim(1, -1)
        prod = f.to(grad_output.dtype) * grad_output
        return ((name, prod.reshape(prod.shape[0], -1, prod.shape[-1]).sum(1)),)

    def concat_calls(self, calls):
        return tuple(op for call in calls for op in call)

    def per_sample_grads(self, module, ops, names):
        out = {}
        for name, grad in ops:
            if name in names:
                out[name] = grad if name not in out else out[name] + grad
        for name in names:
            if name not in out:
                out[name] = ops[0][1].new_zeros(ops[0][1].shape[0], getattr(module, name).numel())
        return out


@register_layer
class ConvNeXtBlockRule(_ProductScaleRule):
    """ConvNeXt's layer scale: ``x = mlp(norm(conv_dw(x))) * gamma`` then ``drop_path(x) + shortcut``."""

    module_types = ("timm.models.convnext.ConvNeXtBlock",)
    param_names = ("gamma",)

    def scales(self, module):
        # the MLP's output is channels-last unless the block uses 1x1 convolutions (conv_mlp)
        return [("gamma", module.mlp, module.drop_path, True)]

    def capture_at(self, module, site, inputs, tensor):
        f = inputs[0]
        return site, (f.movedim(1, -1) if module.use_conv_mlp else f)


@register_layer
class BeitBlockRule(_ProductScaleRule):
    """BEiT's layer scales: ``x + drop_path1(gamma_1 * attn(...))``, ``x + drop_path2(gamma_2 * mlp(...))``."""

    module_types = ("timm.models.beit.Block",)
    param_names = ("gamma_1", "gamma_2")

    def scales(self, module):
        return [("gamma_1", module.attn, module.drop_path1, False), ("gamma_2", module.mlp, module.drop_path2, False)]


@register_layer
class BeitAttentionRule(LayerRule):
    """BEiT attention: q and v biases (added through ``F.linear(x, qkv.weight, [q_bias, 0, v_bias])``,
    so the rule also takes over ``qkv.weight``) and the relative position bias table added to the scores.

    Per sample, the attention is recomputed from its input ``x`` and back-propagated from the
    gradient at ``proj``'s input: that gives the gradient of the qkv projection (for the weight
    and the biases) and of the scores (scattered into the table by ``relative_position_index``).
    """

    module_types = ("timm.models.beit.Attention",)
    param_names = ("q_bias", "v_bias", "relative_position_bias_table", "qkv.weight")
    captures_input = True

    def claims(self, module):
        return ("qkv.weight",) if module.q_bias is not None else ()  # without biases qkv is called as a layer

    def validate(self, module):
        if module.qkv_bias_separate:
            raise ValueError("BEiT Attention(qkv_bias_separate=True) adds its q/v biases in place on the qkv output, "
                             "which is not supported: use qkv_bias_separate=False")
        if module.attn_drop.p > 0:
            raise ValueError(
                "BEiT Attention with attention dropout: the rule recomputes the attention per sample and cannot "
                "redraw the forward's dropout mask; build the model with attn_drop_rate=0"
            )

    def capture_sites(self, module):
        return [CaptureSite(module.proj, source=module, source_input=True)]

    def capture_at(self, module, site, inputs, tensor):
        return inputs[0]  # the attention's input x

    def dims(self, module, activation, output):
        return LayerDims(T=activation.shape[1], p=module.qkv.out_features, d=module.qkv.in_features,
                         ghost_supported=False)

    def operands(self, module, x, grad):
        """(x, dL/dqkv [B, N, 3A], dL/dscores [B, H, N, N] or None) for one call."""
        B, N, _ = x.shape
        bias = None
        if module.q_bias is not None:
            bias = torch.cat((module.q_bias, module.k_bias, module.v_bias)).detach()
        with torch.enable_grad():
            qkv = F.linear(x.to(grad.dtype), module.qkv.weight.detach().to(grad.dtype),
                           None if bias is None else bias.to(grad.dtype)).requires_grad_()
            q, k, v = qkv.reshape(B, N, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            scores = (q * module.scale) @ k.transpose(-2, -1)
            if module.relative_position_bias_table is not None:
                scores = scores + module._get_rel_pos_bias().detach().to(grad.dtype)
            context = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, -1)
            wanted = [qkv, scores] if module.relative_position_bias_table is not None else [qkv]
            grads = torch.autograd.grad(context, wanted, grad_outputs=grad)
        return ((x, grads[0], grads[1] if len(grads) > 1 else None),)

    def concat_calls(self, calls):
        return tuple(op for call in calls for op in call)

    def per_sample_grads(self, module, ops, names):
        out = {}

        def add(name, value):
            out[name] = value if name not in out else out[name] + value

        A = module.qkv.out_features // 3
        for x, dqkv, dscores in ops:
            if "qkv.weight" in names:
                add("qkv.weight", token_products(dqkv, x.to(dqkv.dtype)))
            if "q_bias" in names:
                add("q_bias", dqkv[..., :A].sum(1))
            if "v_bias" in names:
                add("v_bias", dqkv[..., 2 * A:].sum(1))
            if "relative_position_bias_table" in names:
                table = module.relative_position_bias_table
                B, H = dscores.shape[:2]
                flat = dscores.permute(0, 2, 3, 1).reshape(B, -1, H)
                per_sample = flat.new_zeros(B, *table.shape)
                add("relative_position_bias_table",
                    per_sample.index_add_(1, module.relative_position_index.reshape(-1), flat))
        return out


@register_layer
class BeitSharedRelativePositionBiasRule(LayerRule):
    """Beit(use_shared_rel_pos_bias=True): one table whose bias every block adds to its scores."""

    module_types = ("timm.models.beit.RelativePositionBias",)
    param_names = ("relative_position_bias_table",)

    def validate(self, module):
        raise ValueError(
            "a relative position bias shared by all blocks (Beit(use_shared_rel_pos_bias=True)) is not supported: "
            "its bias enters every block's attention scores; use per-block tables (use_rel_pos_bias=True) or freeze it"
        )


def _fused_qkv_weight(module) -> tuple[str, ...]:
    """EVA's and Swin V2's attention with q/v biases compute ``F.linear(x, self.qkv.weight, cat(q_bias, k_bias,
    v_bias))`` themselves: ``qkv.weight`` is used in the attention's call, never in a call of ``qkv``."""
    fused = getattr(module, "qkv", None) is not None and getattr(module, "q_bias", None) is not None
    return ("qkv.weight",) if fused and not getattr(module, "qkv_bias_separate", False) else ()


reads_child_params("timm.models.eva.EvaAttention", _fused_qkv_weight)
# Swin V2's window attention also runs its continuous position bias MLP (cpb_mlp) on coordinates, without the
# batch. (It runs on windows folded into the batch, which the fallback does not regroup yet.)
reads_child_params("timm.models.swin_transformer_v2.WindowAttention",
                   lambda module: _fused_qkv_weight(module) + _parameters_of("cpb_mlp")(module))


def _parameters_of(*children: str):
    """Every parameter under the named children, as dotted names: for a module that uses them on a table
    without the batch (coordinates) and broadcasts the result over its batch output itself."""
    def names(module) -> tuple[str, ...]:
        return tuple(f"{child}.{name}" for child in children if getattr(module, child, None) is not None
                     for name, _ in getattr(module, child).named_parameters())
    return names


# timm's RelPosAttention adds rel_pos.get_bias() (an MLP on coordinates: no batch) to its scores, or calls
# rel_pos(attn) (RelPosMlp: attn + the same bias): either way inside the attention's call, whose replay per sample
# gives the MLP's per-sample gradients.
reads_child_params("timm.models.vision_transformer_relpos.RelPosAttention", _parameters_of("rel_pos"))
# MaxViT's and CoAtNet's attention read rel_pos.get_bias() the same way (on windows or grids folded into the batch).
reads_child_params("timm.models.maxxvit.AttentionCl", _parameters_of("rel_pos"))
reads_child_params("timm.models.maxxvit.Attention2d", _parameters_of("rel_pos"))
