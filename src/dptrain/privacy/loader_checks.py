"""Does the loader given to ``attach`` sample what the engine accounts for? Its unit, cyclic groups, rate and
truncation are checked once, at ``attach``; with cyclic Poisson sampling, each step is checked to train on the
loader's batch of that step; the padding of its fixed-shape batches is read at every backward (``loader_padding``).
(What the batches actually hold, step after step, is ``sampling``'s test.)"""
from __future__ import annotations

import math
from typing import Any, Callable

from .. import data
from ..data.cyclic import cyclic_groups_of


def check_loader(loader: Any, config: Any) -> bool:
    """Whether ``loader`` samples by Poisson sampling; one that does but with another unit, groups, rate or
    ``max_batch_size`` than the engine accounts for (``config``, the engine's ``EngineConfig``) is refused."""
    if not data.is_poisson_loader(loader):
        return False
    unit = getattr(loader, "privacy_unit", "example")
    if unit != config.privacy_unit:
        raise ValueError(
            f"the loader samples {unit}s but the engine's privacy_unit is {config.privacy_unit!r}: the "
            "guarantee is about the unit that is sampled and clipped. Build both for the same unit "
            "(PrivacyEngine(privacy_unit='user', sample_size=<number of users>) with "
            "poisson_loader(..., users=...))"
        )
    groups = cyclic_groups_of(loader)
    if groups != config.cyclic_groups:
        raise ValueError(
            f"the loader samples with cyclic_groups={groups} but the engine (noise={config.noise!r}) accounts "
            f"for cyclic_groups={config.cyclic_groups}: build the loader with poisson_loader(..., "
            f"cyclic_groups={config.cyclic_groups})" + (" (amplified banded noise needs cyclic Poisson "
                                                       "sampling over at least `bands` groups)"
                                                       if config.noise == "bandmf" else ""))
    if not math.isclose(loader.sample_rate, config.sample_rate, rel_tol=1e-9):
        within = " * cyclic_groups" if config.cyclic_groups > 1 else ""
        raise ValueError(
            f"the loader samples with q={loader.sample_rate:.6g} but the engine accounts for "
            f"q = batch_size{within} / sample_size = {config.sample_rate:.6g}: build both from the same batch "
            "size and dataset size"
        )
    loader_k = getattr(getattr(loader, "batch_sampler", None), "max_batch_size", None)
    if loader_k != config.max_batch_size:
        raise ValueError(
            f"the loader makes batches with max_batch_size={loader_k!r} but the engine accounts for "
            f"max_batch_size={config.max_batch_size!r}: give PrivacyEngine the loader's max_batch_size "
            "(truncating batches changes the privacy accounting)"
        )
    return True


def not_poisson_warning(loader: Any) -> str:
    return (f"{type(loader).__name__} does not sample batches by Poisson sampling, which the privacy accounting "
            "assumes: the reported epsilon does not hold for fixed-size shuffled batches. "
            "Use dptrain.data.poisson_loader(dataset, batch_size=...)")


def no_cyclic_loader_warning(noise: str, groups: int) -> str:
    return (f"noise={noise!r}: no data_loader was given to attach(), so the engine cannot check that the "
            f"batches are sampled as its accounting assumes (cyclic Poisson sampling over {groups} "
            "groups, batch t of the loader at step t). Pass attach(optimizer, data_loader=poisson_loader(..., "
            f"cyclic_groups={groups}))")


def check_cyclic_step(loader: Any, step: int, groups: int) -> None:
    """Step ``step`` must train on the cyclic loader's batch ``step``: its group is ``step mod groups``, and the
    accounting (a unit's steps ``groups`` apart) holds only if no batch is skipped, repeated or merged into another
    step. (``loader`` None: it is gone, nothing to check.)"""
    if loader is None:
        return
    last = getattr(loader, "last_batch_step", None)
    if last != step:
        drew = "no batch from it yet" if last is None else f"its batch {last} last"
        raise RuntimeError(
            f"step {step} of this run with cyclic Poisson sampling over {groups} groups must train "
            f"on the loader's batch {step} (group {step % groups}), but the loop drew {drew}: "
            "the privacy accounting assumes each unit's steps are cyclic_groups apart. Take exactly one "
            "optimizer step per batch of the loader, in order (split a batch into physical batches with "
            "dptrain.data.split_batches), and resume the loader's state_dict with the engine's. Nothing was "
            "applied")


def loader_padding(loader: Any) -> tuple[int, int | None, str] | None:
    """(batches handed out, the fewest real rows of the last ones that carry padding or None, the call that gives the
    engine their masks) of a loader that records them (``DPDataLoader``); None for one that does not (or is gone)."""
    if not hasattr(loader, "recent_real_rows") or drawn_elsewhere(loader):
        return None
    return loader.batches_handed_out, loader.recent_real_rows, loader.mask_call


def loader_rows(loader: Any) -> int | None:
    """The most rows of the last batches a loader that records them handed out (``DPDataLoader``), else None (also
    where another loader drew them: ``drawn_elsewhere``)."""
    if not hasattr(loader, "recent_batch_rows") or drawn_elsewhere(loader):
        return None
    return loader.recent_batch_rows


def drawn_elsewhere(loader: Any) -> bool:
    """Whether another ``DataLoader`` built on the attached loader's sampler drew its batches now
    (``accelerator.prepare(loader)``, ``DataLoader(..., batch_sampler=loader.batch_sampler)``, the Trainer's batches
    skipped on resuming): the attached loader handed out none of them, and its record of their rows says nothing."""
    return bool(getattr(getattr(loader, "batch_sampler", None), "drawn_elsewhere", False))


def loader_watch(loader: Callable[[], Any]):
    """What the engine reads of the attached loader (a weak reference) at each backward: ``loader_rows``,
    ``loader_padding`` and ``drawn_elsewhere_refusal``."""
    return (lambda: loader_rows(loader()), lambda: loader_padding(loader()),
            lambda: drawn_elsewhere_refusal(loader()))


def drawn_elsewhere_refusal(loader: Any) -> str | None:
    """The refusal of a backward without the batch's mask where another loader drew the batches (``drawn_elsewhere``):
    the engine cannot tell which rows are padding, and clipped them as samples: 1.7 R, silent (an outside probe, with
    ``accelerator.prepare(private.loader)``). With the mask it knows them; batches of varying size have none."""
    if drawn_elsewhere(loader) and getattr(loader, "max_batch_size", None) is not None:
        return (
            "the batches of the loader attached to the engine were drawn through another DataLoader built on its "
            "sampler (accelerator.prepare(loader), or DataLoader(..., batch_sampler=loader.batch_sampler)), so the "
            "engine cannot tell which rows of a backward without the batch's mask are padding: it would clip them "
            f"as samples. Give the mask: {loader.mask_call}; or iterate the attached loader itself (for batch in "
            "loader: ...; with Accelerate, do not prepare private.loader: move each batch with "
            "accelerate.utils.send_to_device). Nothing of this backward was accumulated")
    return None
