"""Private training with PyTorch Lightning: :class:`DPCallback`.

A ``LightningModule`` whose ``training_step`` returns one loss per sample, a Poisson loader, and the callback::

    from dptrain.integrations.lightning import DPCallback

    class Classifier(L.LightningModule):
        def training_step(self, batch, batch_idx):
            (x, y), mask = batch                                  # a FixedShapeBatch: K rows, the real ones first
            return F.cross_entropy(self(x), y, reduction="none")   # per-sample losses [K]

        def train_dataloader(self):
            return DPCallback.of(self.trainer).train_loader(train_set, batch_size=256)

    dp = DPCallback(target_epsilon=3.0, epochs=5, max_grad_norm=1.0)
    trainer = L.Trainer(max_epochs=5, callbacks=[dp], strategy="ddp", use_distributed_sampler=False)

What the callback does:

* **The loader.** :meth:`DPCallback.train_loader` builds the Poisson loader (``loaders.sharded_poisson_loader``):
  each step includes every example with probability ``q = batch_size / len(dataset)`` (``batch_size`` is the
  expected *logical* batch, over all processes and accumulated micro-batches), the draw cut to ``K``
  examples when larger and padded to K rows (``max_batch_size``, ``"auto"`` by default: the smallest K whose
  truncation costs a tenth of delta), and every process takes its share of every micro-batch of
  ``accumulate_grad_batches``: ``K / (accumulate_grad_batches * world_size)`` rows. Call it inside
  ``train_dataloader()`` (the callback then knows the trainer). The engine reads q and K from this loader;
  another loader is refused.
* **The step.** ``training_step`` returns per-sample losses ``[B]``. The callback routes Lightning's
  backward to ``engine.backward(losses, mask=batch.mask)``, the mask found in the batch whatever type your transfer
  hooks gave it, a batch with padding and no mask refused (it gives the strategy a precision plugin of the
  same class whose ``backward`` does that; everything else, autocast and the loss scaler included, is the
  original plugin's), and ``optimizer.step()`` applies the private gradient. Gradient accumulation,
  ``precision="bf16-mixed"`` and fp16 with a scaler (``plugins=[MixedPrecision("16-mixed", device)]``) work
  (``"bf16-true"``, bf16 parameters, is allowed but untested here); DDP (``strategy="ddp"``, with
  ``use_distributed_sampler=False``: the loader samples for every process itself) adds the noise once.
* **Checkpoints.** Lightning's checkpoints carry the engine's state (step count, accountant history, noise
  state: the callback's ``state_dict``) and the sampler's; ``fit(ckpt_path=...)`` resumes both, with fresh
  noise (``PrivacyEngine.load_state_dict``); a longer plan keeps the checkpoint's K (``max_batch_size="auto"``).
* **The progress bar** shows ``epsilon`` after every optimizer step (``log_epsilon=False`` turns it off).

Refused with the reason: ``gradient_clip_val`` (clipping the batch gradient has no role: the per-sample
``max_grad_norm`` is the clipping), several optimizers, strategies other than one device and DDP (FSDP and
DeepSpeed own the gradients), precision plugins other than Lightning's own (32/64-bit, mixed, half), and a
training loader that is not this callback's.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dptrain.integrations.lightning needs PyTorch Lightning: pip install 'dptrain[lightning]'") from err

from ..core.algorithms import DEFAULT_CLIPPING_MODE
from ..engine import PrivacyEngine
from .common import (
    check_run_state,
    engine_on,
    engine_settings,
    find_padding_mask,
    inner_optimizer,
    resumed_settings,
    run_state,
)
from .loaders import ShardedPoissonLoader, sharded_poisson_loader

__all__ = ["DPCallback"]

_PRECISIONS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


class _PrivateBackward(Precision):
    """Mixed into the strategy's own precision plugin class: Lightning's backward becomes the engine's."""

    _dp_callback: DPCallback

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        self._dp_callback._backward(tensor)


def _private_precision(plugin: Precision, callback: DPCallback) -> Precision:
    """A copy of ``plugin`` (same class, same state: autocast, scaler) whose ``backward`` calls the engine."""
    base = type(plugin)
    cls: type[_PrivateBackward] = type(f"Private{base.__name__}", (_PrivateBackward, base), {"__module__": __name__})
    private = cls.__new__(cls)
    private.__dict__.update(plugin.__dict__)
    private._dp_callback = callback
    return private


class DPCallback(pl.Callback):
    """Makes a Lightning ``fit`` private; see the module documentation.

    Exactly one of ``noise_multiplier`` or ``target_epsilon`` (then ``epochs`` or ``steps``, the planned run
    the noise is calibrated for; by default the trainer's ``max_steps`` / ``max_epochs``); ``target_delta``
    (default ``1 / (10 n)``), ``max_grad_norm`` (the per-sample clipping threshold), ``clipping_mode`` and any
    other ``PrivacyEngine`` keyword in ``engine_kwargs``. The engine is ``callback.engine`` once training starts.
    """

    def __init__(self, *, max_grad_norm: float = 1.0, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, target_delta: float | None = None, epochs: float | None = None,
                 steps: int | None = None, clipping_mode: str = DEFAULT_CLIPPING_MODE,
                 engine_kwargs: Mapping[str, Any] | None = None, log_epsilon: bool = True):
        super().__init__()
        self._privacy: dict[str, Any] = dict(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                             target_epsilon=target_epsilon, target_delta=target_delta)
        self._planned = (epochs, steps)
        self._engine_kwargs = {"clipping_mode": clipping_mode, **dict(engine_kwargs or {})}
        self.log_epsilon = log_epsilon
        self.engine: PrivacyEngine | None = None
        self.loader: ShardedPoissonLoader | None = None
        self._trainer: pl.Trainer | None = None
        self._settings: dict | None = None
        self._pending: dict | None = None
        self._mask: torch.Tensor | None = None
        self._accumulate = 1
        self._logged_steps = -1

    @staticmethod
    def of(trainer: pl.Trainer) -> DPCallback:
        """The trainer's DPCallback (for ``train_dataloader()``)."""
        found = [c for c in trainer.callbacks if isinstance(c, DPCallback)]  # type: ignore[attr-defined]  # (Lightning sets it in __init__, undeclared)
        if len(found) != 1:
            raise ValueError(f"the trainer has {len(found)} DPCallbacks; give it exactly one: "
                             "Trainer(callbacks=[DPCallback(...)])")
        return found[0]

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """At ``fit``: refuse settings the engine cannot train privately (other strategies, ``gradient_clip_val``,
        manual optimization, unknown precision plugins) and route Lightning's backward to the engine."""
        if stage != "fit":
            return
        problems = []
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            problems.append(f"strategy {type(strategy).__name__}: only one device and DDP are supported (FSDP and "
                            "DeepSpeed own the gradients the engine writes); use strategy='ddp'")
        elif isinstance(strategy, DDPStrategy) and getattr(trainer._accelerator_connector,
                                                           "use_distributed_sampler", False):
            problems.append("use_distributed_sampler=True would put a DistributedSampler into the Poisson loader: "
                            "pass Trainer(use_distributed_sampler=False); the loader samples for every process")
        plugin = strategy.precision_plugin
        if type(plugin) not in _PRECISIONS and not isinstance(plugin, _PrivateBackward):
            problems.append(f"precision plugin {type(plugin).__name__} is not one of Lightning's own "
                            "(32/64-bit, '16-mixed', 'bf16-mixed', half): it has not been checked with the engine")
        if trainer.gradient_clip_val:
            problems.append(f"gradient_clip_val={trainer.gradient_clip_val} clips the batch gradient, which has no "
                            "role in private training: the per-sample max_grad_norm is the clipping; remove it")
        if not pl_module.automatic_optimization:
            problems.append("manual optimization: return per-sample losses from training_step and let Lightning "
                            "step (automatic_optimization=True)")
        if problems:
            raise ValueError("DPCallback cannot train privately with these settings:\n- " + "\n- ".join(problems))
        if not isinstance(plugin, _PrivateBackward):
            strategy.precision_plugin = _private_precision(plugin, self)
        self._trainer = trainer
        self._accumulate = trainer.accumulate_grad_batches

    def train_loader(self, dataset, batch_size: int, *, max_batch_size: int | str | None = "auto",
                     collate_fn=None, generator: torch.Generator | None = None, num_workers: int = 0,
                     pin_memory: bool = False) -> ShardedPoissonLoader:
        """This process's Poisson loader (call it in ``train_dataloader()``): ``batch_size`` the expected logical
        batch over all processes and micro-batches, ``max_batch_size`` the fixed rows K of a step (``"auto"``, an
        int that ``accumulate_grad_batches * world_size`` divides, or None for batches of varying size).
        ``generator``: one seeded the same on every process for reproducible batches (default: secret)."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("DPCallback.train_loader needs the trainer: call it inside train_dataloader(), "
                               "after Trainer(callbacks=[this callback]).fit(...) has started")
        shares = trainer.accumulate_grad_batches * trainer.world_size
        epochs, steps = self._planned
        if epochs is None and steps is None:  # the trainer's plan
            steps = trainer.max_steps if trainer.max_steps > 0 else None
            epochs = trainer.max_epochs if steps is None and trainer.max_epochs and trainer.max_epochs > 0 else None
        self._settings = engine_settings(
            sample_size=len(dataset), batch_size=batch_size, shares=shares, steps=steps, epochs=epochs,
            max_batch_size=max_batch_size, engine_kwargs=self._engine_kwargs, **self._privacy)
        if self._pending is not None:  # fit(ckpt_path=...): the checkpoint's K, whatever the new plan would take
            self._settings = resumed_settings(self._settings, max_batch_size, self._pending, shares,
                                              "DPCallback.train_loader")
        self.loader = sharded_poisson_loader(
            dataset, batch_size, max_batch_size=self._settings["max_batch_size"],
            micro_batches=trainer.accumulate_grad_batches, num_replicas=trainer.world_size, rank=trainer.global_rank,
            generator=generator, collate_fn=collate_fn,
            num_workers=num_workers, pin_memory=pin_memory)
        self.loader.mask_call = ("return per-sample losses from training_step and keep the FixedShapeBatch (or its "
                                 "mask) in the batch: DPCallback gives the engine the mask it finds there")
        return self.loader

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the engine on the model as the strategy prepared it, restore a checkpoint's state, and attach it to
        the optimizer and the callback's loader."""
        loader = trainer.train_dataloader
        if loader is not self.loader or self._settings is None:
            raise ValueError("DPCallback trains on the loader it builds, whose sampling the accounting is for: "
                             "return callback.train_loader(dataset, batch_size=...) from train_dataloader()")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"DPCallback supports one optimizer, got {len(trainer.optimizers)}")
        # on the model as the strategy prepared it (DistributedDataParallel(pl_module) under DDP); a later fit
        # with a newly wrapped model gets a new engine that carries the steps taken
        model = trainer.strategy.model
        assert model is not None  # (the strategy has set the model up by the start of training)
        self.engine = engine_on(model, self.engine, self._settings)
        if self._pending is not None:
            self.engine.load_state_dict(self._pending["engine"])
            self._pending = None
        plugin = trainer.strategy.precision_plugin
        self.engine.attach(inner_optimizer(trainer.optimizers[0]), data_loader=loader,
                           grad_scaler=getattr(plugin, "scaler", None))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Detach the engine: the model is an ordinary module again."""
        if self.engine is not None:
            self.engine.detach()

    # ------------------------------------------------------------------ the step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        """Keep the fixed-shape batch's mask for the backward, found whatever type the batch has after the transfer
        hooks (refused where the batch has padding and no mask can be found)."""
        self._mask = None
        if self.loader is not None and self.loader.max_batch_size is not None:
            self._mask = find_padding_mask(batch, self.loader.recent_masks,
                                           "the batch that reached DPCallback.on_train_batch_start")

    def _backward(self, losses: torch.Tensor) -> None:
        if losses.dim() != 1:
            raise ValueError(f"with DPCallback, training_step returns one loss per sample, shape [B]; got "
                             f"{tuple(losses.shape)}. E.g. F.cross_entropy(logits, y, reduction='none')")
        # Lightning divides the step's output by accumulate_grad_batches; the engine divides by the batch size
        losses = losses * self._accumulate if self._accumulate != 1 else losses
        assert self.engine is not None  # (built by on_train_start)
        self.engine.backward(losses, mask=self._mask)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """Show the epsilon spent on the progress bar (``log_epsilon``), computed once per optimizer step."""
        engine = self.engine
        assert engine is not None  # (built by on_train_start)
        if self.log_epsilon and engine.steps_taken != self._logged_steps:
            self._logged_steps = engine.steps_taken
            self._epsilon = engine.get_epsilon()
        if self.log_epsilon and self._logged_steps > 0:
            pl_module.log("epsilon", self._epsilon, prog_bar=True, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The engine's state, saved in Lightning's checkpoints."""
        if self.engine is None:
            return dict(self._pending) if self._pending is not None else {}
        return run_state(self.engine, None)

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep a checkpoint's engine state, loaded into the engine when training starts."""
        if state_dict:
            self._pending = check_run_state(state_dict, "the DPCallback state of this checkpoint")

    def privacy_report(self, delta: float | None = None) -> dict:
        """The engine's ``privacy_report`` (once training has started)."""
        if self.engine is None:
            raise RuntimeError("no engine yet: the report exists once training has started")
        return self.engine.privacy_report(delta)
