"""Convolutions keep only what autograd keeps, and form patches in chunks under a budget.

The operands of a conv call are its input and output gradient themselves (no unfolded
patches); the ghost norm forms patches a batch chunk and a Gram tile at a time under
``ConvRule.workspace_bytes``; per-sample gradients come from the conv's weight-gradient
kernel with the batch folded into the groups. Every mode must still equal the float64 oracle
when the budget forces several chunks and tiles.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.layers import conv as conv_rules
from dptrain.layers.conv import ConvRule, weight_grad
from helpers import MODES, Case, assert_matches, classify, engine_clipped_sum, get_case, reference, scaled_group_norms

pytestmark = pytest.mark.usefixtures("float64")


@pytest.fixture
def small_budget(monkeypatch):
    """A budget of a few KiB: the test cases' layers then take several batch chunks and Gram tiles."""
    monkeypatch.setattr(ConvRule, "workspace_bytes", 6 * 1024)
    return 6 * 1024


def _median_threshold(case: Case) -> float:
    return scaled_group_norms(case, "all-layer").median().item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", ["conv1d", "conv2d", "conv3d", "called-twice-conv-embedding", "resnet-groupnorm"])
def test_every_mode_matches_oracle_with_several_chunks(case_name, mode, small_budget):
    case = get_case(case_name)
    R = _median_threshold(case)
    assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R), reference(case, max_grad_norm=R),
                   what=f"{case_name} / {mode} at a {small_budget}-byte workspace")


def test_small_budget_really_chunks_and_tiles(small_budget, monkeypatch):
    """The ghost norm of the conv2d case runs in batch chunks and token tiles under the budget."""
    formed, tiles = [], []
    unfold, tiled = conv_rules.unfold_patches, conv_rules._tiled_gram_product

    def recording_unfold(module, x):
        out = unfold(module, x)
        formed.append((x.shape[0], out.numel() * out.element_size()))
        return out

    def recording_tiled(a, grad, tile):
        tiles.append((a.shape[-1], tile))
        return tiled(a, grad, tile)

    monkeypatch.setattr(conv_rules, "unfold_patches", recording_unfold)
    monkeypatch.setattr(conv_rules, "_tiled_gram_product", recording_tiled)
    case = get_case("conv2d")
    engine_clipped_sum(case, mode="ghost", max_grad_norm=1.0)
    assert len(formed) > 5, "the five conv layers should take more than five batch chunks in all"
    # a chunk of several samples stays under the budget (a single sample may exceed it: it cannot be split)
    assert all(nbytes <= small_budget for b, nbytes in formed if b > 1)
    assert any(b == 1 for b, _ in formed) and any(b > 1 for b, _ in formed)
    assert any(tile < T for T, tile in tiles), "some layer's Gram matrices should be tiled"


def test_operands_are_the_input_and_output_gradient_themselves():
    """Nothing derived is kept: the operands share storage with the captured input and the gradient."""
    conv = nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect", groups=1)
    x, grad = torch.randn(4, 3, 9, 9), torch.randn(4, 8, 9, 9)
    ops = ConvRule().operands(conv, x, grad)
    kept = [t for call in ops for t in call]
    assert [t.data_ptr() for t in kept] == [x.data_ptr(), grad.data_ptr()]
    assert sum(t.numel() * t.element_size() for t in kept) == (x.numel() + grad.numel()) * x.element_size()


def test_engine_keeps_no_patches_for_book_keeping(monkeypatch):
    """In 'bk' every conv is book-kept until the clipping factors exist: the kept operands are the
    tensors the engine captured, and patches are only formed inside the ghost norm."""
    made, where = [], {"in_norm": False}
    operands, ghost, unfold = ConvRule.operands, ConvRule.ghost_sq_norm, conv_rules.unfold_patches

    def recording_operands(self, module, activation, grad_output):
        ops = operands(self, module, activation, grad_output)
        made.append((ops, activation.data_ptr(), grad_output.data_ptr()))
        return ops

    def in_norm(self, module, ops):
        where["in_norm"] = True
        try:
            return ghost(self, module, ops)
        finally:
            where["in_norm"] = False

    def checked_unfold(module, x):
        assert where["in_norm"], "patches formed outside the ghost norm"
        return unfold(module, x)

    monkeypatch.setattr(ConvRule, "operands", recording_operands)
    monkeypatch.setattr(ConvRule, "ghost_sq_norm", in_norm)
    monkeypatch.setattr(conv_rules, "unfold_patches", checked_unfold)
    case = get_case("conv2d")
    engine_clipped_sum(case, mode="bk", max_grad_norm=1.0)
    assert len(made) == 5
    for (call,), x_ptr, g_ptr in made:
        assert (call.input.data_ptr(), call.grad.data_ptr()) == (x_ptr, g_ptr)


class TiedConvs(nn.Module):
    """Two convolutions sharing one weight (own biases), on two images of different sizes."""

    def __init__(self, C=3):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(2, 4, 3, stride=2, padding=1, padding_mode="circular")
        self.b.weight = self.a.weight
        self.head = nn.Linear(4, C)

    def forward(self, x1, x2):
        return self.head(torch.tanh(self.a(x1).mean((2, 3)) - self.b(x2).amax((2, 3))))


@pytest.mark.parametrize("mode", MODES)
def test_weight_tied_across_two_convolutions_matches_oracle(mode, small_budget):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    B = 5
    case = Case(TiedConvs(), classify, (torch.randn(B, 2, 5, 5, generator=g), torch.randn(B, 2, 6, 4, generator=g),
                                        torch.randint(0, 3, (B,), generator=g)))
    R = _median_threshold(case)
    assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R), reference(case, max_grad_norm=R),
                   what=f"tied conv weight / {mode}")


@pytest.mark.parametrize("ndim,kwargs", [
    (1, dict(kernel_size=4, padding="same", dilation=3, padding_mode="reflect")),
    (2, dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), groups=3, padding_mode="replicate")),
    (2, dict(kernel_size=3, padding="same", groups=6, padding_mode="zeros")),  # depthwise
    (3, dict(kernel_size=2, stride=2, dilation=(1, 2, 1), padding=1, padding_mode="circular")),
])
def test_weight_gradient_kernel_equals_autograd(ndim, kwargs):
    """Summed and per-sample (batch folded into the groups) weight gradients against autograd."""
    Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[ndim]
    conv = Conv(6, 6, **kwargs)
    x = torch.randn(3, 6, *([7] * ndim))
    out = conv(x)
    grad = torch.randn_like(out)
    per_sample = torch.stack([torch.autograd.grad(conv(x[i:i + 1]), conv.weight, grad[i:i + 1])[0] for i in range(3)])
    torch.testing.assert_close(weight_grad(conv, x, grad, batch_groups=True), per_sample, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight_grad(conv, x, grad), per_sample.sum(0), rtol=1e-12, atol=1e-12)


def test_per_sample_chunks_follow_the_budget(monkeypatch):
    """A budget of one sample's copies gives one chunk per sample; the result does not change."""
    conv = nn.Conv2d(4, 5, 3, padding=2, padding_mode="reflect")
    x = torch.randn(6, 4, 8, 8)
    grad = torch.randn_like(conv(x))
    ops = ConvRule().operands(conv, x, grad)
    whole = ConvRule().per_sample_grads(conv, ops, {"weight", "bias"})
    calls = []
    folded = conv_rules.weight_grad
    monkeypatch.setattr(conv_rules, "weight_grad", lambda *a, **k: calls.append(a[1].shape[0]) or folded(*a, **k))
    per_sample_bytes = 8 * (2 * conv.weight.numel() + x[0].numel() + grad[0].numel())
    monkeypatch.setattr(ConvRule, "workspace_bytes", 2 * per_sample_bytes)
    chunked = ConvRule().per_sample_grads(conv, ops, {"weight", "bias"})
    assert calls == [2, 2, 2]
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-12, atol=1e-12)
    assert whole["weight"].shape == (6, *conv.weight.shape)


@pytest.mark.parametrize("side,expect_patches", [(9, False), (2, True)])
def test_per_sample_weight_takes_patches_only_where_they_are_small(side, expect_patches, monkeypatch):
    """Few output positions (T <= C_out/groups): a product with the patches, else the folded kernel; both exact."""
    conv = nn.Conv2d(4, 12, 3, padding=1, groups=2, padding_mode="replicate")
    x = torch.randn(3, 4, side, side)
    grad = torch.randn_like(conv(x))
    unfolded = []
    unfold = conv_rules.unfold_patches
    monkeypatch.setattr(conv_rules, "unfold_patches", lambda m, t: unfolded.append(t.shape) or unfold(m, t))
    got = ConvRule().per_sample_grads(conv, ConvRule().operands(conv, x, grad), {"weight"})["weight"]
    assert bool(unfolded) == expect_patches
    want = torch.stack([torch.autograd.grad(conv(x[i:i + 1]), conv.weight, grad[i:i + 1])[0] for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3), dict(kernel_size=3, stride=2, padding=1),
                                    dict(kernel_size=(2, 3), dilation=(2, 1), padding=(1, 2)),
                                    dict(kernel_size=1), dict(kernel_size=4, stride=3, dilation=2)])
def test_unfold_by_views_equals_the_im2col_kernel(kwargs):
    """The patches an accelerator forms (strided views, one copy) are the CPU's F.unfold ones, exactly."""
    conv = nn.Conv2d(3, 5, **kwargs)
    x = torch.randn(4, 3, 11, 10)
    pads = conv_rules._explicit_padding(conv)
    padded = torch.nn.functional.pad(x, pads)
    want = torch.nn.functional.unfold(padded, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    assert torch.equal(conv_rules.unfold_by_views(conv, padded), want)
    assert torch.equal(conv_rules.unfold_patches(conv, x), want)


@pytest.fixture
def accelerator_kernels(monkeypatch):
    """The kernels an accelerator takes, on the CPU: per-sample weights by the product with the patches at every
    size, and patches by strided views."""
    monkeypatch.setattr(ConvRule, "per_sample_patches", True)

    def unfold_by_views(module, x):
        pads = conv_rules._explicit_padding(module)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return conv_rules.unfold_by_views(module, torch.nn.functional.pad(x, pads, mode=mode) if any(pads) else x)

    monkeypatch.setattr(conv_rules, "unfold_patches", unfold_by_views)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", ["conv1d", "conv2d", "conv3d", "called-twice-conv-embedding", "resnet-groupnorm"])
def test_every_mode_matches_oracle_with_the_accelerator_kernels(case_name, mode, accelerator_kernels, small_budget):
    case = get_case(case_name)
    R = _median_threshold(case)
    assert_matches(engine_clipped_sum(case, mode=mode, max_grad_norm=R), reference(case, max_grad_norm=R),
                   what=f"{case_name} / {mode} with per-sample weights by patches at a {small_budget}-byte workspace")


def test_per_sample_weight_by_patches_is_chunked_under_the_budget(accelerator_kernels, monkeypatch):
    """The patches count in a chunk's bytes: a budget of two samples' worth takes the batch two samples at a time."""
    conv = nn.Conv2d(4, 6, 3, padding=1, groups=2)
    x = torch.randn(6, 4, 9, 9)
    grad = torch.randn_like(conv(x))
    ops = ConvRule().operands(conv, x, grad)
    chunks = []
    unfold = conv_rules.unfold_patches
    monkeypatch.setattr(conv_rules, "unfold_patches", lambda m, t: chunks.append(t.shape[0]) or unfold(m, t))
    patches = 4 * 9 * 81
    per_sample_bytes = 8 * (2 * conv.weight.numel() + x[0].numel() + grad[0].numel() + patches)
    monkeypatch.setattr(ConvRule, "workspace_bytes", 2 * per_sample_bytes)
    got = ConvRule().per_sample_grads(conv, ops, {"weight"})["weight"]
    assert chunks == [2, 2, 2]
    want = torch.stack([torch.autograd.grad(conv(x[i:i + 1]), conv.weight, grad[i:i + 1])[0] for i in range(6)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [4, 5])  # 4: the batch equals the channel count
@pytest.mark.parametrize("R", [1e-3, 1e3])  # every sample clipped, none clipped
def test_the_accelerator_kernels_keep_one_samples_influence_within_r(mode, B, R, accelerator_kernels, small_budget):
    """DP's own oracle on the per-sample weights by patches: removing one sample moves the clipped sum by at most R."""
    from dptrain.testing import assert_neighbours_bounded

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                          nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Flatten(), nn.LazyLinear(3)).double()
    x = torch.randn(B, 3, 7, 7, dtype=torch.float64)
    model(x)  # (the lazy head takes its width)
    y = torch.randint(0, 3, (B,))
    assert_neighbours_bounded(model, lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b, reduction="none"),
                              (x, y), max_grad_norm=R, mode=mode)


def test_bf16_gram_tiles_on_tensor_cores_equal_the_widened_ones(monkeypatch):
    """The Gram tiles of a bf16 convolution's ghost norm where the device multiplies bf16 into float32
    (``numerics.takes_out_dtype``; emulated here by the widened product, which is the value tensor cores give:
    exact products, float32 additions): the batched products over blocks and token tiles equal the widened einsum's."""
    from dptrain.layers import conv

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 2, 12, 10, generator=gen).to(torch.bfloat16)
    grad = torch.randn(3, 2, 5, 10, generator=gen).to(torch.bfloat16)
    widened = conv._tiled_gram_product(a.float(), grad.float(), 4)
    monkeypatch.setattr(conv, "takes_out_dtype", lambda device: True)
    monkeypatch.setattr(conv, "wide_matmul", lambda x, y: x.float() @ y.float())
    on_cores = conv._tiled_gram_product(a, grad, 4)
    assert on_cores.dtype == torch.float32
    torch.testing.assert_close(on_cores, widened, rtol=1e-6, atol=1e-6)
