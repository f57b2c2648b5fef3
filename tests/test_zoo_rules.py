"""Rules and fallback coverage added for the model zoos (issue 21): each against the oracle in every mode and
both backward paths (``assert_rule_exact``), and one sample bounded by max_grad_norm (noise 0, SGD lr 1)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dptrain
from dptrain.layers import FallbackRule, resolve_rule
from dptrain.testing import assert_rule_exact
from helpers import MODES

pytestmark = pytest.mark.filterwarnings("ignore:.*use the per-sample fallback:UserWarning",
                                        "ignore:There is a performance drop:UserWarning")


def assert_one_sample_bounded(model: nn.Module, x: torch.Tensor, R: float = 0.05) -> None:
    """A batch of one sample, clipped far below its gradient norm, moves the model by exactly R in every mode."""
    for mode in MODES:
        copy = _copy(model)
        engine = dptrain.PrivacyEngine(copy, batch_size=1, sample_size=100, noise_multiplier=0.0,
                                       clipping_mode=mode, max_grad_norm=R)
        optimizer = torch.optim.SGD([p for p in copy.parameters() if p.requires_grad], lr=1.0)
        engine.attach(optimizer)
        try:
            before = [p.detach().clone() for p in copy.parameters()]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = copy(x[:1])
                engine.backward(out.square().reshape(1, -1).sum(1))
            optimizer.step()
            update = torch.cat([(p.detach() - b).flatten() for p, b in zip(copy.parameters(), before)])
        finally:
            engine.detach()
        assert update.norm() <= R * (1 + 1e-9), f"{mode}: one sample moved the model by {update.norm():.4g} > {R}"
        assert update.norm() >= R * (1 - 1e-9), f"{mode}: the update {update.norm():.4g} is not clipped to {R}"


def _copy(model):
    import copy
    return copy.deepcopy(model)


# --------------------------------------------------------------------------- weight norm
class WeightNormNet(nn.Module):
    """A weight-normed convolution (wav2vec2's positional convolution) between two plain layers."""

    def __init__(self, dim=2):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 4, 3, padding=1), dim=dim)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).transpose(1, 2))


@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_is_exact_through_the_fallback_of_the_parametrized_module(dim):
    torch.manual_seed(dim)
    net = WeightNormNet(dim).double()
    rule = resolve_rule(net.conv)
    assert isinstance(rule, FallbackRule)
    assert set(rule.param_names) == {"bias", "parametrizations.weight.original0", "parametrizations.weight.original1"}
    assert_rule_exact(net, torch.randn(3, 2, 5), allow_fallback=True)
    assert_one_sample_bounded(net, torch.randn(1, 2, 5, dtype=torch.float64))


def test_weight_norm_without_the_fallback_is_refused_naming_the_module():
    net = WeightNormNet().double()
    with pytest.raises(ValueError, match=r"conv \(ParametrizedConv1d\) has trainable parameters.*allow_fallback=True"):
        dptrain.PrivacyEngine(net, batch_size=1, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0,
                              allow_fallback=False)


# --------------------------------------------------------------------------- scaled word embeddings
class ScaledByFloat(nn.Embedding):
    """BART's kind: the lookup times a Python number."""

    def __init__(self, V, d, padding_idx=None):
        super().__init__(V, d, padding_idx=padding_idx)
        self.embed_scale = d ** 0.5

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


class ScaledByBuffer(nn.Embedding):
    """Gemma's kind: the lookup times a 0-d buffer cast to the table's dtype."""

    def __init__(self, V, d):
        super().__init__(V, d)
        self.embed_scale = nn.Buffer(torch.tensor(d ** 0.5), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class ScaledAndShifted(ScaledByFloat):
    """Shaped like a scaled embedding, but it adds something: the numerical check must catch it."""

    def forward(self, ids):
        return super().forward(ids) + 1.0


class TokenHead(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding, self.head = embedding, nn.Linear(embedding.embedding_dim, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.embedding(ids)))


def _ids(seed, V=6):
    return torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["float", "buffer", "padding"])
def test_scaled_word_embedding_is_recognised_and_exact_with_its_ghost_norm(kind):
    from dptrain.layers.embedding import ScaledEmbeddingRule
    torch.manual_seed(0)
    embedding = {"float": lambda: ScaledByFloat(6, 4), "buffer": lambda: ScaledByBuffer(6, 4),
                 "padding": lambda: ScaledByFloat(6, 4, padding_idx=1)}[kind]()
    net = TokenHead(embedding).double()
    assert isinstance(resolve_rule(net.embedding), ScaledEmbeddingRule)
    ids = _ids(1)
    ids[0, :2] = 1  # repeated tokens (and padding, where it is the padding index)
    assert_rule_exact(net, ids)  # allow_fallback=False: the rule, not the fallback, did the work
    assert_one_sample_bounded(net, ids)


def test_embedding_shaped_like_a_scaled_one_that_computes_more_is_refused():
    net = TokenHead(ScaledAndShifted(6, 4)).double()
    engine = dptrain.PrivacyEngine(net, batch_size=1, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    engine.attach(torch.optim.SGD(net.parameters(), lr=0.0))
    try:
        with pytest.raises(ValueError, match="ScaledAndShifted looks like a scaled word embedding.*not embed_scale"):
            engine.backward(net(_ids(2)).square().sum((1, 2)))
    finally:
        engine.detach()


# --------------------------------------------------------------------------- the fallback's memory in plan()
def test_plan_shows_the_per_sample_gradient_size_of_each_fallback_layer():
    from dptrain.core.planning import fallback_costs

    net = WeightNormNet()
    x = torch.randn(2, 2, 5)
    decisions = dptrain.plan(net, x, decision_rule="space")
    conv_params = sum(p.numel() for p in net.conv.parameters())
    assert fallback_costs(decisions) == {"conv": conv_params}
    report = decisions.report()
    assert report["fallback"] == {"layers": {"conv": conv_params}, "per_sample": conv_params}
    assert {layer["name"]: layer["fallback_cost"] for layer in report["layers"]} == {"conv": conv_params, "head": 0}
    table = str(decisions)
    assert f"fallback: 1 layer(s) have no rule (conv {conv_params})" in table
    assert f"{conv_params} per sample (B times that for a batch of B)" in table


# --------------------------------------------------------------------------- a child's weight read by its parent
def test_eva_attention_reading_its_qkv_weight_is_exact_through_its_own_fallback():
    """EvaAttention with q/v biases calls F.linear(x, self.qkv.weight, bias) itself: the attention claims
    qkv.weight (the engine refused it as used outside its own layer's call) and the fallback replays it."""
    eva = pytest.importorskip("timm.models.eva")
    from dptrain.layers.registry import layer_params
    torch.manual_seed(0)
    attn = eva.EvaAttention(8, num_heads=2, qkv_bias=True, scale_norm=False).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    covered = layer_params(attn)
    assert "qkv.weight" in covered[attn] and attn.qkv not in covered
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    assert_rule_exact(attn, x, allow_fallback=True)
    assert_one_sample_bounded(attn, x)


# --------------------------------------------------------------------------- dropout inside a replayed module
class GateWithDropout(nn.Module):
    """A fallback module holding a dropout (timm builds nn.Dropout(proj_drop) even at rate 0)."""

    def __init__(self, d, p):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(d))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * torch.sigmoid(self.gate))


def test_a_dropout_at_rate_zero_inside_a_fallback_module_is_replayed_in_training():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), GateWithDropout(4, 0.0), nn.Linear(4, 3)).double().train()
    assert_rule_exact(net, torch.randn(3, 2, 4), allow_fallback=True)
    assert_one_sample_bounded(net, torch.randn(1, 2, 4, dtype=torch.float64))


def test_a_dropout_with_a_rate_inside_a_fallback_module_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), GateWithDropout(4, 0.5), nn.Linear(4, 3)).double().train()
    engine = dptrain.PrivacyEngine(net, batch_size=1, sample_size=100, noise_multiplier=0.0, max_grad_norm=1.0)
    engine.attach(torch.optim.SGD(net.parameters(), lr=0.0))
    try:
        with pytest.raises(Exception, match=r"1 \(GateWithDropout\).*(does not reproduce|random operation)"):
            engine.backward(net(torch.randn(3, 2, 4, dtype=torch.float64)).square().sum((1, 2)))
    finally:
        engine.detach()


class TinyScanMixer(nn.Module):
    """Shaped like a Mamba mixer: its own A_log and D, a child convolution whose weight the forward reads itself
    (F.conv1d with the child's weight and bias, as the selective scan's slow paths do), a child projection called."""

    def __init__(self, d):
        super().__init__()
        self.in_proj = nn.Linear(d, d)
        self.conv1d = nn.Conv1d(d, d, 3, groups=d, padding=2)
        self.A_log = nn.Parameter(torch.randn(d))
        self.D = nn.Parameter(torch.randn(d))

    def forward(self, x):  # [B, T, d]
        h = self.in_proj(x).transpose(1, 2)
        h = nn.functional.conv1d(h, self.conv1d.weight, self.conv1d.bias, padding=2, groups=h.shape[1])[..., :x.shape[1]]
        decay = torch.exp(-torch.exp(self.A_log))[:, None]
        state, out = torch.zeros_like(h[..., 0]), []
        for t in range(h.shape[-1]):
            state = decay[:, 0] * state + h[..., t]
            out.append(state)
        return torch.stack(out, -1).transpose(1, 2) + x * self.D


def test_state_space_mixer_claims_the_children_weights_its_scan_reads():
    from dptrain.layers.registry import layer_params
    torch.manual_seed(0)
    mixer = TinyScanMixer(4).double()
    covered = layer_params(mixer)
    assert set(covered) == {mixer}
    assert set(covered[mixer]) == {"A_log", "D", "in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias"}
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    assert_rule_exact(mixer, x, allow_fallback=True)
    assert_one_sample_bounded(mixer, x)


def test_swin_v2_window_attention_claims_its_fused_qkv_weight_and_position_bias_mlp():
    """One window per sample: the attention's fallback differentiates qkv.weight (read by F.linear with the q/v
    biases) and the continuous position bias MLP (run on coordinates, no batch) exactly."""
    swin = pytest.importorskip("timm.models.swin_transformer_v2")
    from dptrain.layers.registry import layer_params
    torch.manual_seed(0)
    attn = swin.WindowAttention(8, window_size=(2, 2), num_heads=2).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    claimed = set(layer_params(attn)[attn])
    assert {"qkv.weight", "cpb_mlp.0.weight", "cpb_mlp.2.weight"} <= claimed
    assert attn.qkv not in layer_params(attn) and attn.cpb_mlp[0] not in layer_params(attn)
    x = torch.randn(3, 4, 8, dtype=torch.float64)  # [B * windows, window tokens, C] with one window per sample
    assert_rule_exact(attn, x, allow_fallback=True)
    assert_one_sample_bounded(attn, x)


def test_maxvit_attention_claims_its_relative_position_table():
    maxxvit = pytest.importorskip("timm.models.maxxvit")
    from dptrain.layers.registry import layer_params
    attn = maxxvit.AttentionCl(8, dim_head=4, rel_pos_cls=maxxvit.get_rel_pos_cls(maxxvit.MaxxVitTransformerCfg(
        rel_pos_type="bias"), (2, 2)))
    assert "rel_pos.relative_position_bias_table" in layer_params(attn)[attn]
    attn = attn.double()
    with torch.no_grad():
        attn.rel_pos.relative_position_bias_table.normal_()
    x = torch.randn(3, 2, 2, 8, dtype=torch.float64)  # one 2 x 2 window per sample, channels last
    assert_rule_exact(attn, x, allow_fallback=True)
    assert_one_sample_bounded(attn, x)
