"""``PrivacyEngine(noise=..., bands=..., buffers=..., cyclic_groups=..., workload_momentum=...)``: checked, and
turned into a :class:`~dptrain.correlated.privacy.CorrelatedMechanism` (its strategy optimized, or read from
the cache) for the planned run."""
from __future__ import annotations

from typing import Any

from .. import _checks
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
        name = _checks.choice("noise", noise, NOISES)
    if name == "gaussian":
        for arg, value in (("bands", bands), ("buffers", buffers), ("cyclic_groups", cyclic_groups)):
            if value is not None:
                raise ValueError(f"{arg} applies to correlated noise (noise='bandmf' or 'blt'), not to "
                                 "noise='gaussian'")
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
                             "samples with cyclic_groups=b: poisson_loader(..., cyclic_groups=b)), or bands='auto'")
        if bands == "auto":
            if cyclic_groups is not None:
                raise ValueError("bands='auto' chooses the cyclic groups too (as many as bands): leave cyclic_groups "
                                 "out")
            return name, 0  # chosen with the noise (choose_bands)
        bands = _checks.positive_int("bands", bands, "the number of bands of the strategy, or 'auto'")
        groups = bands if cyclic_groups is None else _checks.positive_int("cyclic_groups", cyclic_groups)
        if groups < bands:
            raise ValueError(f"cyclic_groups={groups} is below bands={bands}: amplification needs every unit's steps "
                             "at least `bands` apart; use cyclic_groups >= bands")
        return name, groups
    if bands is not None:
        raise ValueError("bands applies to noise='bandmf'; a BLT strategy has buffers")
    if buffers is not None:
        _checks.positive_int("buffers", buffers, "the number of noise buffers of the BLT")
    if isinstance(noise, BufferedToeplitz) and buffers is not None and buffers != noise.buffers:
        raise ValueError(f"buffers={buffers} but the given strategy has {noise.buffers} buffers")
    groups = 1 if cyclic_groups is None else _checks.positive_int("cyclic_groups", cyclic_groups)
    return name, groups


def build_mechanism(noise: Any, name: str, groups: int, planned_steps: int, bands: int | None,
                    buffers: int | None, workload_momentum: float) -> CorrelatedMechanism:
    """The mechanism of a run of ``planned_steps``: the given strategy, or the optimized one (cached on disk)."""
    if isinstance(noise, (BandedToeplitz, BufferedToeplitz)):
        strategy = noise
    elif name == "bandmf":
        assert bands is not None  # (resolve_noise requires them for "bandmf"; "auto" is chosen before)
        strategy = banded_strategy(planned_steps, bands, momentum=workload_momentum)
    else:
        strategy = blt_strategy(planned_steps, DEFAULT_BLT_BUFFERS if buffers is None else buffers,
                                min_sep=groups, max_participations=-(-planned_steps // groups),
                                momentum=workload_momentum)
    check_noising_stable(strategy, planned_steps)
    return CorrelatedMechanism(name, strategy, groups, planned_steps)


# Bands that bands="auto" tries (those that fit the run and the data): the error falls roughly like log(b) / b
# while the amplification weakens, so the best b is rarely far from a few; these keep the search to ~12 tries.
AUTO_BAND_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def choose_bands(planned_steps: int, batch_size: int, sample_size: int, target_epsilon: float, delta: float,
                 workload_momentum: float = 0.0) -> int:
    """The number of bands that minimizes the expected squared error of the trajectory at ``target_epsilon``:
    ``sigma_b^2 * loss(C_b)``, ``sigma_b`` calibrated for amplified BandMF with ``b`` cyclic groups (RDP, cheap;
    the engine then calibrates with its own accountant) and ``C_b`` the optimized ``b``-banded strategy (Choquette-
    Choo et al. 2023's amplified BandMF; jax_privacy's ``optimize_coefs_for_amplifications``). ``b = 1`` is DP-SGD, so the
    choice is never worse than DP-SGD by this measure."""
    import logging

    from .. import accounting
    from .strategies import strategy_loss

    best, best_score = 1, float("inf")
    absl = logging.getLogger("absl")  # dp_accounting's RDP logs every order it skips: not the user's business here
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        for b in AUTO_BAND_CANDIDATES:
            if b > planned_steps or b * batch_size > sample_size:
                break
            strategy = banded_strategy(planned_steps, b, momentum=workload_momentum)
            sigma = accounting.calibrate_noise_multiplier(target_epsilon, delta, batch_size * b / sample_size,
                                                          -(-planned_steps // b), accountant="rdp")
            score = sigma**2 * strategy_loss(strategy, planned_steps, momentum=workload_momentum)
            if score < best_score:
                best, best_score = b, score
    finally:
        absl.setLevel(level)
    return best
