"""``PrivacyEngine(noise=..., bands=..., buffers=..., cyclic_groups=..., workload_momentum=...)``: checked, and
turned into a :class:`~dptrain.correlated.privacy.CorrelatedMechanism` (its strategy optimized, or read from
the cache) for the planned run."""
from __future__ import annotations

from typing import Any

from .. import checks
from .privacy import CorrelatedMechanism
from .strategies import BandedToeplitz, BufferedToeplitz, banded_strategy, blt_strategy, check_noising_stable

NOISES = ("gaussian", "bandmf", "blt")
DEFAULT_BLT_BUFFERS = 4


def noise_kind(noise: Any, bands: Any, buffers: Any, cyclic_groups: Any) -> tuple[str, int]:
    """(noise name, cyclic groups): the cheap checks, before anything is optimized or calibrated."""
    if isinstance(noise, BandedToeplitz):
        name = "bandmf"
    elif isinstance(noise, BufferedToeplitz):
        name = "blt"
    else:
        name = checks.choice("noise", noise, NOISES)
    if name == "gaussian":
        for arg, value in (("bands", bands), ("buffers", buffers), ("cyclic_groups", cyclic_groups)):
            if value is not None:
                raise ValueError(f"{arg} applies to correlated noise (noise='bandmf' or 'blt'), not to noise='gaussian'")
        return name, 1
    if name == "bandmf":
        if buffers is not None:
            raise ValueError("buffers applies to noise='blt'; a banded strategy keeps bands - 1 buffers")
        if isinstance(noise, BandedToeplitz):
            if bands is not None and bands != noise.bands:
                raise ValueError(f"bands={bands} but the given strategy has {noise.bands} bands")
            bands = noise.bands
        if bands is None:
            raise ValueError("noise='bandmf' needs bands=b, the number of bands of the strategy (the loader then "
                             "samples with cyclic_groups=b: poisson_loader(..., cyclic_groups=b))")
        bands = checks.positive_int("bands", bands, "the number of bands of the strategy")
        groups = bands if cyclic_groups is None else checks.positive_int("cyclic_groups", cyclic_groups)
        if groups < bands:
            raise ValueError(f"cyclic_groups={groups} is below bands={bands}: amplification needs every unit's steps "
                             "at least `bands` apart; use cyclic_groups >= bands")
        return name, groups
    if bands is not None:
        raise ValueError("bands applies to noise='bandmf'; a BLT strategy has buffers")
    if buffers is not None:
        checks.positive_int("buffers", buffers, "the number of noise buffers of the BLT")
    if isinstance(noise, BufferedToeplitz) and buffers is not None and buffers != noise.buffers:
        raise ValueError(f"buffers={buffers} but the given strategy has {noise.buffers} buffers")
    groups = 1 if cyclic_groups is None else checks.positive_int("cyclic_groups", cyclic_groups)
    return name, groups


def build_mechanism(noise: Any, name: str, groups: int, planned_steps: int, bands: int | None,
                    buffers: int | None, workload_momentum: float) -> CorrelatedMechanism:
    """The mechanism of a run of ``planned_steps``: the given strategy, or the optimized one (cached on disk)."""
    if isinstance(noise, (BandedToeplitz, BufferedToeplitz)):
        strategy = noise
    elif name == "bandmf":
        strategy = banded_strategy(planned_steps, bands, momentum=workload_momentum)
    else:
        strategy = blt_strategy(planned_steps, DEFAULT_BLT_BUFFERS if buffers is None else buffers,
                                min_sep=groups, max_participations=-(-planned_steps // groups),
                                momentum=workload_momentum)
    check_noising_stable(strategy, planned_steps)
    return CorrelatedMechanism(name, strategy, groups, planned_steps)
