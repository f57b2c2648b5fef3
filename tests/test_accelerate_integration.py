"""dptrain with Hugging Face Accelerate (dptrain.integrations.accelerate.make_private), in one process.

One logical step (two micro-batches through ``accelerator.accumulate``, the prepared optimizer's step) leaves in
p.grad the float64 oracle's clipped sum over the specified Poisson batch divided by the expected batch size;
bf16 and fp16 (with the scaler) within what the precision explains; save_state / load_state continue epsilon,
the step count and the batches with fresh noise. Two processes: tests/test_frameworks_distributed.py.
"""
from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

from framework_helpers import (
    assert_within,
    build_classifier,
    classifier_columns,
    classifier_losses,
    grad_norm_difference,
    logical_batches,
    oracle_step,
    precision_bounds,
    take,
)
from helpers import assert_matches

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import send_to_device  # noqa: E402

from dptrain.data import FixedShapeBatch  # noqa: E402
from dptrain.integrations.accelerate import make_private  # noqa: E402

N = 16
build_model, columns, losses_fn = build_classifier, classifier_columns, classifier_losses


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one AcceleratorState per process: each test builds its own Accelerator."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _setup(model, data, *, accumulation=2, batch_size=8, fp16_on_cpu=False, mixed_precision="no", **privacy):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision)
    if fp16_on_cpu:
        # Accelerate turns fp16 off on a CPU (its scaler needs a GPU); these are what it sets on a GPU, so its fp16
        # path (autocast to float16 in the prepared forward, the GradScaler in the prepared optimizer) runs here.
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    optimizer = torch.optim.SGD(model.parameters(), lr=privacy.pop("lr", 0.0))
    prepared, optimizer = accelerator.prepare(model, optimizer)
    privacy.setdefault("noise_multiplier", 0.0)
    privacy.setdefault("steps", 4)
    private = make_private(accelerator, prepared, optimizer, torch.utils.data.TensorDataset(*data),
                           batch_size=batch_size, generator=torch.Generator().manual_seed(7), **privacy)
    return accelerator, prepared, optimizer, private


def _train(accelerator, model, optimizer, private, steps, seen=None, grads=None):
    """The documented loop, until ``steps`` private steps; ``grads``: p.grad of the first step, after it."""
    while private.engine.steps_taken < steps:
        for batch in private.loader:
            batch = send_to_device(batch, accelerator.device)
            (x, y), mask = batch if isinstance(batch, FixedShapeBatch) else (batch, None)
            if seen is not None:
                seen.append(x.clone())
            with accelerator.accumulate(model):
                private.backward(losses_fn(model, x, y), mask)
                optimizer.step()
                if grads is not None and not grads and private.engine.steps_taken == 1:
                    grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
                optimizer.zero_grad()
            if private.engine.steps_taken == steps and accelerator.sync_gradients:
                return


@pytest.mark.parametrize("mode, max_batch_size", [("bk-mixopt", "auto"), ("ghost", "auto"), ("bk-mixopt", None)])
def test_one_step_is_the_oracle_on_the_specified_batch(mode, max_batch_size):
    model, data = build_model(), columns()
    indices = logical_batches(N, 8, None, 7, 1)[0]
    expected = oracle_step(model, losses_fn, data, indices, 0.05, 8)  # (before the engine hooks the model)
    accelerator, prepared, optimizer, private = _setup(model, data, max_grad_norm=0.05, clipping_mode=mode,
                                                       max_batch_size=max_batch_size)
    assert (private.engine.max_batch_size is None) == (max_batch_size is None)  # None: batches of varying size
    assert sorted(logical_batches(N, 8, private.engine.max_batch_size, 7, 1)[0]) == sorted(indices)
    grads = {}
    _train(accelerator, prepared, optimizer, private, 1, grads=grads)
    assert private.engine.steps_taken == 1 and 0 < len(indices) < N
    assert_matches(grads, expected, what=f"accelerate step, {mode}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_is_within_what_the_precision_explains(precision):
    model64, data = build_model(), columns()
    indices = logical_batches(N, 8, None, 7, 1)[0]
    batch = take(data, indices)
    from dptrain.testing import threshold_between

    R = threshold_between(model64, losses_fn, batch)
    bounds = precision_bounds(model64, losses_fn, batch, R, torch.bfloat16 if precision == "bf16" else torch.float16)
    expected = oracle_step(model64, losses_fn, data, indices, R, 8)
    model = build_model(torch.float32)
    accelerator, prepared, optimizer, private = _setup(
        model, columns(dtype=torch.float32), max_grad_norm=R, mixed_precision=precision,
        fp16_on_cpu=precision == "fp16")
    assert sorted(logical_batches(N, 8, private.engine.max_batch_size, 7, 1)[0]) == sorted(indices)
    grads = {}
    _train(accelerator, prepared, optimizer, private, 1, grads=grads)
    if precision == "fp16":
        assert accelerator.scaler.get_scale() < 2.0**40 and not optimizer.step_was_skipped  # retried, not skipped
    assert_within({n: g * 8 for n, g in grads.items()}, {n: g * 8 for n, g in expected.items()}, bounds,
                  what=precision)


def test_one_sample_moves_the_step_by_at_most_the_clipping_norm():
    R, sums = 1e-3, []
    for n in (8, 7):  # q = 1: every example in the step
        x, y = columns(8)
        keep = [i for i in range(8) if n == 8 or i != 3]
        accelerator, prepared, optimizer, private = _setup(build_model(), (x[keep], y[keep]), accumulation=1,
                                                           batch_size=n, max_grad_norm=R)
        grads = {}
        _train(accelerator, prepared, optimizer, private, 1, grads=grads)
        sums.append({k: g * n for k, g in grads.items()})
        AcceleratorState._reset_state(reset_partial_state=True)
    assert grad_norm_difference(*sums) == pytest.approx(R, rel=1e-9)


def _padded_run(n, path, *, hazard_step=2, max_batch_size=12, accumulation=2, R=1e-3):
    """Steps on q = 1 of ``n`` examples in ``accumulation`` micro-batches (K = 12: padding rows), through the
    documented call until ``hazard_step``, then through ``path`` (refused: that micro-batch again through the
    documented call). The last step's clipped sum (p.grad times n), and the refusals."""
    x, y = columns(8)
    accelerator, prepared, optimizer, private = _setup(build_model(), (x[:n], y[:n]), batch_size=n,
                                                       max_grad_norm=R, max_batch_size=max_batch_size,
                                                       steps=hazard_step + 1, accumulation=accumulation)
    refusals = []
    while private.engine.steps_taken <= hazard_step:
        for batch in private.loader:
            (xb, yb), mask = send_to_device(batch, accelerator.device)
            with accelerator.accumulate(prepared):
                losses = losses_fn(prepared, xb, yb)
                try:
                    if private.engine.steps_taken < hazard_step or path == "private.backward(losses, mask)":
                        private.backward(losses, mask)
                    elif path == "accelerator.backward(loss)":
                        accelerator.backward(losses.mean())
                    else:
                        private.backward(losses)
                except ValueError as err:
                    refusals.append(str(err))
                    private.backward(losses_fn(prepared, xb, yb), mask)
                optimizer.step()
                if private.engine.steps_taken == hazard_step + 1 and accelerator.sync_gradients:
                    grads = {k: p.grad * n for k, p in prepared.named_parameters()}
                optimizer.zero_grad()
    AcceleratorState._reset_state(reset_partial_state=True)
    return grads, refusals


@pytest.mark.parametrize("path", ["private.backward(losses, mask)", "accelerator.backward(loss)",
                                  "private.backward(losses)"])
def test_a_padded_step_is_exact_with_its_mask_and_refused_without(path):
    """Ordinary steps, then the hazard: only the documented call carries the mask; the others are refused before
    anything is applied (the step then taken the documented way is exact), and one sample moves the step by R."""
    full, full_refusals = _padded_run(8, path)
    smaller, smaller_refusals = _padded_run(7, path)
    if path == "private.backward(losses, mask)":
        assert full_refusals == smaller_refusals == []
    else:
        for refusals, real in ((full_refusals, 4), (smaller_refusals, 3)):  # micro-batch 1 of 2: 6 rows
            assert len(refusals) == 2 and f"batch has {real} real samples" in refusals[0], refusals
            assert all("Give the mask: private.backward(losses, mask) with the batch's mask" in r for r in refusals)
        documented, _ = _padded_run(8, "private.backward(losses, mask)")
        assert_matches(full, documented, rtol=1e-12, what=f"after refusing {path}")
    assert grad_norm_difference(full, smaller) / 1e-3 == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("path", ["accelerator.backward(loss)", "private.backward(losses)"])
def test_a_step_without_padding_works_without_the_mask(path):
    """K = n and q = 1: no padding row, so the usual idiom is private too (one sample moves the step by R)."""
    runs = [_padded_run(n, path, max_batch_size=n, accumulation=1) for n in (8, 7)]
    assert runs[0][1] == runs[1][1] == []
    x, y = columns(8)
    full = {k: g / 8 for k, g in runs[0][0].items()}
    assert_matches(full, oracle_step(build_model(), losses_fn, (x, y), list(range(8)), 1e-3, 8), what=path)
    assert grad_norm_difference(runs[0][0], runs[1][0]) / 1e-3 == pytest.approx(1.0, rel=1e-9)
    _, refusals = _padded_run(7, path, max_batch_size=8, accumulation=1)  # 7 real rows of 8: the same path refused
    assert len(refusals) == 1 and "batch has 7 real samples" in refusals[0]


@pytest.mark.parametrize("path", ["accelerator.backward(loss)", "private.backward(losses)"])
def test_a_backward_without_the_mask_of_a_prepared_private_loader_is_refused(path):
    """``accelerator.prepare(private.loader)`` builds another DataLoader on the same sampler: the engine never saw its
    batches, so a backward without the mask clipped the padding rows as samples (1.7 R, silent; an outside probe).
    Such a backward is refused before anything is accumulated, naming what to do; iterating the loader itself then
    trains as documented."""
    accelerator, prepared, optimizer, private = _setup(build_model(), columns(N), max_batch_size=12, accumulation=1)
    for batch in accelerator.prepare(private.loader):
        (x, y), mask = batch
        with accelerator.accumulate(prepared), pytest.raises(ValueError, match="drawn through another DataLoader .* "
                                                                              "Give the mask: private.backward"):
            if path == "accelerator.backward(loss)":
                accelerator.backward(losses_fn(prepared, x, y).mean())
            else:
                private.backward(losses_fn(prepared, x, y))
        break
    assert all(p.grad is None or not p.grad.any() for p in prepared.parameters())
    assert private.engine.steps_taken == 0
    _train(accelerator, prepared, optimizer, private, 1)
    assert private.engine.steps_taken == 1


def test_save_and_load_state_continue_epsilon_steps_and_batches_with_fresh_noise(tmp_path):
    def run(resume=None, save=None):
        model = build_model()
        accelerator, prepared, optimizer, private = _setup(model, columns(), noise_multiplier=1.0, lr=0.1,
                                                           steps=6, engine_kwargs={"seed": 0})
        if resume is not None:
            accelerator.load_state(resume)
        seen = []
        _train(accelerator, prepared, optimizer, private, 3 if save else 6, seen)
        if save:
            accelerator.save_state(save)
            _train(accelerator, prepared, optimizer, private, 6, seen)
        AcceleratorState._reset_state(reset_partial_state=True)
        return private, model, seen

    full, full_model, full_seen = run(save=str(tmp_path / "step3"))
    resumed, resumed_model, resumed_seen = run(resume=str(tmp_path / "step3"))
    assert resumed.engine.steps_taken == full.engine.steps_taken == 6
    assert resumed.engine.get_epsilon() == full.engine.get_epsilon()
    assert len(resumed_seen) == len(full_seen) - 6 and all(
        torch.equal(a, b) for a, b in zip(full_seen[6:], resumed_seen))  # the same batches: 4 steps per epoch
    assert any(not torch.equal(p, q) for p, q in zip(full_model.parameters(), resumed_model.parameters()))


def _longer_run(folder, *, planned, resume=False, steps=6, accumulation=2, **privacy):
    """16 examples, expected batch 4 (4 steps per epoch), ``planned`` steps for the calibration (K "auto": 12 for
    3 steps, 14 for 30); a checkpoint at step 2 (the middle of an epoch), or resumed from it. (private, the batches
    drawn after step 2.)"""
    model = build_model()
    privacy = {"target_epsilon": 8.0, "noise_multiplier": None, "lr": 0.1, "engine_kwargs": {"seed": 0}, **privacy}
    accelerator, prepared, optimizer, private = _setup(model, columns(), batch_size=4, steps=planned,
                                                       accumulation=accumulation, **privacy)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the resume note: the noise multiplier was calibrated for another plan)
        if resume:
            accelerator.load_state(str(folder))
        else:
            _train(accelerator, prepared, optimizer, private, 2)
            accelerator.save_state(str(folder))
        _train(accelerator, prepared, optimizer, private, steps, seen)
    AcceleratorState._reset_state(reset_partial_state=True)
    return private, seen


def test_resuming_with_a_longer_plan_keeps_the_checkpoints_max_batch_size(tmp_path):
    """3 planned steps, a checkpoint at step 2, resumed for 30: the automatic K would be 14, the run keeps 12 (the
    interrupted epoch draws the batches an uninterrupted run with K = 12 draws), recalibrates the noise to the new
    plan with it, and composes the checkpoint's steps with the new ones."""
    first, _ = _longer_run(tmp_path / "step2", planned=3, steps=2)
    assert first.engine.max_batch_size == 12
    resumed, seen = _longer_run(tmp_path / "step2", planned=30, resume=True)
    reference, reference_seen = _longer_run(tmp_path / "reference", planned=30, max_batch_size=12)
    engine = resumed.engine
    assert engine.steps_taken == 6 and engine.max_batch_size == resumed.loader.max_batch_size == 12
    assert len(seen) == len(reference_seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen, reference_seen))
    assert engine.noise_multiplier == reference.engine.noise_multiplier != first.engine.noise_multiplier
    history = engine.privacy_report()["history"]
    assert [(h["noise_multiplier"], h["max_batch_size"], h["steps"]) for h in history] == [
        (first.engine.noise_multiplier, 12, 2), (engine.noise_multiplier, 12, 4)]
    with pytest.raises(ValueError, match=r"drawn with max_batch_size=12, but this run draws them with "
                                         r"max_batch_size=14.*Pass max_batch_size=12 to make_private"):
        _longer_run(tmp_path / "step2", planned=30, resume=True, max_batch_size=14)
    with pytest.raises(ValueError, match="max_batch_size=12, which does not split into 8 pieces"):
        _longer_run(tmp_path / "step2", planned=30, resume=True, accumulation=8)
    with pytest.raises(ValueError, match="keeps this checkpoint's max_batch_size=12 .* over the 3000 planned steps "
                                         "it truncates too often"):
        _longer_run(tmp_path / "step2", planned=3000, resume=True)


def test_a_step_off_the_logical_batches_is_refused():
    accelerator, prepared, optimizer, private = _setup(build_model(), columns())
    (x, y), mask = next(iter(private.loader))
    with pytest.raises(RuntimeError, match="accelerator.accumulate"):  # no accumulate: every micro-batch would step
        private.backward(losses_fn(prepared, x, y), mask)


def test_settings_that_cannot_be_private_are_refused():
    accelerator = Accelerator(cpu=True)
    model = build_model()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(*columns())
    with pytest.raises(ValueError, match="optimizer was not prepared"):
        make_private(accelerator, prepared, raw, data, batch_size=8, noise_multiplier=1.0, steps=4)
    AcceleratorState._reset_state(reset_partial_state=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = Accelerator(cpu=True, dynamo_backend="inductor")
    model = build_model()
    with pytest.raises(ValueError, match="dynamo_backend"):
        make_private(compiled, model, compiled.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)), data,
                     batch_size=8, noise_multiplier=1.0, steps=4)


def test_missing_accelerate_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "dptrain.integrations.accelerate")
    with pytest.raises(ImportError, match=r"pip install 'dptrain\[accelerate\]'"):
        importlib.import_module("dptrain.integrations.accelerate")
