"""The per-sample fallback on rows folded into the batch (``FallbackRule.regroup_call``): a module without a rule
called on ``[B * windows, N, d]``, as window attention is (timm's Swin, SwinV2-CR, GCViT, MaxViT).

The tag passes read which sample each row of the call belongs to; the fallback then replays each sample's rows
alone (as a one-sample forward calls the module) and gets the sample's gradient. Every mode, through
engine.backward and a plain loss.backward(), must give the one-sample-at-a-time oracle's clipped gradient in
float64, in either order of the rows, with a mask shared by all images, with rows picked by the data, and per user;
a module whose rows cannot be replayed per sample is refused, naming it.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.layers import fallback_modules
from dptrain.layers.fallback import SampleMixingError
from dptrain.layers.protocol import LayerDims, LayerRule
from dptrain.rows import RowsMixSamples
from dptrain.testing import assert_rule_exact, per_sample_gradients, reference_user_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, assert_matches, run_engine, spread_init

pytestmark = pytest.mark.filterwarnings("ignore:.*use the per-sample fallback:UserWarning")


class WindowAttention(nn.Module):
    """Attention inside each window (a row of the call) with a learned bias per head and token pair: an own
    parameter and no rule, so the fallback covers it (qkv and proj have rules). An optional mask ``[W, N, N]``,
    given once for all images, pairs with the rows as Swin's shifted windows do: row r takes mask r % W."""

    def __init__(self, d, n, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.bias = nn.Parameter(0.5 * torch.randn(heads, n, n))

    def forward(self, x, mask=None):
        R, N, d = x.shape
        q, k, v = self.qkv(x).reshape(R, N, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + self.bias
        if mask is not None:
            W = mask.shape[0]
            attn = (attn.view(-1, W, self.heads, N, N) + mask.unsqueeze(1).unsqueeze(0)).view(-1, self.heads, N, N)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(R, N, d))


class Windowed(nn.Module):
    """``[B, W * N, d]`` cut into W windows of N tokens, folded into the batch batch-major (sample = row // W, as
    Swin does) or windows-major (sample = row % B), attended within each window, unfolded and classified."""

    def __init__(self, d=4, windows=2, tokens=3, order="batch-major", mask=False, attn=None):
        super().__init__()
        self.windows, self.order = windows, order
        self.attn = WindowAttention(d, tokens) if attn is None else attn
        self.head = nn.Linear(d, 3)
        if mask:  # 0 or -100 (timm's value), the diagonal open: every token attends somewhere
            g = torch.Generator().manual_seed(1)
            closed = (torch.rand(windows, tokens, tokens, generator=g) < 0.4) & ~torch.eye(tokens, dtype=torch.bool)
            self.register_buffer("mask", closed * -100.0)
        else:
            self.mask = None

    def forward(self, x):
        B, L, d = x.shape
        w = x.reshape(B, self.windows, L // self.windows, d)
        if self.order == "windows-major":
            w = w.transpose(0, 1)
        y = self.attn(w.reshape(-1, *w.shape[2:]), self.mask).reshape(w.shape)
        if self.order == "windows-major":
            y = y.transpose(0, 1)
        return self.head(torch.tanh(y.reshape(B, L, d)))


def _input(B, windows=2, tokens=3, d=4, seed=0):
    return torch.randn(B, windows * tokens, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("order,mask", [("batch-major", False), ("batch-major", True), ("windows-major", False)])
def test_fallback_on_windows_folded_into_the_batch_is_exact(order, mask):
    torch.manual_seed(0)
    model = Windowed(order=order, mask=mask)
    assert fallback_modules(model) == ["attn"]
    assert_rule_exact(model, _input(3), allow_fallback=True)


@pytest.mark.parametrize("order,mask", [("batch-major", True), ("windows-major", False)])
def test_as_many_samples_as_windows(order, mask):
    """B = W: the batch's size is also the windows' (and the mask's first dim), which no shape tells apart."""
    torch.manual_seed(0)
    assert_rule_exact(Windowed(windows=3, order=order, mask=mask), _input(3, windows=3), allow_fallback=True)


@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk-mixopt", "mean"), ("ghost", "engine")])
def test_later_steps_with_a_checked_layout_are_exact(float64, mode, path):
    """The steps after the first, checked again at every call (the checks read values), are as exact. A model with
    equal rows per sample (one vmap) and one with rows picked by the data (one replay per sample)."""
    for model, x in ((Windowed(mask=True), _input(3)), (Routed(), _input(4, windows=1, tokens=6, seed=1))):
        torch.manual_seed(0)
        model = spread_init(model)

        def losses(m, x):
            return m(x).square().flatten(1).sum(1)

        grads = per_sample_gradients(model, losses, (x,))
        norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
        R = float(norms.median())
        expected = {n: torch.einsum("b,b...->...", torch.clamp(R / norms, max=1.0), g) for n, g in grads.items()}
        engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=50, max_grad_norm=R, noise_multiplier=0.0,
                                       clipping_mode=mode)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine.attach(optimizer)
        try:
            for step in range(3):
                if path == "engine":
                    engine.backward(losses(model, x))
                else:
                    losses(model, x).mean().backward()
                optimizer.step()
                got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                optimizer.zero_grad(set_to_none=True)
                assert_matches(got, expected, what=f"{type(model).__name__}, step {step}, {mode} through {path}")
        finally:
            engine.detach()


def test_a_mask_laid_out_for_another_order_of_the_rows_is_refused():
    """Windows-major rows with a mask that pairs row r with mask r % W: in the batch a row meets another window's
    mask than in its own sample's forward, so the batch's gradient is not the sum of the samples' (the oracle's).
    Each sample's rows replayed alone do not reproduce the call: refused, naming the module."""
    torch.manual_seed(0)
    model = Windowed(order="windows-major", mask=True).double()
    x = _input(3).double()
    with pytest.raises(SampleMixingError, match=r"attn \(WindowAttention\): its rows are samples folded into the "
                                                r"batch .* does not reproduce them"):
        run_engine(model, lambda m, x: m(x).square().flatten(1).sum(1), (x,), mode="bk-mixopt", max_grad_norm=1.0)


class Routed(nn.Module):
    """Tokens picked by the data (those whose first feature is positive), gathered from every sample into one
    call ``[M, d]`` of a fallback module, and scattered back: samples have different numbers of rows, one none."""

    def __init__(self, d=4):
        super().__init__()
        self.scale = Scale(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        keep = torch.nonzero(flat[:, 0] > 0).squeeze(1)
        picked = torch.tanh(self.scale(flat.index_select(0, keep)))
        out = torch.zeros_like(flat).index_add(0, keep, picked)
        return self.head(torch.tanh(out.reshape(B, T, d) + x))


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x):
        return x * self.weight


def test_rows_picked_by_the_data_with_different_counts_per_sample_are_exact():
    torch.manual_seed(0)
    x = _input(4, windows=1, tokens=6)
    x[1, :, 0] = -x[1, :, 0].abs()  # sample 1 has no picked row
    x[2, :, 0] = x[2, :, 0].abs()   # sample 2 has all of its rows picked
    counts = (x[:, :, 0] > 0).sum(1)
    assert counts[1] == 0 and len(set(counts.tolist())) > 2
    assert_rule_exact(Routed(), x, allow_fallback=True)


class FlatRouter(nn.Module):
    """A mixture-of-experts router as Mistral 4's, Nemotron-H's and Solar-Open's: given the batch [B, T, d], it
    flattens the tokens itself and returns (logits, top-k weights, top-k indices) over [B * T] rows."""

    def __init__(self, d, experts=3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d) / math.sqrt(d))

    def forward(self, x):
        logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        weights, indices = logits.softmax(-1).topk(2, dim=-1)
        return logits, weights, indices


class RoutedMixture(nn.Module):
    def __init__(self, d=4, experts=3):
        super().__init__()
        self.router = FlatRouter(d, experts)
        self.experts = nn.Linear(d, d * experts)
        self.head = nn.Linear(d, 3)

    def forward(self, x):  # x [B, T, d]
        B, T, d = x.shape
        logits, weights, indices = self.router(x)
        outs = self.experts(x).reshape(B * T, -1, d)  # each token through every expert
        picked = outs.gather(1, indices.unsqueeze(-1).expand(-1, -1, d))  # [B * T, 2, d]
        mixed = (weights.unsqueeze(-1) * picked).sum(1) + 0.1 * logits.sum(-1, keepdim=True)
        return self.head(torch.tanh(mixed.reshape(B, T, d)))


def test_a_router_that_flattens_the_batch_itself_is_exact():
    """The router's argument leads with the samples ([B, T, d]) and its outputs with their tokens ([B * T, ...]):
    each sample's replay takes its own row of the argument and gives its T rows of the outputs."""
    torch.manual_seed(0)
    assert_rule_exact(RoutedMixture(), torch.randn(3, 5, 4), allow_fallback=True)
    assert_rule_exact(RoutedMixture(), torch.randn(4, 4, 4), allow_fallback=True)  # B = T


@pytest.mark.parametrize("mode", MODES)
def test_one_sample_through_a_router_that_flattens_the_batch_moves_the_model_by_R(float64, mode):
    """B = T = 4, every sample's loss but the first weighted 0 (noise 0): the clipped sum is that one sample's
    gradient scaled to norm R, the router's and the experts' rows of it summed before clipping."""
    torch.manual_seed(0)
    R = 1e-3
    model = RoutedMixture().double()
    x = 3 * torch.randn(4, 4, 4)
    first_only = torch.tensor([1.0, 0.0, 0.0, 0.0])

    def losses(m, x):
        return m(x).square().flatten(1).sum(1) * first_only[: x.shape[0]]

    unclipped = per_sample_gradients(model, losses, (x[:1],))
    norm = math.sqrt(sum(float(g.square().sum()) for g in unclipped.values()))
    assert norm > 100 * R
    paths = ("engine", "sum") if mode in SINGLE_BACKWARD_MODES else ("engine",)
    for path in paths:
        got = run_engine(copy.deepcopy(model), losses, (x,), mode=mode, max_grad_norm=R, path=path)
        total = math.sqrt(sum(float(g.square().sum()) for g in got.values()))
        assert abs(total - R) <= 1e-9 * R, f"{mode} through {path}: update norm {total:.6g}, not R = {R}"
        for name, g in got.items():
            assert torch.allclose(g, unclipped[name][0] * (R / norm), rtol=1e-9, atol=1e-15), (mode, path, name)


class MixesRows(nn.Module):
    """Normalises each row by the mean over all rows of the call: the folded windows of every image mix."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x, mask=None):
        return x * self.weight / (1 + x.square().mean(0, keepdim=True))


@pytest.mark.parametrize("B", [3, 4])  # 3: B = the windows' length
def test_rows_that_mix_in_the_folded_call_are_refused(B):
    """The replay's check perturbs one row of the call and finds the others moved: refused, naming the module. (With
    B equal to the windows' length, the fallback may also take the tokens for the batch, which every token's
    independence verifies; the row reader then finds each token's rows shared by every sample, and refuses.)"""
    torch.manual_seed(0)
    model = Windowed(attn=MixesRows(4)).double()
    x = _input(B).double()
    if B == 3:
        refusal = (SampleMixingError, RowsMixSamples), r"attn \(MixesRows\)(: \d+ of \d+ rows .* mix the gradients| mixes the samples) of"
    else:
        refusal = SampleMixingError, r"attn \(MixesRows\) mixes the samples of a batch"
    with pytest.raises(refusal[0], match=refusal[1]):
        run_engine(model, lambda m, x: m(x).square().flatten(1).sum(1), (x,), mode="bk-mixopt", max_grad_norm=1.0)


class KeptAsTuple(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(d))

    def forward(self, x, mask=None):
        return x * self.weight


class TupleRule(LayerRule):
    """A rule whose activation is not a tensor and that has no ``regroup_call``: exact on calls with the batch
    first, and its calls' rows cannot be regrouped by sample."""

    module_types = (KeptAsTuple,)
    param_names = ("weight",)

    def capture(self, module, inputs, output):
        return (inputs[0].detach(),)

    def dims(self, module, activation, output):
        return LayerDims(T=1, p=module.weight.numel(), d=1, ghost_supported=False)

    def operands(self, module, activation, grad_output):
        return activation[0], grad_output

    def per_sample_grads(self, module, ops, names):
        a, g = ops
        return {"weight": (a * g).reshape(a.shape[0], -1, a.shape[-1]).sum(1)}


def test_a_rule_without_the_hook_keeps_refusing_rows_it_cannot_regroup():
    torch.manual_seed(0)
    dptrain.register_layer(TupleRule)
    try:
        assert_rule_exact(KeptAsTuple(4), _input(3))  # the batch first: exact
        model = Windowed(attn=KeptAsTuple(4)).double()
        with pytest.raises(RowsMixSamples, match=r"attn \(KeptAsTuple\): its rows are samples in another order or "
                                                 r"layout \(blocks over 1 axis.*the rule TupleRule cannot regroup"):
            run_engine(model, lambda m, x: m(x).square().flatten(1).sum(1), (_input(3).double(),),
                       mode="bk-mixopt", max_grad_norm=1.0)
    finally:
        dptrain.unregister_layer(TupleRule)


@pytest.mark.parametrize("mode", MODES)
def test_one_sample_update_is_bounded_by_the_threshold(float64, mode):
    """A batch of one sample whose W windows are W rows of the call: the rows are summed into the one sample's
    gradient before clipping (clipping each row would let the update reach sqrt(W) R), noise 0."""
    torch.manual_seed(0)
    R = 1e-3
    model = Windowed(windows=4, mask=True)
    x = 3 * _input(1, windows=4)

    def losses(m, x):
        return m(x).square().flatten(1).sum(1)

    unclipped = per_sample_gradients(model, losses, (x,))
    norm = math.sqrt(sum(float(g.square().sum()) for g in unclipped.values()))
    assert norm > 100 * R
    paths = ("engine", "mean") if mode in SINGLE_BACKWARD_MODES else ("engine",)
    for path in paths:
        got = run_engine(copy.deepcopy(model), losses, (x,), mode=mode, max_grad_norm=R, path=path)
        total = math.sqrt(sum(float(g.square().sum()) for g in got.values()))
        assert total <= R * (1 + 1e-9), f"{mode} through {path}: update norm {total:.6g} > R = {R}"
        assert total >= R * (1 - 1e-9), f"{mode} through {path}: clipped to {total:.6g}, not R = {R}"
        for name, g in got.items():  # the one sample's gradient, scaled to norm R
            assert torch.allclose(g, unclipped[name][0] * (R / norm), rtol=1e-9, atol=1e-15), (mode, path, name)


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_users_rows_folded_into_the_batch_are_clipped_per_user(float64, mode):
    """privacy_unit='user': each user's examples' windows are replayed together, their gradients summed and clipped
    as one unit (the units map onto the rows as samples do)."""
    torch.manual_seed(0)
    model = Windowed(mask=True)
    x = _input(5, seed=2)
    y = torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(3))
    users = torch.tensor([4, 9, 4, 4, 1])  # users of 3, 1 and 1 examples

    def losses(m, x, y):
        return F.cross_entropy(m(x).mean(1), y, reduction="none")

    R = 0.05
    reference = reference_user_clipped_gradient(model, losses, (x, y), users, max_grad_norm=R)
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=50, max_grad_norm=R, noise_multiplier=0.0,
                                   clipping_mode=mode, loss_reduction="sum", privacy_unit="user")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(optimizer)
    try:
        engine.backward(losses(model, x, y), users=users)
        optimizer.step()
        got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.detach()
    assert_matches(got, reference, what=f"user-level {mode}")


@pytest.mark.slow
def test_timm_swin_with_shifted_windows_is_exact():
    """timm's Swin at a tiny size, float64: 16 windows of 4 x 4 tokens per image, the second block's shifted
    windows masked (the mask [16, 16, 16] given once for all images); its WindowAttention's relative position
    bias table goes through the fallback on the windows folded into the batch."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=16, patch_size=1,
                              window_size=4, embed_dim=8, depths=(2,), num_heads=(2,), num_classes=3, in_chans=2,
                              drop_rate=0.0, drop_path_rate=0.0, attn_drop_rate=0.0, proj_drop_rate=0.0)
    model = spread_init(model)
    block = model.layers[0].blocks[1]
    assert block.attn_mask is not None and block.attn_mask.shape[0] == 16 and any(block.shift_size)
    assert "layers.0.blocks.1.attn" in fallback_modules(model)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(3, 2, 16, 16, generator=g), torch.tensor([0, 2, 1]))
    assert_rule_exact(model, batch, allow_fallback=True,
                      losses_fn=lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"))
