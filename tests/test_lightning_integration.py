"""dptrain with PyTorch Lightning (dptrain.integrations.lightning.DPCallback), in one process.

A ``training_step`` that returns per-sample losses, the callback, and the loader it builds: one logical step
(``accumulate_grad_batches=2``, Lightning's own optimizer step) leaves in p.grad the float64 oracle's clipped sum
over the specified Poisson batch divided by the expected batch size; bf16 and fp16 (with a scaler) within what
the precision explains; a checkpoint resumes epsilon, the step count and the batches with fresh noise; the
progress bar shows epsilon. Two processes (DDP): tests/test_frameworks_distributed.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from framework_helpers import (
    assert_within,
    build_classifier,
    classifier_columns,
    grad_norm_difference,
    logical_batches,
    oracle_step,
    precision_bounds,
    take,
)
from framework_helpers import classifier_losses as losses_fn
from helpers import assert_matches

pytest.importorskip("lightning")
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from dptrain.integrations.lightning import DPCallback  # noqa: E402

N = 16


class Lit(L.LightningModule):
    """The classifier of tests/framework_helpers.py, trained on per-sample losses."""

    def __init__(self, data, batch_size=8, dtype=torch.float64, lr=0.0, seen=None, grads=None):
        super().__init__()
        self.net = build_classifier(dtype)
        self.data, self.batch_size, self.lr, self.seen, self.grads = data, batch_size, lr, seen, grads

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        (x, y), mask = batch
        if self.seen is not None:
            self.seen.append(x.clone())
        return F.cross_entropy(self(x), y, reduction="none")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.grads is not None and not self.grads and self.trainer.global_step == 1:
            self.grads.update({n: p.grad.clone() for n, p in self.net.named_parameters()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DPCallback.of(self.trainer).train_loader(torch.utils.data.TensorDataset(*self.data), self.batch_size,
                                                        generator=torch.Generator().manual_seed(7))


def _fit(module, dp, *, steps=1, accumulate=2, ckpt_path=None, **trainer_kwargs):
    callbacks = [dp, *trainer_kwargs.pop("callbacks", [])]
    trainer_kwargs = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                      "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks), **trainer_kwargs}
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
                        callbacks=callbacks, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _reference_model():
    return build_classifier()


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_one_step_is_the_oracle_on_the_specified_batch(mode):
    data = classifier_columns()
    indices = logical_batches(N, 8, None, 7, 1)[0]
    expected = oracle_step(_reference_model(), losses_fn, data, indices, 0.05, 8)
    grads = {}
    dp = DPCallback(noise_multiplier=0.0, max_grad_norm=0.05, steps=4, clipping_mode=mode)
    _fit(Lit(data, grads=grads), dp)
    assert dp.engine.steps_taken == 1 and 0 < len(indices) < N
    assert sorted(logical_batches(N, 8, dp.engine.max_batch_size, 7, 1)[0]) == sorted(indices)
    assert_matches(grads, expected, what=f"lightning step, {mode}")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_is_within_what_the_precision_explains(precision):
    data = classifier_columns()
    indices = logical_batches(N, 8, None, 7, 1)[0]
    batch = take(data, indices)
    from dptrain.testing import threshold_between

    R = threshold_between(_reference_model(), losses_fn, batch)
    bounds = precision_bounds(_reference_model(), losses_fn, batch, R,
                              torch.bfloat16 if precision == "bf16-mixed" else torch.float16)
    expected = oracle_step(_reference_model(), losses_fn, data, indices, R, 8)
    grads = {}
    dp = DPCallback(noise_multiplier=0.0, max_grad_norm=R, steps=4)
    # Lightning runs fp16 on a CPU when given the plugin itself (precision="16-mixed" alone falls back to bf16)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40))
    extra = {"plugins": [plugin]} if precision == "16-mixed" else {"precision": precision}
    trainer = _fit(Lit(classifier_columns(dtype=torch.float32), dtype=torch.float32, grads=grads), dp, **extra)
    if precision == "16-mixed":
        assert trainer.strategy.precision_plugin.scaler.get_scale() < 2.0**40  # the engine found a scale ...
    assert dp.engine.steps_taken == 1  # ... without skipping the step
    assert_within({n: g * 8 for n, g in grads.items()}, {n: g * 8 for n, g in expected.items()}, bounds,
                  what=precision)


def test_one_sample_moves_the_step_by_at_most_the_clipping_norm():
    R, sums = 1e-3, []
    for n in (8, 7):  # q = 1: every example in the step
        x, y = classifier_columns(8)
        keep = [i for i in range(8) if n == 8 or i != 3]
        grads = {}
        _fit(Lit((x[keep], y[keep]), batch_size=n, grads=grads), DPCallback(noise_multiplier=0.0, max_grad_norm=R,
                                                                            steps=1), accumulate=1)
        sums.append({k: g * n for k, g in grads.items()})
    assert grad_norm_difference(*sums) == pytest.approx(R, rel=1e-9)


@dataclasses.dataclass
class UserBatch:
    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor


TRANSFORMS = {  # what a user's on_after_batch_transfer may make of the FixedShapeBatch, and how training_step reads it
    "kept": (lambda b: b, lambda b: b.data),
    "tuple(batch)": (tuple, lambda b: b[0]),
    "dict": (lambda b: {"inputs": b.data, "mask": b.mask}, lambda b: b["inputs"]),
    "dataclass": (lambda b: UserBatch(*b.data, b.mask), lambda b: (b.x, b.y)),
    "list with a bool feature": (lambda b: [b.data, ~b.mask, b.mask], lambda b: b[0]),  # ~mask: not the mask
    "mask dropped": (lambda b: b.data, lambda b: b),
}


class Transformed(Lit):
    """Lit whose batches go through ``TRANSFORMS[name]`` from optimizer step ``from_step`` on; K rows per step, q = 1;
    ``grads``: p.grad after step ``steps``."""

    def __init__(self, data, name, *, max_batch_size=12, from_step=2, steps=3, grads=None):
        super().__init__(data, batch_size=len(data[0]), grads=grads)
        self.transform, self.unpack = TRANSFORMS[name]
        self.max_batch_size, self.from_step, self.steps = max_batch_size, from_step, steps

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return self.transform(batch) if self.trainer.global_step >= self.from_step else batch

    def training_step(self, batch, batch_idx):
        x, y = self.unpack(batch) if self.trainer.global_step >= self.from_step else batch.data
        return F.cross_entropy(self(x), y, reduction="none")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.grads is not None and not self.grads and self.trainer.global_step == self.steps:
            self.grads.update({n: p.grad.clone() * self.batch_size for n, p in self.net.named_parameters()})

    def train_dataloader(self):
        return DPCallback.of(self.trainer).train_loader(torch.utils.data.TensorDataset(*self.data), self.batch_size,
                                                        max_batch_size=self.max_batch_size,
                                                        generator=torch.Generator().manual_seed(7))


def _transformed_sum(n, name, accumulate=2, **kwargs):
    """The clipped sum of step 3 (noise 0, R = 1e-3) on the first ``n`` examples, the hook at work from step 2.
    (No epsilon logged: K = n at q = 1 truncates no draw, but the accounting's bound for it is vacuous.)"""
    x, y = classifier_columns(8)
    grads = {}
    dp = DPCallback(noise_multiplier=0.0, max_grad_norm=1e-3, steps=3, log_epsilon=False)
    _fit(Transformed((x[:n], y[:n]), name, grads=grads, **kwargs), dp, steps=3, accumulate=accumulate)
    assert dp.engine.steps_taken == 3
    return grads


@pytest.mark.parametrize("name", [n for n in TRANSFORMS if n != "mask dropped"])
def test_the_mask_is_found_whatever_the_transfer_hooks_make_of_the_batch(name):
    """12 rows a step, 8 (or 7) real: the callback finds the mask in what the hooks return; the step is the one with
    the FixedShapeBatch kept, and one sample moves it by R."""
    full, smaller = _transformed_sum(8, name), _transformed_sum(7, name)
    assert_matches(full, _transformed_sum(8, "kept"), rtol=1e-12, what=name)
    assert grad_norm_difference(full, smaller) / 1e-3 == pytest.approx(1.0, rel=1e-9)


def test_a_padded_batch_whose_mask_the_hooks_dropped_is_refused():
    x, y = classifier_columns(8)
    dp = DPCallback(noise_multiplier=0.0, max_grad_norm=1e-3, steps=3)
    with pytest.raises(ValueError, match=r"reached DPCallback.on_train_batch_start \(a list\) holds no fixed-shape "
                                         r"mask.*Keep the FixedShapeBatch, or at least its mask tensor"):
        _fit(Transformed((x, y), "mask dropped"), dp, steps=3)
    assert dp.engine.steps_taken == 2  # the ordinary steps; nothing of the refused one


def test_a_batch_without_padding_needs_no_mask():
    """K = n and q = 1: the hooks may drop the mask, as no row is padding (one sample moves the step by R)."""
    full, smaller = (_transformed_sum(n, "mask dropped", max_batch_size=n, accumulate=1) for n in (8, 7))
    expected = oracle_step(_reference_model(), losses_fn, classifier_columns(8), list(range(8)), 1e-3, 1)
    assert_matches(full, expected, rtol=1e-9, what="no padding, no mask")
    assert grad_norm_difference(full, smaller) / 1e-3 == pytest.approx(1.0, rel=1e-9)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 steps of expected batch 4 (4 steps per epoch), a checkpoint every 2, and the progress bar on."""
    folder = tmp_path_factory.mktemp("lightning")
    seen = []
    dp = DPCallback(noise_multiplier=1.0, steps=6, engine_kwargs={"seed": 0})
    module = Lit(classifier_columns(), batch_size=4, lr=0.1, seen=seen)
    trainer = _fit(module, dp, steps=6, enable_progress_bar=True, callbacks=[
        ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)])
    return dp, module, seen, folder, trainer


def test_the_progress_bar_shows_epsilon(uninterrupted):
    dp, _, _, _, trainer = uninterrupted
    assert trainer.progress_bar_metrics["epsilon"] == pytest.approx(dp.engine.get_epsilon())


@pytest.mark.parametrize("step", [2, 4])  # in the middle of the first epoch, at its end
def test_resuming_continues_epsilon_steps_and_batches_with_fresh_noise(uninterrupted, step):
    dp, module, seen, folder, _ = uninterrupted
    path = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(f"step={step}.ckpt"))
    resumed_seen = []
    resumed_dp = DPCallback(noise_multiplier=1.0, steps=6)
    resumed = Lit(classifier_columns(), batch_size=4, lr=0.1, seen=resumed_seen)
    _fit(resumed, resumed_dp, steps=6, ckpt_path=path)
    assert resumed_dp.engine.steps_taken == dp.engine.steps_taken == 6
    assert resumed_dp.engine.get_epsilon() == dp.engine.get_epsilon()
    assert len(resumed_seen) == len(seen) - 2 * step  # two micro-batches per step
    assert all(torch.equal(a, b) for a, b in zip(seen[2 * step:], resumed_seen))
    assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), resumed.parameters()))  # fresh noise


class FixedK(Lit):
    """Lit whose loader has ``max_batch_size=k`` ("auto" by default)."""

    def __init__(self, *args, k="auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.k = k

    def train_dataloader(self):
        return DPCallback.of(self.trainer).train_loader(torch.utils.data.TensorDataset(*self.data), self.batch_size,
                                                        max_batch_size=self.k, generator=torch.Generator().manual_seed(7))


def test_resuming_with_a_longer_plan_keeps_the_checkpoints_max_batch_size(tmp_path):
    """A checkpoint at step 2 of 3 planned steps (K "auto": 12), resumed for 30 (alone, K would be 14): the run keeps
    12, and draws what an uninterrupted run with K = 12 draws. (The noise recalibrated to the new plan with the
    checkpoint's K: tests/test_accelerate_integration.py.)"""
    first = DPCallback(noise_multiplier=1.0, steps=3, engine_kwargs={"seed": 0})
    _fit(FixedK(classifier_columns(), batch_size=4, lr=0.1), first, steps=2,
         callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    path = next(os.path.join(tmp_path, f) for f in os.listdir(tmp_path) if f.endswith("step=2.ckpt"))
    assert first.engine.max_batch_size == 12
    seen, reference_seen = [], []
    resumed = DPCallback(noise_multiplier=1.0, steps=30)
    _fit(FixedK(classifier_columns(), batch_size=4, lr=0.1, seen=seen), resumed, steps=6, ckpt_path=path)
    reference = DPCallback(noise_multiplier=1.0, steps=30)
    _fit(FixedK(classifier_columns(), batch_size=4, lr=0.1, seen=reference_seen, k=12), reference, steps=6)
    engine = resumed.engine
    assert engine.steps_taken == 6 and engine.max_batch_size == 12
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen, reference_seen[4:]))
    assert [(h["max_batch_size"], h["steps"]) for h in engine.privacy_report()["history"]] == [(12, 6)]
    with pytest.raises(ValueError, match="Pass max_batch_size=12 to DPCallback.train_loader"):
        _fit(FixedK(classifier_columns(), batch_size=4, k=14), DPCallback(noise_multiplier=1.0, steps=30), steps=6,
             ckpt_path=path)


class PlainLoader(Lit):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*self.data), batch_size=4, shuffle=True)


def test_settings_that_cannot_be_private_are_refused():
    with pytest.raises(ValueError, match="gradient_clip_val=1.0 clips the batch gradient"):
        _fit(Lit(classifier_columns()), DPCallback(noise_multiplier=1.0, steps=4), gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="trains on the loader it builds"):
        _fit(PlainLoader(classifier_columns()), DPCallback(noise_multiplier=1.0, steps=4))
    with pytest.raises(ValueError, match="max_batch_size='auto' needs the planned length"):
        _fit(Lit(classifier_columns()), DPCallback(noise_multiplier=1.0), steps=-1, max_epochs=-1,
             max_time="00:00:01:00")


def test_missing_lightning_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "dptrain.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'dptrain\[lightning\]'"):
        importlib.import_module("dptrain.integrations.lightning")
