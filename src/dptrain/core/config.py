"""The engine's configuration: every argument of ``PrivacyEngine`` checked once, and the noise calibrated."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from .. import _checks, accounting
from ..correlated import resolve as correlated_resolve
from ..correlated.comparison import warn_if_worse_than_dp_sgd
from ..losses import LOSS_REDUCTIONS
from .algorithms import RECIPES
from .clipping import CLIPPING_FNS
from .planning import DECISION_RULES

BUDGETS = ("warn", "strict")
PRIVACY_UNITS = ("example", "user")  # what one clipped, sampled unit is


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration, validated once; the defaults are those of ``PrivacyEngine``'s signature."""

    batch_size: int
    sample_size: int
    max_grad_norm: float
    noise_multiplier: float
    target_epsilon: float | None
    target_delta: float
    planned_steps: int | None  # the length the noise was calibrated for (None: noise_multiplier was given)
    max_batch_size: int | None  # K of fixed-shape batches (None: Poisson batches are never truncated)
    clipping_mode: str
    clipping_fn: str
    clipping_style: Any
    clipping_gamma: float
    loss_reduction: str
    decision_rule: str
    accountant: str
    secure_rng: bool
    seed: int | None
    allow_fallback: bool
    batch_first: bool
    budget: str
    privacy_unit: str = "example"
    noise: str = "gaussian"  # "gaussian" (DP-SGD), or correlated: "bandmf", "blt" (dptrain.correlated)
    cyclic_groups: int = 1  # g of cyclic Poisson sampling (dptrain.data.cyclic); 1: plain Poisson sampling
    mechanism: Any = None  # the CorrelatedMechanism of correlated noise (None for "gaussian")

    @property
    def sample_rate(self) -> float:
        """q, the Poisson rate the accountant uses: within a unit's cyclic group (``batch_size * g / N``)."""
        return self.batch_size * self.cyclic_groups / self.sample_size

    @property
    def inclusion_rate(self) -> float:
        """The chance that a unit is in a given step's batch, ``batch_size / N`` (``sample_rate / g``)."""
        return self.batch_size / self.sample_size

    @property
    def recipe(self):
        return RECIPES[self.clipping_mode]


class FromConfig:
    """``engine.<name>``: a read-only view of ``engine.config.<name>`` (configuration is not changed in place)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.config, self.name)

    def __set__(self, engine, value):
        raise AttributeError(f"{self.name} is configuration: build a new PrivacyEngine to change it")


def _noise_multiplier(sigma, target_epsilon, target_delta, epochs, steps, sample_rate, accountant,
                      delta_given: bool, sample_size: int, max_batch_size: int | None) -> tuple[float, int | None]:
    """(noise multiplier, planned steps): the one given, or the one calibrated for the planned run."""
    if (sigma is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier or target_epsilon (with epochs or steps)")
    if sigma is not None:
        if epochs is not None or steps is not None or delta_given:
            warnings.warn("epochs/steps/target_delta only matter with target_epsilon; they are ignored for calibration",
                          stacklevel=4)
        return _checks.non_negative("noise_multiplier", sigma), None
    if (epochs is None) == (steps is None):
        raise ValueError("target_epsilon needs the planned length of training: give exactly one of epochs or steps")
    # An epoch is round(1/q) Poisson steps, as dptrain.data.poisson_loader runs it.
    planned = steps if steps is not None else int(math.ceil(epochs * max(1, round(1 / sample_rate))))
    return accounting.calibrate_noise_multiplier(target_epsilon, target_delta, sample_rate, planned,
                                                 accountant=accountant, sample_size=sample_size,
                                                 max_batch_size=max_batch_size), planned


def _correlated(noise, name, groups, sigma, target_epsilon, epochs, steps, checked, bands, buffers, workload_momentum):
    """(mechanism, noise multiplier, planned steps, cyclic groups) of correlated noise: its strategy is built for the
    planned length, which is needed even with a given noise multiplier; ``groups == 0``: ``bands="auto"``."""
    if (sigma is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier or target_epsilon (with epochs or steps)")
    if (epochs is None) == (steps is None):
        raise ValueError(f"noise={name!r} needs the planned length of training, for which its strategy is optimized "
                         "(and, with target_epsilon, the noise calibrated): give exactly one of epochs or steps")
    n, b = checked["sample_size"], checked["batch_size"]
    # An epoch is round(N / batch_size) steps, as dptrain.data.poisson_loader runs it (cyclic or not).
    planned = _checks.positive_int("steps", steps) if steps is not None else int(
        math.ceil(_checks.positive("epochs", epochs) * max(1, round(n / b))))
    bands_chosen = groups == 0
    if bands_chosen:  # bands="auto"
        if target_epsilon is None:
            raise ValueError("bands='auto' chooses the bands for a target: give target_epsilon, not noise_multiplier")
        bands = groups = correlated_resolve.choose_bands(planned, b, n, _checks.positive("target_epsilon",
                                                                                          target_epsilon),
                                                         checked["target_delta"], workload_momentum)
    mechanism = correlated_resolve.build_mechanism(noise, name, groups, planned, bands, buffers, workload_momentum)
    if sigma is not None:
        sigma = _checks.non_negative("noise_multiplier", sigma)
        if checked["max_batch_size"] is not None and accounting.truncation_delta(
                n, b / n, checked["max_batch_size"], planned) >= checked["target_delta"]:
            return mechanism, sigma, planned, groups  # no epsilon holds at this delta: get_epsilon says why
    delta = accounting.poisson_delta(checked["target_delta"], n, b / n, checked["max_batch_size"], planned)
    if target_epsilon is not None:
        sigma = mechanism.calibrate(_checks.positive("target_epsilon", target_epsilon), delta, b * groups / n, planned,
                                    checked["accountant"])
    # make_config -> _correlated -> here: stacklevel 5 names the PrivacyEngine(...) line of the user's code
    warn_if_worse_than_dp_sgd(mechanism, sigma, inclusion_rate=b / n, delta=delta, accountant=checked["accountant"],
                              workload_momentum=workload_momentum, bands_chosen=bands_chosen, stacklevel=5)
    return mechanism, sigma, planned, groups


def make_config(*, batch_size, sample_size, max_grad_norm, noise_multiplier, target_epsilon, target_delta, epochs,
                steps, clipping_mode, clipping_fn, clipping_style, loss_reduction, decision_rule, clipping_gamma,
                accountant, secure_rng, seed, allow_fallback, batch_first, budget, max_batch_size,
                privacy_unit="example", noise="gaussian", bands=None, buffers=None, cyclic_groups=None,
                workload_momentum=0.0) -> EngineConfig:
    """Check every argument (cheap ones first: a wrong choice is reported before any calibration), then
    calibrate the noise multiplier if a target epsilon was given."""
    batch_size = _checks.positive_int("batch_size", batch_size, "the expected logical batch size")
    sample_size = _checks.positive_int("sample_size", sample_size, "the dataset size")
    if batch_size > sample_size:
        raise ValueError(f"batch_size={batch_size} is larger than sample_size={sample_size}")
    noise_name, groups = correlated_resolve.noise_kind(noise, bands, buffers, cyclic_groups)  # 0: bands="auto"
    if batch_size * groups > sample_size:
        raise ValueError(
            f"batch_size={batch_size} with cyclic_groups={groups} needs batch_size * cyclic_groups <= sample_size="
            f"{sample_size}: each group of about sample_size / g units supplies a whole expected batch at its steps. "
            "Use fewer bands / groups or a smaller batch_size")
    workload_momentum = _checks.real("workload_momentum", workload_momentum, "the momentum the strategy is built for")
    if not 0.0 <= workload_momentum < 1.0:
        raise ValueError(f"workload_momentum must be in [0, 1), got {workload_momentum}")
    if noise_name == "gaussian" and workload_momentum != 0.0:
        raise ValueError("workload_momentum applies to correlated noise (noise='bandmf' or 'blt')")
    delta_given = target_delta is not None
    checked = dict(
        batch_size=batch_size,
        sample_size=sample_size,
        max_grad_norm=_checks.positive("max_grad_norm", max_grad_norm, "the clipping threshold R"),
        target_epsilon=target_epsilon,
        target_delta=_checks.open_unit("target_delta", target_delta if delta_given
                                      else accounting.default_delta(sample_size)),
        clipping_mode=_checks.choice("clipping_mode", clipping_mode, tuple(RECIPES)),
        clipping_fn=_checks.choice("clipping_fn", clipping_fn, CLIPPING_FNS),
        clipping_style=clipping_style,
        clipping_gamma=_checks.positive("clipping_gamma", clipping_gamma),
        loss_reduction=_checks.choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS),
        decision_rule=_checks.choice("decision_rule", decision_rule, DECISION_RULES),
        accountant=_checks.choice("accountant", accountant, accounting.ACCOUNTANTS),
        secure_rng=bool(secure_rng),
        seed=seed,
        allow_fallback=bool(allow_fallback),
        batch_first=bool(batch_first),
        budget=_checks.choice("budget", budget, BUDGETS),
        privacy_unit=_checks.choice("privacy_unit", privacy_unit, PRIVACY_UNITS),
        max_batch_size=None if max_batch_size is None else _checks.positive_int(
            "max_batch_size", max_batch_size, "the fixed number of rows of every batch, K"),
    )
    problem = accounting.small_delta_problem(checked["target_delta"], sample_size, checked["privacy_unit"])
    if problem is not None:
        if checked["budget"] == "strict":
            raise ValueError(f"target_{problem} (budget='strict' refuses such a delta)")
        warnings.warn(f"target_{problem}", stacklevel=4)
    if noise_name != "gaussian":
        mechanism, sigma, planned, groups = _correlated(noise, noise_name, groups, noise_multiplier, target_epsilon,
                                                        epochs, steps, checked, bands, buffers, workload_momentum)
        return EngineConfig(noise_multiplier=sigma, planned_steps=planned, noise=noise_name, cyclic_groups=groups,
                            mechanism=mechanism, **checked)
    sigma, planned = _noise_multiplier(noise_multiplier, target_epsilon, checked["target_delta"], epochs, steps,
                                       batch_size / sample_size, accountant, delta_given, sample_size,
                                       checked["max_batch_size"])
    return EngineConfig(noise_multiplier=sigma, planned_steps=planned, **checked)
