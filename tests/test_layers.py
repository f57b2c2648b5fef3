"""Writing a rule (dptrain.layers): the registry (idempotent, undone by unregister_layer), the default clipped_grads
built from weight_factors and per_sample_grads, the public norm base. dptrain.testing.assert_rule_exact, which checks
a rule, is tested in test_testing.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dptrain
from dptrain.layers import registry
from dptrain.layers.numerics import OneHot, factor_weighted_sum, flatten_tokens, scale_samples

F64 = torch.float64


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(n, dtype=F64))

    def forward(self, x):
        return x * self.weight


class ScaleRule(dptrain.LayerRule):
    module_types = (Scale,)
    param_names = ("weight",)

    def dims(self, module, x, out):
        return dptrain.LayerDims(T=x[0].numel() // x.shape[-1], p=x.shape[-1], d=1, ghost_supported=False)

    def operands(self, module, x, g):
        return (flatten_tokens(x * g),)

    def per_sample_grads(self, module, ops, names):
        return {"weight": ops[0].sum(1)}


@pytest.fixture
def clean_registry():
    before = list(registry._REGISTRY)
    yield
    registry._REGISTRY[:] = before


# ---------------------------------------------------------------------------- registry
def test_registering_a_rule_twice_keeps_one_entry(clean_registry):
    n = len(registry._REGISTRY)
    assert dptrain.register_layer(ScaleRule) is ScaleRule
    dptrain.register_layer(ScaleRule)
    assert len(registry._REGISTRY) == n + 1
    instance = ScaleRule()
    dptrain.register_layer(instance)  # an instance of a registered class replaces it, in its place
    assert len(registry._REGISTRY) == n + 1 and dptrain.find_rule(Scale(2)) is instance


def test_unregister_layer_removes_the_rule(clean_registry):
    dptrain.register_layer(ScaleRule)
    assert isinstance(dptrain.find_rule(Scale(2)), ScaleRule)
    dptrain.unregister_layer(ScaleRule)
    assert dptrain.find_rule(Scale(2)) is None
    with pytest.raises(ValueError, match="ScaleRule is not a registered layer rule"):
        dptrain.unregister_layer(ScaleRule)


def test_unregistering_a_built_in_rule_uncovers_its_layer(clean_registry):
    rule = dptrain.find_rule(nn.LayerNorm(3))
    dptrain.unregister_layer(rule)
    assert dptrain.find_rule(nn.LayerNorm(3)) is None
    dptrain.register_layer(rule)
    assert dptrain.find_rule(nn.LayerNorm(3)) is rule


def test_register_layer_refuses_what_is_not_a_rule():
    with pytest.raises(TypeError, match="LayerRule"):
        dptrain.register_layer(nn.Linear)


def test_the_norm_base_is_public():
    assert issubclass(type(dptrain.find_rule(nn.LayerNorm(3))), dptrain.AffineNormRule)
    assert issubclass(type(dptrain.find_rule(nn.GroupNorm(1, 3))), dptrain.layers.AffineNormRule)


# ---------------------------------------------------------------------------- the default clipped_grads
def test_default_clipped_grads_from_dense_factors_is_the_linear_kernel():
    g = torch.Generator().manual_seed(0)
    module = nn.Linear(4, 3, dtype=F64)
    a, grad = torch.randn(5, 2, 4, dtype=F64, generator=g), torch.randn(5, 2, 3, dtype=F64, generator=g)
    factors = {"weight": torch.rand(5, dtype=F64, generator=g), "bias": torch.rand(5, dtype=F64, generator=g)}
    out = dptrain.find_rule(module).clipped_grads(module, (a, grad), factors)
    weight = torch.einsum("b,btp,btd->pd", factors["weight"], grad, a)
    torch.testing.assert_close(out["weight"], weight, rtol=1e-12, atol=0)
    torch.testing.assert_close(out["bias"], torch.einsum("b,btp->p", factors["bias"], grad), rtol=1e-12, atol=0)


def test_default_clipped_grads_from_one_hot_factors_adds_repeated_tokens():
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[0, 2, 2], [1, 1, 3]])
    v, c = torch.randn(2, 3, 4, dtype=F64, generator=g), torch.tensor([0.5, 2.0], dtype=F64)
    expected = torch.zeros(5, 4, dtype=F64)
    for b in range(2):
        for t in range(3):
            expected[ids[b, t]] += c[b] * v[b, t]
    torch.testing.assert_close(factor_weighted_sum(OneHot(ids, 5), v, c), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(factor_weighted_sum(v, OneHot(ids, 5), c), expected.t(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("widths", [(3, 5), (5, 3)])  # (either factor the narrower: the one scaled)
@pytest.mark.parametrize("chunk_bytes", [None, 1, 96])  # one product; a row at a time; a few rows, across samples
def test_factor_weighted_sum_is_sum_of_scaled_products_whatever_the_chunks(monkeypatch, widths, chunk_bytes):
    """sum_i c_i U_i^T V_i, formed in one product where the widened factors fit a chunk, else a chunk of rows at a
    time (an LM head's gradient in float32 would double the step's largest tensor): the same sum either way."""
    import dptrain.layers.numerics as numerics

    if chunk_bytes is not None:
        monkeypatch.setattr(numerics, "_WIDENED_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(3)
    u = torch.randn(3, 4, widths[0], dtype=F64, generator=g)
    v = torch.randn(3, 4, widths[1], dtype=F64, generator=g)
    c = torch.tensor([0.5, 2.0, -1.5], dtype=F64)
    expected = sum(c[i] * u[i].t() @ v[i] for i in range(3))
    torch.testing.assert_close(factor_weighted_sum(u, v, c), expected, rtol=1e-12, atol=1e-14)


def test_default_clipped_grads_forms_the_bf16_linear_weight_in_float32():
    """bf16 operands: the factor-scaled gradient and the product stay float32 (never rounded to bf16, which
    could lift one sample's contribution above R); the operands themselves are the bf16 ones the norm saw."""
    g = torch.Generator().manual_seed(2)
    module = nn.Linear(8, 6, dtype=torch.bfloat16)
    a = torch.randn(4, 3, 8, generator=g).bfloat16()
    grad = torch.randn(4, 3, 6, generator=g).bfloat16()
    c = torch.rand(4, generator=g)
    out = dptrain.find_rule(module).clipped_grads(module, (a, grad), {"weight": c})
    expected = (grad.float() * c[:, None, None]).reshape(-1, 6).t() @ a.float().reshape(-1, 8)
    assert out["weight"].dtype == torch.float32
    torch.testing.assert_close(out["weight"], expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(out["weight"], (scale_samples(grad, c).reshape(-1, 6).t() @ a.reshape(-1, 8)).float())


def test_a_rule_without_clipped_grads_gets_the_weighted_sum_of_its_per_sample_grads():
    assert "clipped_grads" not in vars(ScaleRule)
    module = Scale(3)
    ops = (torch.randn(4, 2, 3, dtype=F64),)
    c = torch.rand(4, dtype=F64)
    out = ScaleRule().clipped_grads(module, ops, {"weight": c})
    torch.testing.assert_close(out["weight"], torch.einsum("b,btn->n", c, ops[0]), rtol=1e-12, atol=0)


def test_default_clipped_grads_names_a_parameter_per_sample_grads_forgot():
    class Forgetful(ScaleRule):
        def per_sample_grads(self, module, ops, names):
            return {}

    with pytest.raises(KeyError, match=r"Forgetful.per_sample_grads gave no gradient for \['weight'\]"):
        Forgetful().clipped_grads(Scale(3), (torch.randn(4, 2, 3, dtype=F64),), {"weight": torch.ones(4, dtype=F64)})


def _bf16_operands(seed: int, widths: tuple[int, int], batch: int = 3, tokens: int = 5):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, tokens, widths[0], generator=g).to(torch.bfloat16)
    v = torch.randn(batch, tokens, widths[1], generator=g).to(torch.bfloat16)
    return u, v


def test_wide_matmul_is_the_float32_product_of_the_low_precision_operands():
    """bf16 and fp16 operands into float32: as the widened product (the products of two bf16, or two fp16, numbers
    are exact in float32), on the device's tensor cores where it has them (``takes_out_dtype``), widened here."""
    from dptrain.layers.numerics import wide_matmul

    for dtype in (torch.bfloat16, torch.float16):
        u, v = (t.to(dtype) for t in _bf16_operands(4, (6, 6)))
        got = wide_matmul(u, v.transpose(1, 2))
        assert got.dtype == torch.float32
        exact = u.double() @ v.double().transpose(1, 2)
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
        flat = wide_matmul(u[0].t(), v[0])
        assert flat.dtype == torch.float32
        torch.testing.assert_close(flat.double(), u[0].double().t() @ v[0].double(), rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 3, 4, dtype=F64)
    assert wide_matmul(x, x.transpose(1, 2)).dtype == F64  # (float64 stays float64)


@pytest.mark.parametrize("widths", [(6, 40), (40, 6)])  # (either factor the narrower: the one scaled and split)
@pytest.mark.parametrize("chunk_bytes", [None, 64])  # one chunk; a few rows at a time
def test_split_weighted_sum_is_the_float32_weighted_sum_of_bf16_factors(monkeypatch, widths, chunk_bytes):
    """Book-keeping's clipped sum on tensor cores (``split_weighted_sum``: the scaled smaller factor in three bf16
    parts, each multiplied in float32): against the sum formed in float64 from the same bf16 values, it is as close
    as the widened float32 product, part by part (checked here with the float32 product of the parts, which is what
    the tensor cores give: exact products, float32 additions)."""
    import dptrain.layers.numerics as numerics

    if chunk_bytes is not None:
        monkeypatch.setattr(numerics, "_WIDENED_CHUNK_BYTES", chunk_bytes)
    u, v = _bf16_operands(5, widths, batch=4, tokens=9)
    c = torch.tensor([0.3, 1.0, 0.0123, 0.77])
    exact = sum(c[i].double() * u[i].double().t() @ v[i].double() for i in range(4))
    split = numerics.split_weighted_sum(u, v, c, numerics.wide_matmul)
    widened = factor_weighted_sum(u, v, c)  # (the float32 path this machine takes)
    assert split.dtype == torch.float32 and split.shape == exact.shape
    scale = exact.abs().max().item()
    split_error = (split.double() - exact).abs().max().item() / scale
    widened_error = (widened.double() - exact).abs().max().item() / scale
    assert split_error <= 2 * widened_error + 2**-23, (split_error, widened_error)
    # one bf16 part alone would be 2^-9 off: the split is what makes it float32's
    one_part = numerics.wide_matmul(*((u * c[:, None, None]).to(torch.bfloat16).flatten(0, 1).t(), v.flatten(0, 1))) \
        if widths[0] <= widths[1] else None
    if one_part is not None:
        assert (one_part.double() - exact).abs().max().item() / scale > 8 * split_error


def test_a_sample_clipped_on_tensor_cores_stays_within_R():
    """The clipped contribution of one sample whose factor is R over its norm: within R to float32's rounding."""
    import dptrain.layers.numerics as numerics

    for seed in range(8):
        u, v = _bf16_operands(10 + seed, (16, 48), batch=1, tokens=33)
        grad = u[0].double().t() @ v[0].double()
        R = 0.25
        c = torch.tensor([R / grad.norm().item()], dtype=torch.float32)
        clipped = numerics.split_weighted_sum(u, v, c, numerics.wide_matmul)
        assert clipped.double().norm().item() <= R * (1 + 2**-20)
