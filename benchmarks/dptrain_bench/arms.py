"""The arms: the ways of training one model that a benchmark compares (non-private, dptrain's modes, Opacus)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dptrain import checks
from dptrain.algorithms import CLIPPING_MODES

from .options import ALL_ARMS, NON_PRIVATE, OPACUS_ARMS
from .zoo import SEED, Task

SAMPLE_SIZE = 50_000  # dataset size given to the engines: only the sample rate (accounting) depends on it


@dataclass
class Arm:
    """One way of training a model: ``step(batch)`` runs forward, backward and the optimizer step."""

    name: str
    step: Callable[[dict], None]
    close: Callable[[], None]
    note: str = ""  # how the model had to be changed for this arm, if at all


class _PerSampleCriterion(nn.Module):
    """The task's loss as a criterion with a ``reduction`` attribute, as Opacus' ghost mode needs."""

    def __init__(self, task: Task):
        super().__init__()
        self.task = task
        self.reduction = "mean"

    def forward(self, output, batch):
        losses = self.task.per_sample_loss(output, batch)
        return losses if self.reduction == "none" else (losses.mean() if self.reduction == "mean" else losses.sum())


def make_arm(name: str, model: nn.Module, task: Task, batch_size: int, autocast: torch.dtype | None = None) -> Arm:
    """``autocast``: the forward and the loss under autocast to this dtype (the backward and the engine's own work
    outside it, as in mixed-precision training); dptrain's arms and non-private only."""
    # Plain SGD keeps no optimizer state, so memory differences come from clipping alone.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def losses(batch):
        device = next(iter(batch.values())).device.type
        with torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext():
            return task.per_sample_loss(task.forward(model, batch), batch)

    if name == NON_PRIVATE:
        def step(batch):
            losses(batch).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Arm(name, step, lambda: None)
    if name in CLIPPING_MODES:
        from dptrain.engine import PrivacyEngine

        engine = PrivacyEngine(model, batch_size=batch_size, sample_size=SAMPLE_SIZE, max_grad_norm=1.0,
                               noise_multiplier=1.0, clipping_mode=name, seed=SEED)
        engine.attach(optimizer)

        def step(batch):
            engine.backward(losses(batch))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Arm(name, step, engine.detach)
    if name in OPACUS_ARMS:
        if autocast is not None:
            raise ValueError(f"{name}: the Opacus arms run in the model's own dtype only (autocast={autocast})")
        return _opacus_arm(name, model, task, batch_size, optimizer)
    raise checks.unknown("arm", name, ALL_ARMS)


def _opacus_arm(name, model, task, batch_size, optimizer) -> Arm:
    import opacus
    from torch.utils.data import DataLoader, TensorDataset

    # Opacus' full backward hooks refuse in-place activations (torchvision's ReLU(inplace=True)):
    # the usual user fix, applied to this arm's copy only.
    inplace = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for m in inplace:
        m.inplace = False
    notes = []
    if inplace:
        notes.append(f"in-place turned off on {len(inplace)} activation modules (Opacus refuses them)")
    # Opacus needs every layer's input batched: GPT-2's position ids [1, T] broadcast over the
    # batch would give its position embedding per-sample gradients of batch 1.
    batched_positions = task.kind == "lm"
    if batched_positions:
        notes.append("position ids passed as [B, T] (Opacus cannot take them broadcast over the batch)")
    note = "; ".join(notes)
    # Only the loader's length matters to Opacus here (it sets the sample rate); batches are ours.
    loader = DataLoader(TensorDataset(torch.zeros(SAMPLE_SIZE, 1)), batch_size=batch_size)
    engine = opacus.PrivacyEngine(accountant="rdp")
    common = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                  poisson_sampling=False)
    if name == "opacus-hooks":
        wrapped, dp_optimizer, _ = engine.make_private(**common, grad_sample_mode="hooks")

        def step(batch):
            task.per_sample_loss(task.forward(wrapped, batch, batched_positions), batch).mean().backward()
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)
    else:
        wrapped, dp_optimizer, criterion, _ = engine.make_private(
            **common, criterion=_PerSampleCriterion(task), grad_sample_mode="ghost")

        def step(batch):
            criterion(task.forward(wrapped, batch, batched_positions), batch).backward()  # Opacus runs both backward passes here
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)

    return Arm(name, step, getattr(wrapped, "cleanup", None) or wrapped.remove_hooks, note)
