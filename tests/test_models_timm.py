"""timm models, built from tiny configs with random weights, against the per-sample oracle.

Every clipping mode, through engine.backward(per-sample losses) and through a plain
loss.backward() (single-backward modes), must give the oracle's clipped gradient in float64.
Dropout and stochastic depth are 0 (the oracle's one-sample forwards would draw other masks).
"""
from __future__ import annotations

import functools
from functools import partial

import pytest
import torch
from torch import nn

import dptrain
from helpers import (
    MODES,
    RTOL,
    SINGLE_BACKWARD_MODES,
    Case,
    assert_matches,
    classify,
    default_dtype,
    engine_clipped_sum,
    reweighted_reference,
    spread_init,
    with_oracle,
)

timm = pytest.importorskip("timm")
from timm.layers import norm as timm_norm  # noqa: E402
from timm.layers.layer_scale import LayerScale, LayerScale2d  # noqa: E402

B = 4
VIT = dict(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0, num_classes=3)


def _images(seed, size=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, size, size, generator=g), torch.randint(0, 3, (B,), generator=g)


def _case(model, seed, size=16):
    return Case(spread_init(model).double().train(), classify, _images(seed, size))


def vit_case():
    torch.manual_seed(0)
    return _case(timm.models.VisionTransformer(**VIT, qkv_bias=True), 0)


def vit_registers_case():
    """Register tokens, LayerScale, position embedding on the patches only, average pooling."""
    torch.manual_seed(1)
    model = timm.models.VisionTransformer(**VIT, reg_tokens=2, init_values=0.1, no_embed_class=True,
                                          global_pool="avg")
    return _case(model, 1)


def vit_no_pos_embed_case():
    """No position embedding: the class token is read at patch_drop instead of pos_drop."""
    torch.manual_seed(2)
    return _case(timm.models.VisionTransformer(**VIT, pos_embed="none"), 2)


def deit_distilled_case():
    torch.manual_seed(3)
    return _case(timm.models.deit.VisionTransformerDistilled(**VIT), 3)


def beit_plain_case():
    """Beit's embeddings and blocks, without layer scale, q/v biases and relative position bias."""
    torch.manual_seed(4)
    model = timm.models.beit.Beit(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0,
                                  num_classes=3, qkv_bias=False, use_abs_pos_emb=True, init_values=None)
    return _case(model, 4)


def crossvit_case():
    """Two branches of different patch sizes sharing pos_drop; cross-attention between branches."""
    torch.manual_seed(5)
    model = timm.models.crossvit.CrossVit(img_size=16, patch_size=(8, 4), embed_dim=(16, 8), depth=((1, 1, 0),),
                                          num_heads=(2, 2), mlp_ratio=(2.0, 2.0, 1.0), num_classes=3)
    return _case(model, 5)


def convnext_case(conv_mlp: bool):
    """Depthwise 7x7 convolutions, channels-last LayerNorm + Linear MLP (or LayerNorm2d + 1x1 convs)."""
    torch.manual_seed(6)
    model = timm.models.convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 8, 16), ls_init_value=None,
                                          conv_mlp=conv_mlp, num_classes=3)
    return _case(model, 6, size=32)


def resnet_gn_case():
    torch.manual_seed(7)
    model = timm.models.resnet.ResNet(
        timm.models.resnet.BasicBlock, layers=(1, 1, 1, 1), channels=(4, 8, 8, 8), stem_width=8, num_classes=3,
        norm_layer=partial(timm_norm.GroupNorm, num_groups=2), zero_init_last=False,
    )
    return _case(model, 7)


class TimmLayers(nn.Module):
    """The timm norm and scale layers that the model cases above do not use."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.gn1 = timm_norm.GroupNorm1(4)
        self.rms2d = timm_norm.RmsNorm2d(4)
        self.ls2d = LayerScale2d(4, init_values=0.5)
        self.rms = timm_norm.RmsNorm(4)
        self.ls = LayerScale(4, init_values=0.5)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.ls2d(self.rms2d(self.gn1(self.conv(x))))
        h = torch.tanh(self.ls(self.rms(h.permute(0, 2, 3, 1))))
        return self.head(h.mean((1, 2)))


class TimmFp32Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.ln2d = timm_norm.LayerNorm2dFp32(4)
        self.ln = timm_norm.LayerNormFp32(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.ln2d(self.conv(x))).permute(0, 2, 3, 1)
        return self.head(torch.tanh(self.ln(h)).mean((1, 2)))


def timm_layers_case():
    torch.manual_seed(8)
    return _case(TimmLayers(), 8, size=5)


def timm_fp32_layers_case():
    torch.manual_seed(9)
    return _case(TimmFp32Layers(), 9, size=5)


def convnext_layer_scale_case(conv_mlp: bool):
    torch.manual_seed(10)
    model = timm.models.convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 8, 16), ls_init_value=0.5,
                                          conv_mlp=conv_mlp, num_classes=3)
    return _case(model, 10, size=32)


def beit_case(qkv_bias: bool = True):
    """BEiT as published: layer scale, q/v biases, a relative position bias table per block."""
    torch.manual_seed(11)
    model = timm.models.beit.Beit(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0,
                                  num_classes=3, qkv_bias=qkv_bias, use_abs_pos_emb=False, use_rel_pos_bias=True,
                                  init_values=1.0)
    return _case(model, 11)


# Layer scale products, BEiT's attention biases: rules that need the engine's capture sites
SITE_CASES = {  # parameters read between two submodules of a block (capture sites)
    "convnext-layer-scale": lambda: convnext_layer_scale_case(False),
    "convnext-conv-mlp-layer-scale": lambda: convnext_layer_scale_case(True),
    "beit": beit_case,
    "beit-no-qkv-bias": lambda: beit_case(qkv_bias=False),
}

CASES = {
    **SITE_CASES,
    "vit": vit_case,
    "vit-registers-layerscale": vit_registers_case,
    "vit-no-pos-embed": vit_no_pos_embed_case,
    "deit-distilled": deit_distilled_case,
    "beit-plain": beit_plain_case,
    "crossvit": crossvit_case,
    "convnext": lambda: convnext_case(False),
    "convnext-conv-mlp": lambda: convnext_case(True),
    "resnet-groupnorm": resnet_gn_case,
    "timm-layers": timm_layers_case,
    "timm-fp32-layers": timm_fp32_layers_case,
}

# These normalise in float32 by design, also in a float64 model: the oracle's one-sample backward
# and the batch backward round differently there, so they agree to float32 precision only (every
# other case is checked to 1e-10).
FLOAT32_INSIDE = {"timm-fp32-layers"}
FLOAT32_RTOL = 1e-6

@functools.cache
def built(name):
    return with_oracle(CASES[name])


def _engine(case, **kwargs):
    return engine_clipped_sum(case, quiet=True, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_engine_backward_matches_oracle(name, mode):
    case, R, ref = built(name)
    rtol = FLOAT32_RTOL if name in FLOAT32_INSIDE else RTOL
    assert_matches(_engine(case, mode=mode, max_grad_norm=R), ref, rtol=rtol, what=f"{name} {mode} engine.backward")


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_loss_backward_matches_oracle(name, mode):
    case, R, ref = built(name)
    rtol = FLOAT32_RTOL if name in FLOAT32_INSIDE else RTOL
    assert_matches(_engine(case, mode=mode, max_grad_norm=R, path="mean"), ref, rtol=rtol,
                   what=f"{name} {mode} loss.backward")


# --------------------------------------------------------------------------- refusals
def test_batchnorm_resnet_is_refused_with_the_fix():
    model = timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, layers=(1, 1, 1, 1), channels=(4, 4, 4, 4),
                                      stem_width=4)
    with pytest.raises(ValueError, match="GroupNorm"):
        dptrain.validate(model)


def test_dynamic_image_size_position_embedding_is_refused():
    model = timm.models.VisionTransformer(**VIT, dynamic_img_size=True)
    with pytest.raises(ValueError, match="dynamic_img_size"):
        dptrain.validate(model)
    model.pos_embed.requires_grad_(False)
    dptrain.validate(model)


def test_inplace_layer_scale_is_refused():
    model = timm.models.VisionTransformer(**VIT, init_values=0.1)
    model.blocks[0].ls1.inplace = True
    with pytest.raises(ValueError, match="inplace"):
        dptrain.validate(model)


def test_unknown_pos_embed_override_is_refused():
    class Shuffled(timm.models.VisionTransformer):
        def _pos_embed(self, x):
            return super()._pos_embed(x.flip(1))

    with pytest.raises(ValueError, match="_pos_embed"):
        dptrain.validate(Shuffled(**VIT))


def test_crossvit_branches_of_identical_shape_are_refused():
    model = timm.models.crossvit.CrossVit(img_size=16, patch_size=(8, 8), embed_dim=(16, 16), depth=((1, 1, 0),),
                                          num_heads=(2, 2), mlp_ratio=(2.0, 2.0, 1.0), num_classes=3)
    with pytest.raises(ValueError, match="told apart"):
        dptrain.validate(model)


def test_beit_shared_relative_position_bias_is_refused():
    model = timm.models.beit.Beit(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3,
                                  use_shared_rel_pos_bias=True, use_abs_pos_emb=False)
    with pytest.raises(ValueError, match="shared by all blocks"):
        dptrain.validate(model)


def test_beit_attention_dropout_is_refused():
    model = timm.models.beit.Beit(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3,
                                  attn_drop_rate=0.1, use_rel_pos_bias=True)
    with pytest.raises(ValueError, match="attention dropout"):
        dptrain.validate(model)


# --------------------------------------------------------------------------- EfficientViT's linear attention
class _Float64Attention(timm.models.efficientvit_mit.LiteMLA):
    """EfficientViT's LiteMLA with its attention kept in the model's dtype (timm's casts q, k, v to float32)."""

    def _attn(self, q, k, v):
        kv = k.transpose(-1, -2) @ v
        out = q @ kv
        return out[..., :-1] / (out[..., -1:] + self.eps)


class _ContextNet(nn.Module):
    """A conv stem, EfficientViT's context module (LiteMLA: a 1x1 conv with its norm for q, k, v; the multi-scale
    aggregation, a depthwise 5x5 conv padded to the same size then a 1x1 conv grouped by 3 x heads; the projection
    with its norm; BatchNorm swapped for GroupNorm by dptrain.fix) and a linear head."""

    def __init__(self, attention):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.context = attention(8, 8, dim=4, scales=(5,))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.context(torch.relu(self.stem(x))).mean((2, 3)))


def _context_case(attention):
    torch.manual_seed(5)
    return _case(dptrain.fix(_ContextNet(attention)), 5, size=6)


@pytest.mark.parametrize("mode,path", [(m, "engine") for m in MODES] + [(m, "mean") for m in SINGLE_BACKWARD_MODES])
def test_efficientvit_context_module_is_exact_in_float64(mode, path):
    """Every layer of the context module, ghost norms included, at float64 tolerance in every mode and path."""
    case, R, ref = with_oracle(lambda: _context_case(_Float64Attention))
    assert_matches(_engine(case, mode=mode, max_grad_norm=R, path=path), ref, what=f"{mode} {path}")


@pytest.mark.parametrize("mode", MODES)
def test_efficientvit_float32_attention_rounds_only_the_second_backward(mode):
    """timm's LiteMLA computes its attention in float32 inside a float64 model (issue 33's "ghost inexactness"). The
    single-backward modes (ghost norms included: bk, bk-mix-ghost) are exact to float64; the two-pass modes (ghost,
    fast-grad-clip, mix-ghost) back-propagate sum_i C_i L_i a second time, whose C_i-scaled gradients round in
    float32 there, where the oracle rounds unscaled ones and scales after: they are exact to float64 against that
    same re-weighted backward driven by the oracle's clipping factors, and to float32 precision against the oracle."""
    case, R, ref = with_oracle(lambda: _context_case(timm.models.efficientvit_mit.LiteMLA))
    got = _engine(case, mode=mode, max_grad_norm=R)
    if dptrain.RECIPES[mode].two_pass:
        assert_matches(got, ref, rtol=1e-5, what=f"{mode}: float32 inside the model")
        with default_dtype(torch.float64):
            ref = reweighted_reference(case, R)
    assert_matches(got, ref, what=f"{mode} engine.backward")
