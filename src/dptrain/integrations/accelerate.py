"""Private training with Hugging Face Accelerate: :func:`make_private`.

What goes where::

    from accelerate import Accelerator
    from accelerate.utils import send_to_device
    from dptrain.integrations.accelerate import make_private

    accelerator = Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, optimizer)        # the model and optimizer: prepared as usual
    private = make_private(accelerator, model, optimizer, train_set,  # the dataset: NOT prepared
                           batch_size=256, target_epsilon=3.0, epochs=5, max_grad_norm=1.0)
    accelerator.load_state(...)                                     # (to resume: the engine's and sampler's state too)
    for batch in private.loader:                                    # this process's micro-batches
        (x, y), mask = send_to_device(batch, accelerator.device)
        with accelerator.accumulate(model):
            losses = F.cross_entropy(model(x), y, reduction="none")  # per-sample losses
            private.backward(losses, mask)                         # not accelerator.backward
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state(...)                                     # carries the engine's and sampler's state

* **The model and optimizer** are the prepared ones: the engine is built on the prepared model (the DDP
  wrapper; under FSDP2 the sharded model) and attached to the torch optimizer inside Accelerate's wrapper,
  whose ``step`` (through the loss scaler with ``mixed_precision="fp16"``) applies the private gradient.
* **The data** is sampled by dptrain, not by ``accelerator.prepare`` (which would shard batches across
  processes, and Poisson sampling is about the whole logical batch): ``private.loader`` draws each step's
  logical batch (expected ``batch_size`` examples over all processes and micro-batches, cut to K and padded to
  K rows with ``max_batch_size``, ``"auto"`` by default) and gives every process its share of each of the
  ``gradient_accumulation_steps`` micro-batches (``loaders.sharded_poisson_loader``). Batches come on the CPU.
  Do not prepare ``private.loader`` either: a backward without the mask of a batch a prepared loader drew is
  refused (the engine saw none of its batches, so it cannot tell their padding rows).
* **The backward** is ``private.backward(losses, mask)``: per-sample losses, not divided by the accumulation
  steps (the engine divides the noisy sum by the expected batch size), through the loss scaler when there is
  one. ``accelerator.accumulate(model)`` decides when ``optimizer.step()`` steps, as usual; a step that does
  not fall on the loader's logical batches is refused. ``accelerator.backward(loss)``, or ``private.backward``
  without the mask, of a batch with padding rows is refused (it would clip them as samples).
* **Checkpoints.** ``make_private`` registers ``private`` with ``accelerator.register_for_checkpointing``:
  ``save_state`` / ``load_state`` carry the engine's state (step count, accountant history, noise state; the
  noise after loading is fresh) and the sampler's, and the loader resumes where it stopped (do not skip
  batches with ``skip_first_batches``). A longer plan keeps the checkpoint's K (``max_batch_size="auto"``):
  ``load_state`` builds ``private.engine`` again with it, calibrated to the new plan.

Refused with the fix: DeepSpeed, FSDP1, ``torch.compile`` (``dynamo_backend``), fp8, an unprepared model or
optimizer under several processes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("dptrain.integrations.accelerate needs Hugging Face Accelerate: "
                      "pip install 'dptrain[accelerate]'") from err

from ..core.algorithms import DEFAULT_CLIPPING_MODE
from ..core.distributed import is_dtensor
from ..engine import PrivacyEngine
from .common import check_run_state, engine_settings, inner_optimizer, resumed_settings, run_state
from .loaders import ShardedPoissonLoader, sharded_poisson_loader

__all__ = ["PrivateTraining", "make_private"]


def _refusals(accelerator: accelerate.Accelerator, model: nn.Module, optimizer) -> list[str]:
    problems = []
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        problems.append("DeepSpeed: its ZeRO stages own the gradient buffers the engine writes; use DDP or FSDP2")
    if kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        problems.append("FSDP1 hides the layers' weights in flat parameters: use FSDP2 (fsdp_version=2)")
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP,
                    DistributedType.DEEPSPEED):
        problems.append(f"distributed type {kind}: not checked with the engine; use one device, DDP or FSDP2")
    dynamo = getattr(accelerator.state, "dynamo_plugin", None)
    if dynamo is not None and str(getattr(dynamo, "backend", "NO")).upper().split(".")[-1] != "NO":
        problems.append("dynamo_backend (torch.compile): compiled models bypass the per-layer hooks the engine "
                        "relies on; build the Accelerator without it")
    if accelerator.mixed_precision == "fp8":
        problems.append("fp8 mixed precision has not been checked with the engine: use 'bf16' or 'fp16'")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != accelerator.num_processes:
        problems.append(f"torch.distributed runs {dist.get_world_size()} processes but the Accelerator uses "
                        f"{accelerator.num_processes} (on a CPU, Accelerate runs several processes only with "
                        "Accelerator(cpu=True)): every process would train alone, with its own noise")
    if not isinstance(optimizer, AcceleratedOptimizer):
        problems.append("the optimizer was not prepared: pass the one returned by accelerator.prepare (its step "
                        "runs the loss scaler and skips the accumulation steps)")
    if accelerator.num_processes > 1 and not (isinstance(model, nn.parallel.DistributedDataParallel)
                                              or any(is_dtensor(p) for p in model.parameters())):
        problems.append(f"{accelerator.num_processes} processes but the model is not wrapped or sharded: pass the "
                        "model returned by accelerator.prepare")
    return problems


class PrivateTraining:
    """The engine, the loader and the backward of a private Accelerate run (built by :func:`make_private`);
    registered for Accelerate's checkpoints through ``state_dict`` / ``load_state_dict``."""

    def __init__(self, accelerator: accelerate.Accelerator, engine: PrivacyEngine, loader: ShardedPoissonLoader,
                 *, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 settings: Mapping[str, Any] | None = None, max_batch_size: int | str | None = "auto"):
        self.accelerator, self.engine, self.loader = accelerator, engine, loader
        self._micro = 0  # micro-batches back-propagated in the current logical batch
        # what a resume keeping its checkpoint's K builds the engine again from (the model as prepared, the torch
        # optimizer, the engine's settings, max_batch_size as the user gave it)
        self._model, self._optimizer = model, optimizer
        self._settings, self._max_batch_size = dict(settings or {}), max_batch_size

    def backward(self, losses: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Back-propagate this micro-batch's per-sample losses ``[B]`` (with the fixed-shape ``mask``)."""
        accumulation, before = self.loader.micro_batches, self._micro
        self._micro = self._micro % accumulation + 1
        at_step = self._micro == accumulation
        if accumulation > 1 and self.accelerator.sync_gradients != at_step:
            position, self._micro = self._micro, 0
            raise RuntimeError(
                f"the loader makes {accumulation} micro-batches per logical batch, but the optimizer would "
                f"{'step' if self.accelerator.sync_gradients else 'not step'} after micro-batch {position} of them: "
                "wrap each micro-batch in `with accelerator.accumulate(model):`, and start iterating "
                "private.loader at the start of a logical batch. Nothing of this micro-batch was accumulated")
        scaler = self.accelerator.scaler
        try:
            self.engine.backward(scaler.scale(losses) if scaler is not None else losses, mask=mask)
        except BaseException:
            self._micro = before  # a refused micro-batch was not back-propagated: it may come again
            raise

    def state_dict(self) -> dict:
        """The engine's and the sampler's state (``accelerator.save_state`` saves it)."""
        return run_state(self.engine, self.loader.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """Restore the engine's and the sampler's state (``accelerator.load_state`` calls it)."""
        state = check_run_state(state, "the dptrain state of this Accelerate checkpoint")
        if self._model is not None:
            settings = resumed_settings(self._settings, self._max_batch_size, state,
                                        self.loader.micro_batches * self.accelerator.num_processes,
                                        "make_private")
            if settings["max_batch_size"] != self.engine.max_batch_size:
                self._keep_max_batch_size(settings)
        self.engine.load_state_dict(state["engine"])
        self.loader.load_state_dict(state["sampler"])
        self._micro = 0

    def _keep_max_batch_size(self, settings: dict) -> None:
        """The checkpoint's K (a longer plan would take another): the engine built again with it, calibrated to the
        new plan, and the loader drawing with it."""
        assert self._model is not None and self._optimizer is not None  # (called where the model was given)
        engine = PrivacyEngine(self._model, **settings)
        self.loader.set_max_batch_size(settings["max_batch_size"])  # (refused while the loader is iterated)
        self.engine.detach()
        engine.attach(self._optimizer, data_loader=self.loader, grad_scaler=self.accelerator.scaler)
        self.engine, self._settings = engine, settings

    def privacy_report(self, delta: float | None = None) -> dict:
        """The engine's ``privacy_report``."""
        return self.engine.privacy_report(delta)


def make_private(accelerator: accelerate.Accelerator, model: nn.Module, optimizer, train_dataset, *,
                 batch_size: int, max_grad_norm: float = 1.0, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, target_delta: float | None = None,
                 epochs: float | None = None, steps: int | None = None, max_batch_size: int | str | None = "auto",
                 clipping_mode: str = DEFAULT_CLIPPING_MODE, collate_fn=None,
                 generator: torch.Generator | None = None, num_workers: int = 0,
                 engine_kwargs: Mapping[str, Any] | None = None) -> PrivateTraining:
    """The engine on the prepared ``model`` and ``optimizer``, and the Poisson loader of ``train_dataset``.

    ``batch_size``: the expected logical batch over all processes and the accelerator's
    ``gradient_accumulation_steps``. Exactly one of ``noise_multiplier`` or ``target_epsilon`` (then ``epochs``
    or ``steps``); ``max_batch_size``: the fixed rows K of a step (``"auto"``, an int that the accumulation
    steps times the processes divide, or None for Poisson batches of varying size). ``generator``: seeded the
    same on every process for reproducible batches (default: a secret seed shared by the processes). Other
    ``PrivacyEngine`` keywords go in ``engine_kwargs``. See the module documentation.
    """
    problems = _refusals(accelerator, model, optimizer)
    if problems:
        raise ValueError("make_private cannot train privately with these settings:\n- " + "\n- ".join(problems))
    micro = accelerator.gradient_accumulation_steps
    settings = engine_settings(
        sample_size=len(train_dataset), batch_size=batch_size, shares=micro * accelerator.num_processes,
        max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
        target_delta=target_delta, steps=steps, epochs=epochs, max_batch_size=max_batch_size,
        engine_kwargs={"clipping_mode": clipping_mode, **dict(engine_kwargs or {})})
    loader = sharded_poisson_loader(train_dataset, batch_size, max_batch_size=settings["max_batch_size"],
                                    micro_batches=micro, num_replicas=accelerator.num_processes,
                                    rank=accelerator.process_index, generator=generator, collate_fn=collate_fn,
                                    num_workers=num_workers, pin_memory=accelerator.device.type == "cuda")
    loader.mask_call = "private.backward(losses, mask) with the batch's mask (accelerator.backward(loss) has none)"
    engine = PrivacyEngine(model, **settings)
    engine.attach(inner_optimizer(optimizer), data_loader=loader, grad_scaler=accelerator.scaler)
    private = PrivateTraining(accelerator, engine, loader, model=model, optimizer=inner_optimizer(optimizer),
                              settings=settings, max_batch_size=max_batch_size)
    accelerator.register_for_checkpointing(private)
    return private
