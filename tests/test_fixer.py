"""dptrain.fixer.fix: swaps that make models private-trainable; validate finds nothing afterwards."""
from __future__ import annotations

import math
import os
from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.layers import fallback_modules
from dptrain.models.fixer import fix, planned_fixes
from dptrain.models.validation import find_problems
from dptrain.nn import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from dptrain.testing import assert_rule_exact

F64 = torch.float64


# ---------------------------------------------------------------------------- recurrent and attention swaps
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.rnn = nn.RNN(4, 4, nonlinearity="relu", batch_first=True)
        self.lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=True, proj_size=2, batch_first=True)
        self.gru = nn.GRU(4, 4, batch_first=True)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True)
        self.head = nn.Linear(4 + 4 + 4 + 4, 2)

    def forward(self, x):
        e = self.embed(x)
        outputs = [self.rnn(e)[0], self.lstm(e)[0], self.gru(e)[0], self.attention(e, e, e)[0]]
        return self.head(torch.cat(outputs, dim=-1))


def test_fix_swaps_recurrent_and_attention_modules_keeping_the_function():
    torch.manual_seed(0)
    model = Mixed().double()
    x = torch.randn(3, 5, 3, dtype=F64)
    expected = model(x)
    problems = find_problems(model)
    # (the batch-first attention the fallback takes, exact but slower than dptrain.nn's rules: fix swaps it too)
    assert len(problems) == 3 and all("no layer rule" in p for p in problems)
    assert "attention" in fallback_modules(model)

    fixed = fix(model)

    assert find_problems(fixed) == []
    types = {name: type(getattr(fixed, name)) for name in ("rnn", "lstm", "gru", "attention")}
    assert types == {"rnn": DPRNN, "lstm": DPLSTM, "gru": DPGRU, "attention": DPMultiheadAttention}
    assert fixed.rnn.nonlinearity == "relu" and fixed.lstm.proj_size == 2 and fixed.attention.bias_k is not None
    torch.testing.assert_close(fixed(x), expected, atol=1e-10, rtol=0)
    assert list(fixed.state_dict()) == list(model.state_dict())
    # a copy: the original is untouched
    assert type(model.lstm) is nn.LSTM and len(find_problems(model)) == 3


def test_fix_carries_frozen_flags_mode_and_dtype():
    model = Mixed().double().eval()
    model.lstm.weight_hh_l1_reverse.requires_grad_(False)
    model.attention.in_proj_weight.requires_grad_(False)
    fixed = fix(model)
    assert not fixed.lstm.hh_l1_reverse.weight.requires_grad and fixed.lstm.hh_l1.weight.requires_grad
    assert not any(p.requires_grad for p in (fixed.attention.q_proj.weight, fixed.attention.k_proj.weight,
                                             fixed.attention.v_proj.weight))
    assert fixed.attention.q_proj.bias.requires_grad
    assert not fixed.training and not fixed.gru.training
    assert all(p.dtype == F64 for p in fixed.parameters())


def test_fix_in_place_and_of_a_bare_module():
    model = Mixed()
    same = fix(model, inplace=True)
    assert same is model and isinstance(model.gru, DPGRU)
    lstm = nn.LSTM(3, 4)
    fixed = fix(lstm, inplace=True)  # the root itself is swapped: use the returned module
    assert isinstance(fixed, DPLSTM) and type(lstm) is nn.LSTM
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(fixed(x)[0], lstm(x)[0])


def test_a_module_registered_twice_stays_shared():
    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4), norm)
    fixed = fix(model)
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1] is fixed[3]


def test_subclasses_of_recurrent_modules_are_left_for_validate_to_report():
    class MyLSTM(nn.LSTM):
        def forward(self, x, hx=None):
            return super().forward(x.flip(0), hx)

    model = nn.Sequential(MyLSTM(3, 4))
    fixed = fix(model)
    assert type(fixed[0]) is MyLSTM
    assert planned_fixes(model) == []
    assert any("MyLSTM" in p for p in find_problems(fixed))


# ---------------------------------------------------------------------------- BatchNorm -> GroupNorm
def test_batchnorm_refusal_gives_its_path_and_points_to_fix():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match=r"the submodule '1\.1' \(BatchNorm1d\).*dptrain\.fix\(model\)"):
        dptrain.validate(model)
    assert find_problems(nn.BatchNorm1d(4))[0].startswith("the model itself (BatchNorm1d)")
    assert find_problems(fix(model)) == []


def test_batchnorm_becomes_groupnorm_with_weights_carried():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64, eps=1e-3), nn.Conv2d(64, 6, 1), nn.BatchNorm2d(6),
                          nn.Flatten(), nn.Linear(6, 3), nn.BatchNorm1d(3, affine=False))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    model[3].bias.requires_grad_(False)
    assert sum("BatchNorm" in p for p in find_problems(model)) == 2  # the affine=False one has no parameters

    plans = planned_fixes(model)
    assert [p.split(":")[0] for p in plans] == ["1", "3", "6"]
    assert plans[0].startswith("1: BatchNorm2d(64) -> GroupNorm(32, 64)")
    fixed = fix(model)

    norms = [fixed[1], fixed[3], fixed[6]]
    assert all(type(n) is nn.GroupNorm for n in norms)
    assert [(n.num_groups, n.num_channels, n.eps, n.affine) for n in norms] == [
        (32, 64, 1e-3, True), (2, 6, 1e-5, True), (1, 3, 1e-5, False)]
    assert torch.equal(fixed[1].weight, model[1].weight) and torch.equal(fixed[1].bias, model[1].bias)
    assert fixed[3].weight.requires_grad and not fixed[3].bias.requires_grad
    assert find_problems(fixed) == []
    assert fixed(torch.randn(2, 3, 3, 3)).shape == (2, 3)


def test_fix_leaves_a_model_without_problems_unchanged():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 2))
    assert planned_fixes(model) == []
    fixed = fix(model)
    assert [type(m) for m in fixed] == [type(m) for m in model]
    for a, b in zip(fixed.parameters(), model.parameters()):
        assert torch.equal(a, b) and a is not b


def test_fix_rejects_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        fix(nn.Linear(2, 2).weight)
    with pytest.raises(ValueError, match="num_groups"):
        fix(nn.BatchNorm1d(4), num_groups=0)
    with pytest.raises(ValueError, match="run one forward pass"):
        fix(nn.LazyBatchNorm1d())


# ---------------------------------------------------------------------------- exact training after fix
def classification_losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _images(size=16):
    g = torch.Generator().manual_seed(31)
    return torch.randn(3, 3, size, size, dtype=F64, generator=g), torch.tensor([1, 4, 7])


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # the oracle runs samples one at a time: dropout masks would differ
    return model


needs_torchvision = pytest.mark.skipif(find_spec("torchvision") is None, reason="torchvision is not installed")


def small_resnet():
    """torchvision's BasicBlock (in-place ReLU, ``out += identity``, BatchNorm downsample) at small width."""
    from torchvision.models.resnet import BasicBlock

    downsample = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        BasicBlock(8, 8), BasicBlock(8, 16, stride=2, downsample=downsample),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def small_vgg():
    """torchvision's VGG with BatchNorm (conv -> BN -> in-place ReLU), small features and head."""
    from torchvision.models.vgg import VGG, make_layers

    model = VGG(make_layers([8, "M", 16, "M", 16], batch_norm=True), num_classes=10)
    model.classifier = nn.Sequential(nn.Linear(16 * 7 * 7, 32), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(32, 10))
    return model


def small_densenet():
    """torchvision's DenseNet class (norm -> in-place ReLU -> conv, concatenations, transitions)."""
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=10)


@needs_torchvision
@pytest.mark.parametrize("make", [small_resnet, small_vgg, small_densenet], ids=["resnet", "vgg-bn", "densenet"])
def test_torchvision_architectures_train_exactly_after_fix(make):
    torch.manual_seed(32)
    model = make().double()
    assert any("BatchNorm" in p for p in find_problems(model))
    fixed = _no_dropout(fix(model)).train()
    assert find_problems(fixed) == []
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fixed.modules())
    assert any(getattr(m, "inplace", False) for m in fixed.modules()), "the in-place activations are kept"
    assert_rule_exact(fixed, _images(), losses_fn=classification_losses, modes=["bk-mixopt", "ghost"],
                      plain_backward=False)


def test_transformer_encoder_after_fix_keeps_the_function_and_trains_exactly():
    torch.manual_seed(33)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=F64)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    fixed = fix(model)
    g = torch.Generator().manual_seed(34)
    x = torch.randn(3, 5, 8, dtype=F64, generator=g)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    torch.testing.assert_close(fixed(x, src_key_padding_mask=padding), model(x, src_key_padding_mask=padding),
                               atol=1e-10, rtol=0)
    with torch.no_grad():  # eval: torch's fused inference path, reading the packed in_proj_weight
        torch.testing.assert_close(fixed.eval()(x), model.eval()(x), atol=1e-10, rtol=0)
    fixed.train()
    target = torch.randn(3, 5, 8, dtype=F64, generator=g)

    def losses(m, x, padding, target):
        return (m(x, src_key_padding_mask=padding) - target).square().sum((1, 2))

    assert_rule_exact(fixed, (x, padding, target), losses_fn=losses, plain_backward=False)


# ---------------------------------------------------------------------------- full-size models (slow, opt-in)
@needs_torchvision
@pytest.mark.skipif(os.environ.get("DPTRAIN_SLOW_TESTS") != "1",
                    reason="minutes on CPU in float64; set DPTRAIN_SLOW_TESTS=1")
@pytest.mark.parametrize("name", ["resnet18", "vgg11", "densenet121"])
def test_full_size_torchvision_models_train_exactly_after_fix(name):
    import torchvision

    torch.manual_seed(35)
    model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    fixed = _no_dropout(fix(model.double())).train()
    assert find_problems(fixed) == []
    assert_rule_exact(fixed, _images(32), losses_fn=classification_losses, modes=["bk-mixopt", "ghost"],
                      plain_backward=False)


# ---------------------------------------------------------------------------- what a BatchNorm did besides batch statistics
needs_timm = pytest.mark.skipif(find_spec("timm") is None, reason="timm is not installed")


def _leaf_types(model):
    """Counts of the leaf modules' classes (activations, pools, convs ...), nn.Identity aside."""
    from collections import Counter

    return Counter(type(m).__name__ for m in model.modules()
                   if next(m.children(), None) is None and not isinstance(m, nn.Identity))


@needs_timm
def test_a_fused_activation_stays():
    """timm's BatchNormAct2d (norm, then its act) becomes GroupNorm then the same act: the output is timm's
    GroupNormAct with the same weights, and a whole timm model keeps every activation."""
    import timm
    from timm.layers import BatchNormAct2d, GroupNormAct

    torch.manual_seed(40)
    bn = BatchNormAct2d(16, act_layer=nn.SiLU, eps=1e-3).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), bn, nn.Conv2d(16, 4, 1)).double()
    plans = planned_fixes(model)
    assert len(plans) == 1 and plans[0].startswith("1: BatchNormAct2d(16) -> Sequential(GroupNorm(16, 16), act=SiLU(inplace=True))")
    assert "keeps its act" in plans[0]
    fixed = fix(model)
    assert isinstance(fixed[1], nn.Sequential) and list(fixed[1]._modules) == ["norm", "act"]
    assert type(fixed[1].norm) is nn.GroupNorm and type(fixed[1].act) is nn.SiLU
    expected = GroupNormAct(16, num_groups=16, eps=1e-3, act_layer=nn.SiLU).double()
    expected.load_state_dict(fixed[1].norm.state_dict())
    x = torch.randn(2, 3, 6, 6, dtype=F64)
    torch.testing.assert_close(fixed(x), fixed[2](expected(fixed[0](x))), rtol=0, atol=1e-12)
    assert find_problems(fixed) == []
    assert_rule_exact(fixed, (x, torch.tensor([1, 3])),
                      losses_fn=lambda m, x, y: F.cross_entropy(m(x).mean((2, 3)), y, reduction="none"),
                      plain_backward=False)

    zoo = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10)
    before, after = _leaf_types(zoo), _leaf_types(fix(zoo))
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in zoo.modules())
    assert norms and after.pop("GroupNorm") == norms
    assert after == {k: v for k, v in before.items() if k not in ("BatchNormAct2d", "BatchNorm2d")}


def test_a_batchnorm_subclass_with_its_own_forward_is_left_for_validate_to_report():
    class ScaledBatchNorm(nn.BatchNorm1d):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(3, 4), ScaledBatchNorm(4))
    assert planned_fixes(model) == []
    fixed = fix(model)
    assert type(fixed[1]) is ScaledBatchNorm
    assert any("ScaledBatchNorm" in p and "dptrain.fix leaves it" in p for p in find_problems(fixed))


# ---------------------------------------------------------------------------- never one value per group
class SqueezeExcite(nn.Module):
    """A BatchNorm2d after global pooling ([N, C, 1, 1]) and a BatchNorm1d on [N, C] features."""

    def __init__(self, C=8, hidden=16):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3)
        self.reduce = nn.Conv2d(C, hidden, 1)
        self.bn_pooled = nn.BatchNorm2d(hidden)
        self.expand = nn.Conv2d(hidden, C, 1)
        self.bn_features = nn.BatchNorm1d(C)
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        s = torch.relu(self.bn_pooled(self.reduce(h.mean((2, 3), keepdim=True))))
        h = h * torch.sigmoid(self.expand(s))
        return self.head(torch.tanh(self.bn_features(h.mean((2, 3)))))


def _values_per_group(norm, x):
    return norm.num_channels // norm.num_groups * math.prod(x.shape[2:])


def test_no_groupnorm_holds_one_value_per_group():
    torch.manual_seed(41)
    model = SqueezeExcite().double()
    plans = dict(p.split(": ", 1) for p in planned_fixes(model))
    assert plans["bn_pooled"].startswith("BatchNorm2d(16) -> GroupNorm(16, 16) (GroupNorm(1, 16), a norm over all "
                                         "channels, if its first input has one value per channel")
    assert plans["bn_features"].startswith("BatchNorm1d(8) -> GroupNorm(8, 8) (GroupNorm(1, 8)")
    fixed = fix(model)
    seen = {}
    for name in ("bn_pooled", "bn_features"):
        getattr(fixed, name).register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, (m, i[0])) and None)
    x = torch.randn(3, 3, 6, 6, dtype=F64)
    fixed(x)
    assert seen["bn_pooled"][1].shape[2:] == (1, 1) and seen["bn_features"][1].dim() == 2
    for norm, inp in seen.values():
        assert norm.num_groups == 1 and _values_per_group(norm, inp) > 1
    # a batch of one works, and the norms' outputs depend on their inputs (not the bias alone)
    one = fixed(x[:1])
    assert torch.isfinite(one).all()
    out = fixed.bn_features(torch.randn(1, 8, dtype=F64))
    assert not torch.allclose(out, fixed.bn_features.bias.expand_as(out))
    assert find_problems(fixed) == []
    assert_rule_exact(fixed, (x, torch.tensor([0, 2, 1])), losses_fn=classification_losses, plain_backward=False)


def test_the_group_count_decided_at_the_first_call_holds_and_refuses_one_value_per_group():
    fixed = fix(nn.BatchNorm2d(8))
    assert (fixed.num_groups, fixed.num_channels) == (8, 8)
    fixed(torch.randn(2, 8, 3, 3))  # spatial input: one channel per group, 9 values each
    assert fixed.num_groups == 8
    with pytest.raises(ValueError, match=r"GroupNorm\(8, 8\).*shape \(2, 8, 1, 1\).*one value"):
        fixed(torch.randn(2, 8, 1, 1))
    pooled = fix(nn.BatchNorm2d(8))
    pooled(torch.randn(2, 8, 1, 1))
    assert pooled.num_groups == 1
    pooled(torch.randn(2, 8, 3, 3))  # one group holds more than one value at any size
    odd = fix(nn.BatchNorm2d(5))  # one group from the start: more than one value at any size
    odd(torch.randn(2, 5, 1, 1))
    assert odd.num_groups == 1
