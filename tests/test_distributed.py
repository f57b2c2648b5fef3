"""DDP and FSDP2 on CPU (gloo, 2 processes): exactness against one process, noise added once.

The process bodies are in tests/distributed_workers.py. Processes are forked on Linux
(importing dptrain in a spawned interpreter takes seconds) and spawned elsewhere.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import distributed_workers as W
import dptrain
import dptrain.testing
from helpers import free_port

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
WORLD = 2
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
    ENGINES = ["ddp", "fsdp2"]
except ImportError:
    ENGINES = ["ddp", pytest.param("fsdp2", marks=pytest.mark.skip(reason="FSDP2 needs torch >= 2.6"))]


def _launch(fn, *args) -> None:
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    mp.start_processes(fn, args=(WORLD, free_port(), *args), nprocs=WORLD, start_method=method)


def _results(out) -> list[dict]:
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(WORLD)]


def _single_process(mode, style, steps, micro, plain_backward=False) -> dict[str, torch.Tensor]:
    model = W.build_model()
    W.train(model, model, mode, style, steps, micro, 0.0, rank=0, world=1, use_engine_backward=not plain_backward)
    return W.full_params(model)


@pytest.mark.parametrize("engine_kind", ENGINES)
@pytest.mark.parametrize("mode", dptrain.CLIPPING_MODES)
def test_sigma_zero_equals_one_process_on_the_whole_batch(tmp_path, engine_kind, mode):
    # 3 steps of 2 micro-batches each: clipping binds (R = 0.05), so a wrong sum or divisor shows.
    out = tmp_path / "run"
    _launch(W.run_training, engine_kind, mode, "all-layer", 3, 2, 0.0, str(out))
    ranks = _results(out)
    expected = _single_process(mode, "all-layer", 3, 2)
    initial = W.full_params(W.build_model())
    for name, ref in expected.items():
        assert not torch.equal(ref, initial[name])  # training moved it
        for r in ranks:
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-10, atol=1e-12)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])
    assert all(r["steps"] == 3 for r in ranks)
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"]


@pytest.mark.parametrize("engine_kind", ENGINES)
@pytest.mark.parametrize("style", ["layer-wise", "param-wise"])
def test_other_clipping_styles_are_exact(tmp_path, engine_kind, style):
    out = tmp_path / "run"
    _launch(W.run_training, engine_kind, "bk-mixopt", style, 2, 1, 0.0, str(out))
    expected = _single_process("bk-mixopt", style, 2, 1)
    for r in _results(out):
        for name, ref in expected.items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_plain_loss_backward_under_data_parallel(tmp_path, engine_kind):
    # loss.mean().backward() on each rank's half: the engine rescales by the local batch, so the
    # result is the same clipped sum as engine.backward (the divisor stays the global batch).
    out = tmp_path / "run"
    _launch(W.run_training, engine_kind, "bk-mixopt", "all-layer", 2, 1, 0.0, str(out), True)
    expected = _single_process("bk-mixopt", "all-layer", 2, 1, plain_backward=True)
    for r in _results(out):
        for name, ref in expected.items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine_kind", ENGINES)
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_rank_with_an_empty_poisson_batch_still_steps(tmp_path, engine_kind, mode):
    # Rank 1's first batch is empty (Poisson sampling allows it): it must still take part in the
    # collectives (FSDP2 gathers parameters in the backward), and its rows drop out of the sum.
    out = tmp_path / "run"
    _launch(W.run_training, engine_kind, mode, "all-layer", 2, 1, 0.0, str(out), False, 1)
    model = W.build_model()
    W.train(model, model, mode, "all-layer", 2, 1, 0.0, rank=0, world=1, empty_first=1)
    expected = W.full_params(model)
    for r in _results(out):
        for name, ref in expected.items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_noise_is_added_once_with_std_sigma_r_over_global_batch(tmp_path, engine_kind):
    sigma, R = 1.5, 0.1
    out = tmp_path / "run"
    _launch(W.run_noise, engine_kind, sigma, R, str(out))
    r0, r1 = _results(out)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name])  # identical parameters on every rank
        assert torch.equal(r0["grads"][name], r1["grads"][name])
    # The clipped sum, from the one-sample-at-a-time oracle on the whole global batch.
    torch.manual_seed(0)
    model = W.Wide().double()
    model.load_state_dict(r0["initial"])
    clipped = dptrain.testing.reference_clipped_gradient(
        model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), (r0["x"], r0["y"]), max_grad_norm=R)
    noise = torch.cat([(r0["grads"][n] * W.GLOBAL_BATCH - clipped[n]).flatten() for n in clipped])
    n = noise.numel()  # 4090 coordinates: the sample std is within 3.5 % of the truth at ~5 sigma
    std = float(noise.std())
    assert abs(std - sigma * R) < 0.035 * sigma * R, (std, sigma * R)
    assert abs(float(noise.mean())) < 5 * sigma * R / math.sqrt(n)
    # Noise twice (once per rank) would have std sqrt(2) sigma R; once per rank divided by sqrt(world)
    # would be indistinguishable here, which is why the engine draws each coordinate on one rank only:
    # under DDP all of it on rank 0, under FSDP2 each shard on its owner (checked by the equal grads).


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_correlated_noise_is_drawn_once_per_coordinate_with_its_covariance(tmp_path, engine_kind):
    """Banded correlated noise (C = T(0.8, 0.6)) under DDP (rank 0 keeps the buffers) and FSDP2 (each rank those
    of its shard): every rank gets the same gradients, and each coordinate's noise over the steps has covariance
    C^{-1} C^{-T} (kappa = 1), as on one device."""
    from dptrain.correlated import toeplitz

    steps, out = 5, tmp_path / "run"
    _launch(W.run_correlated_noise, engine_kind, steps, str(out))
    r0, r1 = _results(out)
    assert torch.equal(r0["grads"], r1["grads"])
    samples = r0["grads"].double()  # [4090 coordinates, steps]
    inverse = toeplitz.materialize(toeplitz.series_inverse(torch.tensor([0.8, 0.6], dtype=torch.float64), steps))
    expected = inverse @ inverse.T
    empirical = samples.T @ samples / len(samples)
    diag = torch.diagonal(expected)
    stderr = torch.sqrt((diag[:, None] * diag[None, :] + expected**2) / len(samples))
    assert float(((empirical - expected).abs() / stderr).max()) < 5.0


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    out = tmp_path / "run"
    _launch(W.run_scaler_overflow, str(out))
    for r in _results(out):
        assert r["unchanged"] and r["steps"] == 1 and r["scale"] == 2.0**9


@pytest.mark.skipif(ENGINES[1] != "fsdp2", reason="FSDP2 needs torch >= 2.6")
def test_fsdp2_refuses_a_parameter_used_outside_its_layer(tmp_path):
    # Under FSDP2 autograd's gradient reaches the sharded p.grad through FSDP's reduce-scatter, which
    # then runs the parameter's post-accumulate-grad hooks: the engine's hook refuses it as on one device.
    out = tmp_path / "run"
    _launch(W.run_leak, str(out))
    for r in _results(out):
        assert "fc2.weight" in r["message"] and "outside the forward call of its own layer" in r["message"]
        assert r["unchanged"]


def test_unsupported_wrappers_get_clear_errors(tmp_path):
    out = tmp_path / "run"
    _launch(W.run_wrong_use, str(out))
    for r in _results(out):
        assert "static_graph" in r["static_graph"]
        assert "neither DistributedDataParallel nor fully_shard" in r["unwrapped"]


def test_data_parallel_and_deepspeed_are_refused():
    model = W.build_model()
    with pytest.raises(NotImplementedError, match="DistributedDataParallel"):
        dptrain.PrivacyEngine(torch.nn.DataParallel(model), batch_size=8, sample_size=64, noise_multiplier=1.0)
    # A DeepSpeed engine is recognised by its class's module, without importing deepspeed.
    DeepSpeedEngine = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    with pytest.raises(NotImplementedError, match="DeepSpeed .DeepSpeedEngine. is not supported"):
        dptrain.PrivacyEngine(DeepSpeedEngine(), batch_size=8, sample_size=64, noise_multiplier=1.0)
    # A ZeRO optimizer wrapping a torch optimizer is refused at attach, before any step.
    ZeroOptimizer = type("DeepSpeedZeroOptimizer", (torch.optim.SGD,), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    engine = dptrain.PrivacyEngine(model, batch_size=8, sample_size=64, noise_multiplier=1.0)
    with pytest.raises(NotImplementedError, match="DeepSpeedZeroOptimizer"):
        engine.attach(ZeroOptimizer(model.parameters(), lr=0.1))


def test_zero_redundancy_optimizer_is_exact_and_its_local_optimizer_gets_one_clear_message(tmp_path):
    """The engine attached to a ZeroRedundancyOptimizer (Adam state sharded over the ranks) trains as one process
    with a plain Adam on the whole batches (noise 0). Attached to its local optimizer, or that stepped on its own:
    one message each, saying what to do; overlap_with_ddp=True is refused at attach."""
    out = tmp_path / "run"
    _launch(W.run_zero, str(out))
    model = W.build_model()
    engine = dptrain.PrivacyEngine(model, batch_size=W.GLOBAL_BATCH, sample_size=W.SAMPLE_SIZE, max_grad_norm=0.05,
                                   noise_multiplier=0.0)
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    engine.attach(adam)
    W.train_zero(model, model, adam, engine, rank=0, world=1)
    expected = W.full_params(model)
    for r in _results(out):
        assert r["steps"] == 3
        for name, ref in expected.items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-10, atol=1e-12)
        messages = r["messages"]
        assert "was stepped on its own" in messages["inner stepped"]
        assert "Call step() on the ZeroRedundancyOptimizer" in messages["inner stepped"]
        assert "attached to the local optimizer (Adam) of a ZeroRedundancyOptimizer" in messages["attached to inner"]
        assert "Attach the engine to the ZeroRedundancyOptimizer itself" in messages["attached to inner"]
        assert messages["unchanged"]
        assert "overlap_with_ddp=False" in messages["overlap"]


def test_the_sampling_check_sums_the_ranks_counts(tmp_path):
    out = tmp_path / "run"
    _launch(W.run_sampling_check, str(out))
    results = _results(out)
    for r in results:
        assert r["poisson"] == []
        assert [step for step, _ in r["fixed"]] == [20]  # on every rank, with the global numbers
        assert "their variance is 0 " in r["fixed"][0][1] and "mean 8.0 per step" in r["fixed"][0][1]
