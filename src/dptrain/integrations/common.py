"""What the framework integrations share: the engine's settings for a planned run, the engine built on the model
the framework prepared, the optimizer under the framework's wrapper, and the checkpoint of a private run."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import accounting, checks
from ..distributed import is_dtensor
from ..engine import PrivacyEngine
from .loaders import fixed_shape_rows, steps_per_epoch

#: The keywords an integration sets itself: ``engine_kwargs`` may not give them again.
OWN_KEYWORDS = frozenset({"batch_size", "sample_size", "max_grad_norm", "noise_multiplier", "target_epsilon",
                          "target_delta", "epochs", "steps", "max_batch_size"})

#: What a private run's checkpoint holds (``state_dict`` of the integrations' helpers).
STATE_VERSION = 1


def engine_settings(*, sample_size: int, batch_size: int, shares: int, max_grad_norm: float,
                    noise_multiplier: float | None, target_epsilon: float | None, target_delta: float | None,
                    steps: int | None, epochs: float | None, max_batch_size: int | str | None,
                    engine_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``PrivacyEngine`` keywords of a planned run (and the fixed-shape K it samples with).

    ``max_batch_size``: an int (the global K, a multiple of ``shares``), ``"auto"`` (the smallest K whose
    truncation costs at most a tenth of delta over the planned steps, rounded up to a multiple of
    ``shares``: ``loaders.fixed_shape_rows``), or None (Poisson batches of varying size, never truncated).
    ``"auto"`` needs the planned length: ``steps`` or ``epochs``.
    """
    extra = dict(engine_kwargs or {})
    clash = sorted(OWN_KEYWORDS & set(extra))
    if clash:
        raise ValueError(f"engine_kwargs must not repeat the integration's own arguments {clash}: give them directly")
    batch_size = checks.positive_int("batch_size", batch_size, "the expected logical batch size")
    sample_size = checks.positive_int("sample_size", sample_size, "the dataset size")
    if batch_size > sample_size:
        raise ValueError(f"the logical batch size {batch_size} exceeds the training set size {sample_size}")
    if steps is None and epochs is not None:
        steps = math.ceil(epochs * steps_per_epoch(batch_size / sample_size))
    if max_batch_size == "auto":
        if steps is None:
            raise ValueError("max_batch_size='auto' needs the planned length of training (steps or epochs) to "
                             "bound the truncation; give max_batch_size=K or the planned length")
        delta = accounting.default_delta(sample_size) if target_delta is None else target_delta
        max_batch_size = fixed_shape_rows(sample_size, batch_size, delta, steps, shares)
    elif max_batch_size is not None:
        max_batch_size = checks.positive_int("max_batch_size", max_batch_size, "the fixed rows of a logical batch, K")
        if max_batch_size % shares:
            raise ValueError(
                f"max_batch_size={max_batch_size} does not split into {shares} pieces of equal rows (micro-batches "
                f"times processes): use a multiple of {shares}, e.g. {-(-max_batch_size // shares) * shares}")
    settings = dict(batch_size=batch_size, sample_size=sample_size, max_grad_norm=max_grad_norm,
                    noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
                    max_batch_size=max_batch_size, **extra)
    if target_epsilon is not None:
        settings["steps"] = steps
    return settings


def engine_on(model: nn.Module, engine: PrivacyEngine | None, settings: Mapping[str, Any]) -> PrivacyEngine:
    """An engine for ``model`` as the framework prepared it: ``engine`` itself if it was built on that model and
    its parameters, else a new one with the same settings (DDP wraps the model, FSDP2 replaces the parameters by
    shards), carrying over the steps already taken through the engine's own checkpoint."""
    if engine is not None and _built_for(engine, model):
        return engine
    fresh = PrivacyEngine(model, **settings)
    if engine is not None and engine.steps_taken:
        fresh.load_state_dict(engine.state_dict())
    return fresh


def _built_for(engine: PrivacyEngine, model: nn.Module) -> bool:
    if model is not engine.model:
        return False  # a DDP wrapper around it, or another model
    sharded = any(is_dtensor(p) for p in model.parameters())
    return not sharded or engine._parallel is not None  # (FSDP2 sharded the model after the engine was built)


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under a framework's wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``): the one whose ``step`` the engine hooks."""
    seen = set()
    while not _hookable(optimizer) and hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a framework's wrapper of one), got "
                        f"{type(optimizer).__name__}")
    return optimizer


def _hookable(optimizer) -> bool:
    # AcceleratedOptimizer subclasses Optimizer without running its __init__: it has no step hooks of its own
    return isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks")


def run_state(engine: PrivacyEngine, sampler_state: dict | None) -> dict:
    """A private run's checkpoint: the engine's (step count, accountant history, noise state) and the sampler's."""
    return {"version": STATE_VERSION, "engine": engine.state_dict(), "sampler": sampler_state}


def check_run_state(state: Any, where: str) -> dict:
    if not isinstance(state, Mapping) or "engine" not in state or "version" not in state:
        raise ValueError(f"{where} is not a dptrain checkpoint (expected the dict of run_state)")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"{where} was written by another version of dptrain's integrations "
                         f"(version {state['version']!r}, this one reads {STATE_VERSION})")
    return dict(state)
