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
from dptrain.testing import reference_clipped_gradient
from helpers import MODES, free_port, get_case, max_relative_error, split_max_grad_norm

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
    model = copy.deepcopy(case.model).float().cuda()
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, max_grad_norm=R, noise_multiplier=0.0,
                                   clipping_mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt, grad_scaler=scaler)
    batch = _to(case.batch, "cuda", torch.float32)
    with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        losses = case.losses(model, batch)
    losses = losses.reshape(losses.shape[0], -1).sum(1)
    if scaler is not None:
        engine.backward(scaler.scale(losses))
        scaler.step(opt)
        scaler.update()
    else:
        engine.backward(losses)
        opt.step()
    assert engine.steps_taken == 1
    names = dict(model.named_parameters())
    return {n: p.grad.double().cpu() for n, p in names.items() if p.requires_grad}


def _oracle(case, R):
    return reference_clipped_gradient(case.model, case.losses_fn, case.batch, max_grad_norm=R)


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_float32_on_cuda_matches_the_float64_oracle(float64, case_name, mode):
    case = get_case(case_name)
    R = split_max_grad_norm(case, "all-layer")
    rel, worst = max_relative_error(_cuda_clipped_sum(case, mode, R), _oracle(case, R))
    assert rel <= 1e-4, f"{case_name}/{mode}: relative error {rel:.3g} (worst {worst})"


@pytest.mark.parametrize("case_name", ["linear-[B,T,d]", "conv2d", "transformer"])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_on_cuda(float64, case_name, mode):
    case = get_case(case_name)
    R = split_max_grad_norm(case, "all-layer")
    rel, worst = max_relative_error(_cuda_clipped_sum(case, mode, R, autocast=torch.bfloat16), _oracle(case, R))
    assert rel <= 4e-2, f"{case_name}/{mode}: relative error {rel:.3g} (worst {worst})"  # bf16 keeps 8 bits


@pytest.mark.parametrize("case_name", ["linear-[B,T,d]", "conv2d", "transformer"])
@pytest.mark.parametrize("mode", MODES)
def test_fp16_with_a_grad_scaler_works_from_the_first_step(float64, case_name, mode):
    case = get_case(case_name)
    R = split_max_grad_norm(case, "all-layer")
    scaler = torch.amp.GradScaler("cuda")  # the default initial scale, 2^16
    got = _cuda_clipped_sum(case, mode, R, autocast=torch.float16, scaler=scaler)
    rel, worst = max_relative_error(got, _oracle(case, R))
    assert rel <= 1e-2, f"{case_name}/{mode}: relative error {rel:.3g} (worst {worst})"


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
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, max_grad_norm=0.5, noise_multiplier=0.0,
                                   clipping_mode=mode, loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
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
    rel, worst = max_relative_error(got, reference)
    assert rel <= 1e-4, f"after an OOM: relative error {rel:.3g} (worst {worst})"


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
