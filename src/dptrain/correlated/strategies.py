"""Strategy matrices ``C`` for correlated noise: banded Toeplitz and buffered linear Toeplitz (BLT), optimized.

The mechanism releases ``C x + z`` for the stream ``x`` of clipped gradient sums; the training loop uses
``C^{-1}(C x + z) = x + C^{-1} z``: the noise of step ``t`` is row ``t`` of ``C^{-1} Z``. A good ``C`` makes
the noise cancel in the model's trajectory ``A (x + C^{-1} z)``: the error ``||A C^{-1}||_F^2`` is small while
the sensitivity of ``C`` (what one unit can change of ``C x``) stays that of DP-SGD.

* :class:`BandedToeplitz` (Choquette-Choo et al. 2023; McKenna 2024): ``C = T(c)`` with ``b`` non-zero
  coefficients (``b`` bands), ``||c|| = 1``. With cyclic Poisson sampling over ``b`` groups its privacy is
  that of DP-SGD with ``n / b`` steps (``privacy``). Its noise needs ``b - 1`` past noise vectors.
* :class:`BufferedToeplitz` (Dvijotham et al. 2024; McMahan et al. 2024): ``c_0 = 1``,
  ``c_k = sum_i w_i theta_i^(k-1)`` for ``k >= 1``; ``C^{-1} z`` is generated with one buffer per
  ``theta_i``, however long the run. Its privacy comes from its multi-participation sensitivity.

Both are optimized for a run of ``n`` steps and a workload (prefix sums for SGD, or SGD with momentum)
by L-BFGS over ``float64`` losses computed in ``O(n log n)`` (``toeplitz``), and cached on disk by their
parameters (``DPTRAIN_CACHE_DIR``, default ``~/.cache/dptrain/strategies``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar, cast

import numpy as np
import torch

from .. import _checks
from . import toeplitz

__all__ = [
    "ERRORS",
    "BandedToeplitz",
    "BufferedToeplitz",
    "banded_strategy",
    "blt_strategy",
    "cache_dir",
    "fhu_coefficients",
    "optimize_banded",
    "optimize_blt",
    "strategy_loss",
]

ERRORS = ("mean", "max")  # how the per-step errors are reduced: their mean (RMSE) or the last (worst) one
# Bumped whenever an optimizer changes what it returns for the same parameters: old cache entries are ignored.
CACHE_VERSION = 1
# A noising matrix whose coefficients grow past this is numerically unstable as a recurrence: refused.
MAX_NOISING_COEFFICIENT = 1e3


def fhu_coefficients(n: int) -> np.ndarray:
    """Coefficients of ``A^{1/2}`` for the prefix-sum workload, ``binom(2k, k) / 4^k`` (Fichtenberger, Henzinger
    & Upadhyay 2023): ``T(c) T(c) = A``; the optimal Toeplitz strategy for the worst-step error with one
    participation (Dvijotham et al. 2024)."""
    k = np.arange(1, n)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


@dataclass(frozen=True)
class BandedToeplitz:
    """``C = T(c)``: lower-triangular Toeplitz with the ``bands`` coefficients ``c`` (``||c|| = 1``), zero below.

    Its inverse is applied as a recurrence over the last ``bands - 1`` noise vectors:
    ``w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0`` (Choquette-Choo et al. 2023, Algorithm 9).
    """

    coefficients: tuple[float, ...]

    kind = "banded"

    def __post_init__(self):
        c = np.asarray(self.coefficients, dtype=np.float64)
        if c.ndim != 1 or len(c) == 0 or not np.all(np.isfinite(c)) or c[0] <= 0:
            raise ValueError(f"banded coefficients must be finite with c[0] > 0, got {self.coefficients}")

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def buffers(self) -> int:
        """Model-sized noise buffers the streaming noise keeps: the last ``bands - 1`` noise vectors."""
        return self.bands - 1

    def column(self, n: int) -> np.ndarray:
        """The first column of ``C`` for a run of ``n`` steps."""
        c = np.zeros(n)
        c[: min(n, self.bands)] = self.coefficients[:n]
        return c

    def max_column_norm(self, n: int) -> float:
        """The largest column norm of ``C`` (the sensitivity of one participation): the first column's."""
        return float(np.linalg.norm(self.column(n)))

    def as_dict(self) -> dict:
        return {"kind": self.kind, "coefficients": list(self.coefficients)}


@dataclass(frozen=True)
class BufferedToeplitz:
    """A BLT strategy: ``c_0 = 1`` and ``c_k = sum_i scale_i decay_i^(k-1)`` for ``k >= 1``.

    Its inverse is applied with one buffer per ``decay_i`` (McMahan et al. 2024, Algorithm 3):
    ``w_t = z_t - sum_i scale_i buf_i``, then ``buf_i <- decay_i buf_i + w_t``. Built by :func:`optimize_blt`
    with ``0 < decay_i < 1``, ``scale_i > 0`` and ``sum_i scale_i < 1``, so that ``c`` is positive and
    non-increasing (its sensitivity is then exact, ``toeplitz.minsep_sensitivity_squared``).
    """

    decay: tuple[float, ...]
    scale: tuple[float, ...]

    kind = "blt"

    def __post_init__(self):
        decay, scale = np.asarray(self.decay, dtype=np.float64), np.asarray(self.scale, dtype=np.float64)
        if decay.shape != scale.shape or decay.ndim != 1:
            raise ValueError(f"a BLT needs as many scales as decays, got {self.decay} and {self.scale}")
        if not (np.all(np.isfinite(decay)) and np.all(np.isfinite(scale))) or np.any(np.abs(decay) >= 1):
            raise ValueError(f"BLT decays must be finite and in (-1, 1), got {self.decay}")

    @property
    def buffers(self) -> int:
        return len(self.decay)

    def column(self, n: int) -> np.ndarray:
        k = np.arange(max(n - 1, 0))
        tail = (np.asarray(self.scale)[None, :] * np.asarray(self.decay)[None, :] ** k[:, None]).sum(1)
        return np.concatenate([[1.0], tail])[:n]

    def max_column_norm(self, n: int) -> float:
        return float(np.linalg.norm(self.column(n)))

    def as_dict(self) -> dict:
        return {"kind": self.kind, "decay": list(self.decay), "scale": list(self.scale)}


Strategy = BandedToeplitz | BufferedToeplitz
S = TypeVar("S", BandedToeplitz, BufferedToeplitz)


def strategy_from_dict(state: dict) -> Strategy:
    if state.get("kind") == "banded":
        return BandedToeplitz(tuple(float(v) for v in state["coefficients"]))
    if state.get("kind") == "blt":
        return BufferedToeplitz(tuple(float(v) for v in state["decay"]), tuple(float(v) for v in state["scale"]))
    raise ValueError(f"not a saved strategy: {state!r}")


def check_noising_stable(strategy: Strategy, n: int) -> None:
    """Refuse a strategy whose noise recurrence would blow up over ``n`` steps (roots of ``c(x)`` inside the
    unit disc): its noise would be dominated by rounding errors, not the mechanism's."""
    h = toeplitz.series_inverse(torch.as_tensor(strategy.column(n)), n)
    if not bool(torch.isfinite(h).all()) or float(h.abs().max()) > MAX_NOISING_COEFFICIENT:
        raise ValueError(
            f"the strategy {strategy} has an unstable inverse over {n} steps (noise coefficients up to "
            f"{float(h.abs().max()):.3g}): its noise cannot be generated as a recurrence. Use an optimized "
            "strategy (banded_strategy / blt_strategy), whose coefficients are positive and decreasing")


# ----------------------------------------------------------------------------------------------- losses


def _reduce(errors: torch.Tensor, error: str) -> torch.Tensor:
    return errors.mean() if error == "mean" else errors[-1]  # per-step errors never decrease


def strategy_loss(strategy: Strategy | np.ndarray, n: int, *, min_sep: int | None = None,
                  max_participations: int | None = None, momentum: float = 0.0, error: str = "mean") -> float:
    """``error(A C^{-1}) * sensitivity(C)^2``: the squared error of the trajectory per unit noise multiplier.

    ``min_sep=None``: one participation's sensitivity (the largest column norm), which is what amplified
    banded strategies pay per round. Otherwise the ``min_sep``-separated, ``max_participations`` sensitivity.
    """
    column = strategy.column(n) if not isinstance(strategy, np.ndarray) else strategy
    c = torch.as_tensor(column, dtype=toeplitz.DTYPE)
    errors = toeplitz.per_query_error(strategy=c, n=n, workload=_workload(n, momentum))
    if min_sep is None:
        sens = torch.dot(c, c)
    else:
        sens = toeplitz.minsep_sensitivity_squared(c, n, min_sep, max_participations)
    return float(_reduce(errors, error) * sens)


def _workload(n: int, momentum: float):
    return None if momentum == 0.0 else toeplitz.workload_coefficients(n, momentum)


def _minimize(loss, x0: np.ndarray, max_iterations: int) -> np.ndarray:
    """L-BFGS on ``log(loss)`` (scale-free, well conditioned), gradients by torch autograd in float64."""
    from scipy.optimize import minimize  # scipy comes with dp-accounting

    def value_and_grad(x: np.ndarray):
        params = torch.tensor(x, dtype=toeplitz.DTYPE, requires_grad=True)
        value = torch.log(loss(params))
        if not torch.isfinite(value):
            return math.inf, np.zeros_like(x)
        value.backward()
        assert params.grad is not None  # (the loss depends on every parameter)
        return float(value.detach()), params.grad.numpy().copy()

    result = minimize(value_and_grad, x0, jac=True, method="L-BFGS-B",
                      options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10})
    return result.x


def _check_common(n: int, momentum: float, error: str) -> tuple[int, float, str]:
    n = _checks.positive_int("steps", n, "the number of steps the strategy is optimized for")
    momentum = float(momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return n, momentum, _checks.choice("error", error, ERRORS)


def optimize_banded(n: int, bands: int, *, momentum: float = 0.0, error: str = "mean",
                    max_iterations: int = 500, initial=None) -> BandedToeplitz:
    """The banded Toeplitz strategy with ``bands`` coefficients that minimizes :func:`strategy_loss` (one
    participation's sensitivity: what amplified BandMF pays) for ``n`` steps. Starts from ``initial``, by default
    the first ``bands`` coefficients of ``A^{1/2}`` (as jax_privacy's ``optimize_banded_toeplitz``); returns
    ``||c|| = 1``."""
    n, momentum, error = _check_common(n, momentum, error)
    bands = _checks.positive_int("bands", bands)
    if bands > n:
        raise ValueError(f"bands={bands} exceeds the {n} steps of the run")
    if bands == 1:
        return BandedToeplitz((1.0,))
    workload = _workload(n, momentum)

    def loss(c: torch.Tensor) -> torch.Tensor:
        errors = toeplitz.per_query_error(strategy=c, n=n, workload=workload)
        return _reduce(errors, error) * torch.dot(c, c)

    start = fhu_coefficients(bands) if initial is None else np.asarray(initial, dtype=np.float64)
    if start.shape != (bands,):
        raise ValueError(f"initial must hold {bands} coefficients, got {len(start)}")
    c = _minimize(loss, start, max_iterations)
    c = c / np.linalg.norm(c) * np.sign(c[0])
    return BandedToeplitz(tuple(float(v) for v in c))


def _blt_params(x: torch.Tensor, buffers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unconstrained ``x`` -> (decay in (0, 1), scale > 0 with sum(scale) < 1): ``c`` positive, non-increasing."""
    decay = torch.sigmoid(x[:buffers])
    scale = torch.sigmoid(x[buffers]) * torch.softmax(x[buffers + 1:], 0)
    return decay, scale


def _blt_column(decay: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    k = torch.arange(max(n - 1, 0), dtype=toeplitz.DTYPE)
    powers = torch.exp(k[:, None] * torch.log(decay)[None, :])
    return torch.cat([decay.new_ones(1), (powers * scale[None, :]).sum(1)])[:n]


def _matrix_powers(m: torch.Tensor, count: int) -> torch.Tensor:
    """``[m^0, m^1, ..., m^(count-1)]`` by doubling: ``log2(count)`` batched products, differentiable."""
    powers = torch.eye(len(m), dtype=m.dtype)[None]
    step = m
    while len(powers) < count:
        powers = torch.cat([powers, powers @ step])
        step = step @ step
    return powers[:count]


def _blt_inverse_column(decay: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """First column of ``C^{-1}`` for a BLT ``C``: with ``c(x) = 1 + x 1^T (I - Theta x)^{-1} w``, the inverse
    series is ``1 - x 1^T (I - (Theta - w 1^T) x)^{-1} w`` (Sherman-Morrison for rational series; Dvijotham
    et al. 2024, Lemma 5.2), so ``h_0 = 1`` and ``h_k = -1^T (Theta - w 1^T)^(k-1) w``: ``O(n d^2)``."""
    inner = torch.diag(decay) - scale[:, None] * torch.ones_like(decay)[None, :]
    tail = -(_matrix_powers(inner, max(n - 1, 0)) @ scale).sum(1)
    return torch.cat([decay.new_ones(1), tail])[:n]


def optimize_blt(n: int, buffers: int, *, min_sep: int = 1, max_participations: int | None = 1,
                 momentum: float = 0.0, error: str = "mean", max_iterations: int = 500) -> BufferedToeplitz:
    """The BLT with ``buffers`` buffers that minimizes :func:`strategy_loss` for ``n`` steps under
    ``(max_participations, min_sep)`` participation (None: as many as ``min_sep`` allows). A few starts,
    spread over time scales from ``n^(1/(d+1))`` to ``n`` steps; the best is kept."""
    n, momentum, error = _check_common(n, momentum, error)
    buffers = _checks.positive_int("buffers", buffers)
    min_sep = _checks.positive_int("min_sep", min_sep)
    workload = _workload(n, momentum)

    def loss(x: torch.Tensor) -> torch.Tensor:
        decay, scale = _blt_params(x, buffers)
        c = _blt_column(decay, scale, n)
        errors = toeplitz.per_query_error(noising=_blt_inverse_column(decay, scale, n), n=n, workload=workload)
        return _reduce(errors, error) * toeplitz.minsep_sensitivity_squared(c, n, min_sep, max_participations)

    best, best_loss = None, math.inf
    for total_scale in (0.9, 0.5, 0.1):
        time_scales = np.maximum(n ** ((np.arange(buffers) + 1) / (buffers + 1)), 1.5)
        decay0 = 1.0 - 1.0 / time_scales
        x0 = np.concatenate([np.log(decay0 / (1 - decay0)), [math.log(total_scale / (1 - total_scale))],
                             np.zeros(buffers)])
        x = _minimize(loss, x0, max_iterations)
        value = float(loss(torch.as_tensor(x, dtype=toeplitz.DTYPE)))
        if value < best_loss:
            best, best_loss = x, value
    decay, scale = _blt_params(torch.as_tensor(best, dtype=toeplitz.DTYPE), buffers)
    order = torch.argsort(decay, descending=True)
    return BufferedToeplitz(tuple(decay[order].tolist()), tuple(scale[order].tolist()))


# ------------------------------------------------------------------------------------------------ cache


def cache_dir() -> Path:
    """Where optimized strategies are kept: ``$DPTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/dptrain/strategies``
    (``~/.cache/dptrain/strategies``)."""
    given = os.environ.get("DPTRAIN_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dptrain" / "strategies"


def _cached(key: dict, compute: Callable[[], S]) -> S:
    """``compute()``, read from the cache when an entry with exactly this ``key`` is there; written otherwise.
    A cache that cannot be read or written only costs the optimization (a warning says why)."""
    key = {**key, "version": CACHE_VERSION}
    text = json.dumps(key, sort_keys=True)
    path = cache_dir() / f"{key['kind']}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return cast(S, strategy_from_dict(saved["strategy"]))  # (the key's kind: compute's)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring the unreadable cached strategy {path}: {err}", stacklevel=3)
    strategy = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"key": key, "strategy": strategy.as_dict()}, indent=1))
        os.replace(partial, path)  # never a half-written entry, even with several processes
    except OSError as err:
        warnings.warn(f"could not cache the optimized strategy in {path.parent}: {err} (set DPTRAIN_CACHE_DIR to a "
                      "writable folder to keep it)", stacklevel=3)
    return strategy


def banded_strategy(n: int, bands: int, *, momentum: float = 0.0, error: str = "mean",
                    cache: bool = True) -> BandedToeplitz:
    """:func:`optimize_banded`, cached on disk by ``(n, bands, momentum, error)``."""
    def compute():
        return optimize_banded(n, bands, momentum=momentum, error=error)
    if not cache:
        return compute()
    return _cached({"kind": "banded", "n": int(n), "bands": int(bands), "momentum": float(momentum),
                    "error": error}, compute)


def blt_strategy(n: int, buffers: int, *, min_sep: int = 1, max_participations: int | None = 1,
                 momentum: float = 0.0, error: str = "mean", cache: bool = True) -> BufferedToeplitz:
    """:func:`optimize_blt`, cached on disk by all of its parameters."""
    def compute():
        return optimize_blt(n, buffers, min_sep=min_sep, max_participations=max_participations,
                            momentum=momentum, error=error)
    if not cache:
        return compute()
    return _cached({"kind": "blt", "n": int(n), "buffers": int(buffers), "min_sep": int(min_sep),
                    "max_participations": max_participations, "momentum": float(momentum), "error": error},
                   compute)
