"""DPMultiheadAttention: same function and state dict as nn.MultiheadAttention, exact private gradients."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from dptrain.nn import DPMultiheadAttention
from dptrain.testing import assert_rule_exact

F64 = torch.float64
E, HEADS = 4, 2


def make_pair(**options):
    reference = nn.MultiheadAttention(E, HEADS, **options, dtype=F64)
    dp = DPMultiheadAttention(E, HEADS, **options, dtype=F64)
    dp.load_state_dict(reference.state_dict())
    return reference, dp


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0, equal_nan=True)


def masks(B, L, S, g):
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -2:] = True
    causal_like = torch.ones(L, S, dtype=torch.bool).triu(diagonal=S - L + 1)
    return [
        {},
        {"key_padding_mask": padding},
        {"key_padding_mask": padding.to(F64) * -1e4},
        {"attn_mask": causal_like},
        {"attn_mask": causal_like, "key_padding_mask": padding},
        {"attn_mask": torch.randn(B * HEADS, L, S, dtype=F64, generator=g)},
    ]


# ---------------------------------------------------------------------------- same function
@pytest.mark.parametrize(
    "bias,add_bias_kv,add_zero_attn,kv_dims,batch_first",
    list(itertools.product([True, False], [False, True], [False, True], [None, (3, 5)], [False, True])),
)
def test_forward_matches_torch(bias, add_bias_kv, add_zero_attn, kv_dims, batch_first):
    options = dict(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, batch_first=batch_first)
    if kv_dims:
        options.update(kdim=kv_dims[0], vdim=kv_dims[1])
    reference, dp = make_pair(**options)
    g = torch.Generator().manual_seed(0)
    B, L, S = 3, 4, 6
    kdim, vdim = kv_dims or (E, E)

    def sequence(length, dim):
        shape = (B, length, dim) if batch_first else (length, B, dim)
        return torch.randn(*shape, dtype=F64, generator=g)

    query, key, value = sequence(L, E), sequence(S, kdim), sequence(S, vdim)
    for mask, need_weights, average in itertools.product(masks(B, L, S, g), [True, False], [True, False]):
        expected = reference(query, key, value, need_weights=need_weights, average_attn_weights=average, **mask)
        actual = dp(query, key, value, need_weights=need_weights, average_attn_weights=average, **mask)
        close(actual[0], expected[0])
        if need_weights:
            close(actual[1], expected[1])
        else:
            assert actual[1] is None and expected[1] is None


def test_self_attention_matches_torch():
    """query is key is value, the case torch treats specially when transposing."""
    reference, dp = make_pair(batch_first=True)
    x = torch.randn(2, 5, E, dtype=F64)
    close(dp(x, x, x)[0], reference(x, x, x)[0])


@pytest.mark.parametrize("average", [True, False])
def test_unbatched_input_matches_torch(average):
    reference, dp = make_pair(add_bias_kv=True)
    g = torch.Generator().manual_seed(1)
    query, key = torch.randn(4, E, dtype=F64, generator=g), torch.randn(6, E, dtype=F64, generator=g)
    mask = torch.randn(HEADS, 4, 6, dtype=F64, generator=g)
    padding = torch.tensor([0.0, 0.0, 0.0, 0.0, -1e4, -1e4], dtype=F64)  # float, like attn_mask
    expected = reference(query, key, key, attn_mask=mask, key_padding_mask=padding, average_attn_weights=average)
    actual = dp(query, key, key, attn_mask=mask, key_padding_mask=padding, average_attn_weights=average)
    close(actual[0], expected[0])
    close(actual[1], expected[1])


@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal_hint_matches_torch(need_weights):
    reference, dp = make_pair(batch_first=True)
    x = torch.randn(2, 5, E, dtype=F64)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    expected = reference(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
    actual = dp(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
    close(actual[0], expected[0])
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        dp(x, x, x, is_causal=True)


@pytest.mark.parametrize("need_weights", [True, False])
def test_attention_dropout_drops_what_torch_drops(need_weights):
    reference, dp = make_pair(dropout=0.3)
    x = torch.randn(5, 2, E, dtype=F64)
    torch.manual_seed(3)
    expected = reference(x, x, x, need_weights=need_weights)
    torch.manual_seed(3)
    actual = dp(x, x, x, need_weights=need_weights)
    close(actual[0], expected[0])
    assert not torch.allclose(dp(x, x, x)[0], actual[0]), "dropout is active in training mode"


# ---------------------------------------------------------------------------- state dicts and attributes
@pytest.mark.parametrize(
    "options",
    [{}, {"bias": False}, {"add_bias_kv": True}, {"kdim": 3, "vdim": 5, "add_bias_kv": True},
     {"kdim": 3, "vdim": 5, "bias": False}],
)
def test_state_dict_uses_torch_keys_both_ways(options):
    reference, dp = make_pair(**options)
    assert list(dp.state_dict()) == list(reference.state_dict())
    back = nn.MultiheadAttention(E, HEADS, **options, dtype=F64)
    back.load_state_dict(dp.state_dict())  # strict
    for name, tensor in reference.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
        assert torch.equal(dp.state_dict()[name], tensor), name


def test_torch_attributes_read_the_projection_weights():
    dp = DPMultiheadAttention(E, HEADS, add_bias_kv=True, dtype=F64)
    assert torch.equal(dp.in_proj_weight, torch.cat([dp.q_proj.weight, dp.k_proj.weight, dp.v_proj.weight]))
    assert torch.equal(dp.in_proj_bias, torch.cat([dp.q_proj.bias, dp.k_proj.bias, dp.v_proj.bias]))
    assert dp.q_proj_weight is None and dp._qkv_same_embed_dim
    assert dp.bias_k.shape == (1, 1, E)
    dp.bias_k.data.zero_()  # a view: writes reach the parameter
    assert not dp.bias_k_token.weight.any()
    separate = DPMultiheadAttention(E, HEADS, kdim=3, vdim=5, bias=False)
    assert separate.in_proj_weight is None and separate.in_proj_bias is None and separate.bias_k is None
    assert separate.k_proj_weight is separate.k_proj.weight


def test_initialisation_follows_torch():
    torch.manual_seed(0)
    dp = DPMultiheadAttention(64, 4, add_bias_kv=True)
    bound = (6 / (64 + 3 * 64)) ** 0.5  # xavier_uniform_ of the packed [3E, E] weight
    assert dp.in_proj_weight.abs().max() <= bound and dp.in_proj_weight.abs().max() > 0.9 * bound
    assert not dp.in_proj_bias.any() and not dp.out_proj.bias.any()


def test_errors_name_the_expected_shapes():
    dp = DPMultiheadAttention(E, HEADS, batch_first=True, kdim=3)
    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match="kdim=3"):
        dp(x, x, x)
    dp = DPMultiheadAttention(E, HEADS, batch_first=True)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(5, 5\) or \(4, 5, 5\)"):
        dp(x, x, x, attn_mask=torch.zeros(3, 5, 5))
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(2, 5\)"):
        dp(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        DPMultiheadAttention(6, 4)


# ---------------------------------------------------------------------------- inside torch's transformer
def test_transformer_encoder_layer_accepts_it_as_self_attn():
    torch.manual_seed(5)
    reference = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=8, dropout=0.0, batch_first=True, dtype=F64)
    dp = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=8, dropout=0.0, batch_first=True, dtype=F64)
    dp.load_state_dict(reference.state_dict())
    dp.self_attn = DPMultiheadAttention(E, HEADS, batch_first=True, dtype=F64)
    dp.self_attn.load_state_dict(reference.self_attn.state_dict())
    x = torch.randn(3, 5, E, dtype=F64)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    close(dp(x, src_key_padding_mask=padding), reference(x, src_key_padding_mask=padding))
    reference.eval()
    dp.eval()
    with torch.no_grad():  # torch's inference fast path reads in_proj_weight / in_proj_bias
        close(dp(x), reference(x))


# ---------------------------------------------------------------------------- exact private gradients
class SelfAttentionRegressor(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.attention = DPMultiheadAttention(E, HEADS, batch_first=True, **options)
        self.head = nn.Linear(E, 2)

    def forward(self, x, padding):
        out, _ = self.attention(x, x, x, key_padding_mask=padding)
        return self.head(out)


class CrossAttentionClassifier(nn.Module):
    """Sequence-first cross-attention with different key/value sizes and the learned bias tokens."""

    def __init__(self):
        super().__init__()
        self.attention = DPMultiheadAttention(E, HEADS, kdim=3, vdim=5, add_bias_kv=True, add_zero_attn=True)
        self.head = nn.Linear(E, 3)

    def forward(self, query, key, value, attn_mask):
        # inputs batch-first (the oracle slices dim 0); the module is sequence-first
        out, _ = self.attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                attn_mask=attn_mask.flatten(0, 1))
        return self.head(out.mean(0))


def _self_attention_case():
    torch.manual_seed(21)
    model = SelfAttentionRegressor().double()
    g = torch.Generator().manual_seed(22)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    batch = (torch.randn(3, 5, E, dtype=F64, generator=g), padding, torch.randn(3, 5, 2, dtype=F64, generator=g))
    return model, lambda m, x, pad, y: (m(x, pad) - y).square().sum((1, 2)), batch


def _cross_attention_case():
    torch.manual_seed(23)
    model = CrossAttentionClassifier().double()
    g = torch.Generator().manual_seed(24)
    B, L, S = 3, 4, 6
    batch = (torch.randn(B, L, E, dtype=F64, generator=g), torch.randn(B, S, 3, dtype=F64, generator=g),
             torch.randn(B, S, 5, dtype=F64, generator=g), torch.randn(B, HEADS, L, S, dtype=F64, generator=g),
             torch.tensor([0, 2, 1]))

    def losses(m, query, key, value, mask, y):
        return nn.functional.cross_entropy(m(query, key, value, mask), y, reduction="none")

    return model, losses, batch


CASES = {"self-attention": _self_attention_case, "cross-attention": _cross_attention_case}


@pytest.mark.parametrize("case", list(CASES))
def test_every_clipping_mode_is_exact_through_both_backward_paths(case):
    model, losses_fn, batch = CASES[case]()
    assert_rule_exact(model, batch, losses_fn=losses_fn)
