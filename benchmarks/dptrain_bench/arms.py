"""The arms: the ways of training one model that a benchmark compares (non-private, dptrain's modes, Opacus, fastDP)."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dptrain import _checks
from dptrain.core.algorithms import CLIPPING_MODES

from .options import ALL_ARMS, FASTDP_ARM, NON_PRIVATE, OPACUS_ARMS
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
    """``autocast``: the forward and the loss under autocast to this dtype (the backward and the engines' own work
    outside it, as in mixed-precision training), in every arm."""
    # Plain SGD keeps no optimizer state, so memory differences come from clipping alone.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def losses(batch):
        with _autocast(batch, autocast):
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
        return _opacus_arm(name, model, task, batch_size, optimizer, autocast)
    if name == FASTDP_ARM:
        return _fastdp_arm(model, batch_size, optimizer, losses)
    raise _checks.unknown("arm", name, (*ALL_ARMS, FASTDP_ARM))


def _autocast(batch: dict, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(iter(batch.values())).device.type, dtype=dtype)


def _opacus_arm(name, model, task, batch_size, optimizer, autocast=None) -> Arm:
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
    # batch would give its position embedding per-sample gradients of batch 1 (unless the task decides for every arm).
    batched_positions = task.kind == "lm" if task.batched_positions is None else task.batched_positions
    if batched_positions and task.batched_positions is None:
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
            with _autocast(batch, autocast):
                loss = task.per_sample_loss(task.forward(wrapped, batch, batched_positions), batch).mean()
            loss.backward()
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)
    else:
        wrapped, dp_optimizer, criterion, _ = engine.make_private(
            **common, criterion=_PerSampleCriterion(task), grad_sample_mode="ghost")

        def step(batch):
            with _autocast(batch, autocast):
                loss = criterion(task.forward(wrapped, batch, batched_positions), batch)
            loss.backward()  # Opacus runs both backward passes here
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)

    return Arm(name, step, getattr(wrapped, "cleanup", None) or wrapped.remove_hooks, note)


def import_fastdp():
    """fastDP (awslabs/fast-differential-privacy, the book-keeping paper's own code) is not on PyPI: its source
    folder (the one holding the package ``fastDP``) is named by ``FASTDP_DIR``."""
    folder = os.environ.get("FASTDP_DIR")
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        import fastDP
        import fastDP.transformers_support
    except ImportError as exc:
        where = f"FASTDP_DIR={folder} holds no importable fastDP" if folder else "FASTDP_DIR is not set"
        raise ImportError(f"fastDP not available ({where}: set it to a folder holding the package fastDP, "
                          f"from awslabs/fast-differential-privacy): {exc}") from exc
    return fastDP


def _fastdp_arm(model, batch_size, optimizer, losses) -> Arm:
    fastDP = import_fastdp()
    # fastDP swaps Hugging Face models' forwards to batch their position ids, which breaks on current transformers;
    # the models here get [B, T] position ids from the task where a trainable layer sees them (issue 43's reference).
    fastDP.transformers_support.forward_swapper = lambda module: None
    engine = fastDP.PrivacyEngine(model, batch_size=batch_size, sample_size=SAMPLE_SIZE, noise_multiplier=1.0,
                                  max_grad_norm=1.0, epochs=1, clipping_mode="MixOpt", clipping_fn="Abadi")
    engine.attach(optimizer)

    def step(batch):
        losses(batch).mean().backward()  # fastDP's hooks clip per sample during this backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Arm(FASTDP_ARM, step, lambda: None, "clipping_fn Abadi; its Hugging Face forward swap left out")
