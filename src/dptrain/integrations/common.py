"""What the framework integrations share: the engine's settings for a planned run, the engine built on the model
the framework prepared, the optimizer under the framework's wrapper, and the checkpoint of a private run."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import _checks, accounting
from ..core.distributed import is_dtensor
from ..data import FixedShapeBatch, FixedShapeUserBatch
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
    batch_size = _checks.positive_int("batch_size", batch_size, "the expected logical batch size")
    sample_size = _checks.positive_int("sample_size", sample_size, "the dataset size")
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
        max_batch_size = _checks.positive_int("max_batch_size", max_batch_size, "the fixed rows of a logical batch, K")
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


_UNKNOWN = object()


def checkpoint_max_batch_size(state: Mapping) -> Any:
    """The K a private run's checkpoint (``run_state``) drew its batches with: its sampler's, else that of its last
    step in the engine's ledger; ``_UNKNOWN`` for a checkpoint of no step and no sampler."""
    sampler = state.get("sampler")
    if isinstance(sampler, Mapping) and "max_batch_size" in sampler:
        return sampler["max_batch_size"]
    segments = ((state.get("engine") or {}).get("ledger") or {}).get("segments") or []
    return segments[-1][3] if segments else _UNKNOWN


def resumed_settings(settings: Mapping[str, Any], requested: Any, state: Mapping, shares: int,
                     where: str) -> dict[str, Any]:
    """The engine's settings for a run resumed from ``state``, with the checkpoint's K.

    A longer plan changes the automatic K, but the interrupted epoch's batches are drawn again only with the K they
    were drawn with: ``requested="auto"`` keeps the checkpoint's (the noise is calibrated to the new plan with it,
    and the accounting composes every step with it); a K given explicitly must be the checkpoint's. ``where``: what
    the user gives K to, named in the refusal. Refused where the checkpoint's K does not split into ``shares``
    pieces, or truncates too often over the new plan."""
    saved = checkpoint_max_batch_size(state)
    if saved is _UNKNOWN or saved == settings["max_batch_size"]:
        return dict(settings)
    if requested != "auto" or saved is None or settings["max_batch_size"] is None:
        raise ValueError(
            f"this checkpoint's batches were drawn with max_batch_size={saved!r}, but this run draws them with "
            f"max_batch_size={settings['max_batch_size']!r}: the interrupted epoch can only be drawn again with the same "
            f"K. Pass max_batch_size={saved!r} to {where}" + (" (or 'auto', which keeps the checkpoint's)"
                                                              if saved is not None else ""))
    if saved % shares:
        raise ValueError(
            f"this checkpoint's batches were drawn with max_batch_size={saved}, which does not split into {shares} "
            "pieces of equal rows (micro-batches times processes): resume with micro-batches times processes "
            f"dividing {saved}, as the checkpoint's run did")
    resumed = {**settings, "max_batch_size": saved}
    steps = resumed.get("steps")
    if steps is not None and resumed.get("target_epsilon") is not None:
        n = resumed["sample_size"]
        delta = accounting.default_delta(n) if resumed.get("target_delta") is None else resumed["target_delta"]
        try:
            accounting.poisson_delta(delta, n, resumed["batch_size"] / n, saved, steps)
        except ValueError as err:
            raise ValueError(
                f"resuming keeps this checkpoint's max_batch_size={saved} (the interrupted epoch is drawn again with "
                f"it; the new plan alone would take a larger one), but over the {steps} planned steps it truncates "
                f"too often for delta={delta:.3g}: plan fewer steps, or give a larger target_delta ({err})") from err
    return resumed


def find_padding_mask(batch: Any, known: list[torch.Tensor], where: str) -> torch.Tensor | None:
    """The fixed-shape mask of ``batch`` as a framework hands it to the training step, whatever a user's hooks made
    of the loader's ``FixedShapeBatch`` (a tuple, a list, a dict, a dataclass): the mask of a ``FixedShapeBatch``
    inside it, else a ``[K]`` bool tensor inside it equal to the mask of one of the loader's last batches
    (``known``: the batch trained on is one of them). None where no mask is needed: none of those batches has
    padding. Refused (nothing applied) when there is padding and no mask, or several masks that differ."""
    typed: list[torch.Tensor] = []
    bare: list[torch.Tensor] = []
    _collect_masks(batch, typed, bare, 0, set())
    if not typed and known:  # a bare bool tensor is the mask only if it is one the loader made
        known_cpu = [k.detach().cpu() for k in known]
        typed = [t for t in bare if t.shape == known_cpu[0].shape
                 and any(torch.equal(t.detach().cpu(), k) for k in known_cpu)]
    distinct: list[torch.Tensor] = []
    for mask in typed:
        if not any(mask.shape == d.shape and torch.equal(mask.detach().cpu(), d.detach().cpu()) for d in distinct):
            distinct.append(mask)
    if len(distinct) == 1:
        return distinct[0]
    kind = type(batch).__name__
    if len(distinct) > 1:
        raise ValueError(
            f"{where} (a {kind}) holds {len(distinct)} different fixed-shape masks, so which rows are padding is "
            "unknown: keep exactly one FixedShapeBatch (or its mask) in the batch. Nothing of this step was applied")
    if all(bool(k.all()) for k in known):
        return None  # every row of the batch trained on is real
    raise ValueError(
        f"{where} (a {kind}) holds no fixed-shape mask, but the loader pads every batch to K rows and this step's "
        "batch has padding rows, which a backward without the mask would clip as samples (removing one sample could "
        "then move the step by up to 2 x max_grad_norm). Keep the FixedShapeBatch, or at least its mask tensor, in "
        "the batch your on_before_batch_transfer / transfer_batch_to_device / on_after_batch_transfer return (a "
        "tuple, list, dict or dataclass holding it is fine). Nothing of this step was applied")


def _collect_masks(obj: Any, typed: list, bare: list, depth: int, seen: set[int]) -> None:
    """The masks of fixed-shape batches inside ``obj`` (``typed``) and its 1-D bool tensors (``bare``)."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype == torch.bool and obj.dim() == 1:
            bare.append(obj)
        return
    if depth > 32 or id(obj) in seen:  # (a structure that contains itself)
        return
    seen.add(id(obj))
    if isinstance(obj, (FixedShapeBatch, FixedShapeUserBatch)):
        typed.append(obj.mask)
        return
    children: Sequence[Any]
    if isinstance(obj, Mapping):
        children = list(obj.values())
    elif isinstance(obj, (tuple, list)):
        children = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return
    for child in children:
        _collect_masks(child, typed, bare, depth + 1, seen)
