"""Where users train: every mode on CUDA against the float64 oracle, bf16 autocast, fp16 with a
GradScaler, recovery from a real out-of-memory error, and DDP over NCCL with two GPUs.

Run with ``python -m pytest -m cuda`` (each test skips without a CUDA device). TF32 is off, so
float32 matmuls and convolutions are float32 and the tolerance is float32's.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import attached_engine, clipped_gradient, reference_clipped_gradient
from helpers import MODES, Case, assert_matches, free_port, get_case, split_max_grad_norm

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = ["linear-[B,T,d]", "conv1d", "conv2d", "conv3d", "embedding-padding-idx", "layernorm", "groupnorm",
         "transformer", "resnet-groupnorm", "called-twice-conv-embedding"]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _to(batch, device, dtype=None):
    return tuple(t.to(device, dtype) if t.is_floating_point() and dtype else t.to(device) for t in batch)


def _cuda_clipped_sum(case, mode, R, autocast=None, scaler=None):
    """clipped_gradient of a float32 copy of the case's model on CUDA (its forward under autocast to ``autocast``,
    if given), in float64 on the CPU."""
    model = copy.deepcopy(case.model).float().cuda()

    def losses_fn(m, *batch):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            return case.losses_fn(m, *batch)

    got = clipped_gradient(model, losses_fn, _to(case.batch, "cuda", torch.float32), mode=mode, max_grad_norm=R,
                           grad_scaler=scaler)  # (which checks that the engine took one step)
    return {n: g.double().cpu() for n, g in got.items()}


def _oracle(case, R):
    return reference_clipped_gradient(case.model, case.losses_fn, case.batch, max_grad_norm=R)


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_float32_on_cuda_matches_the_float64_oracle(float64, case_name, mode):
    case = get_case(case_name)
    R = split_max_grad_norm(case, "all-layer")
    assert_matches(_cuda_clipped_sum(case, mode, R), _oracle(case, R), rtol=1e-4, what=f"{case_name}/{mode}")


@pytest.mark.parametrize("case_name", ["linear-[B,T,d]", "conv2d", "transformer"])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_on_cuda(float64, case_name, mode):
    case = get_case(case_name)
    R = split_max_grad_norm(case, "all-layer")
    got = _cuda_clipped_sum(case, mode, R, autocast=torch.bfloat16)
    assert_matches(got, _oracle(case, R), rtol=4e-2, what=f"{case_name}/{mode}")  # bf16 keeps 8 bits


@pytest.mark.parametrize("case_name", ["linear-[B,T,d]", "conv2d", "transformer"])
@pytest.mark.parametrize("mode", MODES)
def test_fp16_with_a_grad_scaler_works_from_the_first_step(float64, case_name, mode):
    case = get_case(case_name)
    R = split_max_grad_norm(case, "all-layer")
    scaler = torch.amp.GradScaler("cuda")  # the default initial scale, 2^16
    got = _cuda_clipped_sum(case, mode, R, autocast=torch.float16, scaler=scaler)
    assert_matches(got, _oracle(case, R), rtol=1e-2, what=f"{case_name}/{mode}")


def _broadcast_table_case(kind: str) -> Case:
    """A position table on [1, T] ids through a LayerNorm, or a grid [1, C, H, W] through a 1x1 conv and
    .repeat(B, ...), broadcast over the batch (dptrain.broadcast), B = T."""
    from test_broadcast import Positions, ProjectedGrid, _data, _images, _losses
    torch.manual_seed(0)
    if kind == "positions":
        return Case(Positions("added", norm=True).double(), _losses, _data(4, 4, seed=1))
    return Case(ProjectedGrid("conv").double(), _losses, _images(4, seed=1))


@pytest.mark.parametrize("kind", ["positions", "grid"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_table_broadcast_over_the_batch_on_cuda(float64, kind, autocast, mode):
    case = _broadcast_table_case(kind)
    R = split_max_grad_norm(case, "all-layer")
    got = _cuda_clipped_sum(case, mode, R, autocast=autocast)
    assert_matches(got, _oracle(case, R), rtol=1e-4 if autocast is None else 4e-2, what=f"{kind}/{mode}/{autocast}")


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, groups=2),
                                    dict(kernel_size=(2, 3), dilation=(2, 1), padding=(1, 2), padding_mode="reflect"),
                                    dict(kernel_size=7, stride=2, padding=3)])
def test_conv_per_sample_weights_on_cuda_by_both_kernels_equal_autograd(float64, kwargs):
    """On CUDA the per-sample conv weight is a product with patches formed by strided views (cuDNN's folded-groups
    kernel, the CPU's choice, launches once per group there); both equal autograd's per-sample gradient."""
    from dptrain.layers import conv as conv_rules
    from dptrain.layers.conv import ConvRule

    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, **kwargs).double().cuda()
    x = torch.randn(5, 4, 12, 11, dtype=torch.float64, device="cuda")
    grad = torch.randn_like(conv(x))
    want = torch.stack([torch.autograd.grad(conv(x[i:i + 1]), conv.weight, grad[i:i + 1])[0] for i in range(5)])
    for by_patches in (True, False):
        rule = ConvRule()
        rule.per_sample_patches = by_patches
        got = rule.per_sample_grads(conv, rule.operands(conv, x, grad), {"weight"})["weight"]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    pads = conv_rules._explicit_padding(conv)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, pads, mode=mode) if any(pads) else x
    assert torch.equal(conv_rules.unfold_patches(conv, x),
                       F.unfold(padded, conv.kernel_size, dilation=conv.dilation, stride=conv.stride))


def test_bf16_products_run_as_bf16_with_float32_results_on_cuda():
    """Tensor cores for the per-sample math of bf16 operands (``numerics.takes_out_dtype``): Gram matrices and
    book-keeping's clipped sum (three bf16 parts of the scaled factor) equal the widened float32 products of the same
    values, to float32's accuracy."""
    from dptrain.layers import numerics

    assert numerics.takes_out_dtype(torch.device("cuda")), "this torch's mm/bmm take no out_dtype on CUDA"
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(4, 64, 96, generator=gen).to(torch.bfloat16)
    v = torch.randn(4, 64, 320, generator=gen).to(torch.bfloat16)
    c = torch.rand(4, generator=gen)
    gram = numerics.wide_matmul(u.cuda(), u.cuda().transpose(1, 2))
    assert gram.dtype == torch.float32
    torch.testing.assert_close(gram.double().cpu(), u.double() @ u.double().transpose(1, 2), rtol=1e-5, atol=1e-4)
    exact = sum(c[i].double() * u[i].double().t() @ v[i].double() for i in range(4))
    got = numerics.factor_weighted_sum(u.cuda(), v.cuda(), c.cuda())  # (the split path on this device)
    assert got.dtype == torch.float32
    scale = exact.abs().max().item()
    assert (got.double().cpu() - exact).abs().max().item() <= 1e-5 * scale


def test_sketch_projections_are_drawn_on_the_gradients_device():
    """A block drawn on the CPU and copied over cost seconds per tag pass on an H200: they are drawn on the GPU."""
    from dptrain.rows.sketch import Projections

    projections = Projections(seed=3)
    block = projections.block(1 << 10, 0, 1 << 10, torch.device("cuda"))
    assert block.is_cuda and block.dtype == torch.float64
    assert torch.equal(block, Projections(seed=3).block(1 << 10, 0, 1 << 10, torch.device("cuda")))  # (seeded)


def _conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
@pytest.mark.parametrize("path", ["engine", "plain"])
def test_recovery_from_a_real_out_of_memory_error(mode, path):
    if path == "plain" and dptrain.RECIPES[mode].two_pass:
        pytest.skip("two-pass modes need engine.backward")
    torch.cuda.empty_cache()
    model = _conv_net().cuda()
    reference_model = copy.deepcopy(model).double().cpu()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=0.5, loss_reduction="sum")
    baseline = torch.cuda.memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    # A batch whose activations (3 x 64 x 64 x 64 floats per sample and layer) exceed the free memory.
    batch = int(free / (64 * 64 * 64 * 4 * 3)) + 1
    batch = max(batch, 8)
    try:
        x = torch.randn(batch, 3, 64, 64, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        losses = F.cross_entropy(model(x), y, reduction="none")
        engine.backward(losses) if path == "engine" else losses.sum().backward()
        pytest.skip("the batch fit in memory")
    except torch.cuda.OutOfMemoryError:
        pass
    x = y = losses = None
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() <= baseline + 2**20  # nothing of the failed batch stays
    # Halve and go on: the next step is exact.
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(6, 3, 16, 16, generator=g), torch.randint(0, 10, (6,), generator=g)
    losses = F.cross_entropy(model(xs.cuda()), ys.cuda(), reduction="none")
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    reference = reference_clipped_gradient(reference_model, lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"),
                                           (xs.double(), ys), max_grad_norm=0.5)
    got = {n: p.grad.double().cpu() for n, p in model.named_parameters()}
    assert_matches(got, reference, rtol=1e-4, what="after an OOM")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_ddp_over_nccl_equals_one_process(tmp_path, mode):
    import distributed_workers as W

    out = tmp_path / "run"
    mp.start_processes(W.run_training_cuda, args=(2, free_port(), mode, str(out)), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]
    model = W.build_model()
    W.train(model, model, mode, "all-layer", 3, 2, 0.0, rank=0, world=1)
    expected = W.full_params(model)
    for r in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-4, atol=1e-5)
