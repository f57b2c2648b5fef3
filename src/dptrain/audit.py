"""A one-run privacy audit of the engine: white-box gradient canaries and a lower bound on epsilon.

The accountant's epsilon is a theorem about an ideal mechanism; the audit checks that the
implementation is that mechanism. It trains once with the real engine, in its real
clipping mode, with its real noise and Poisson batches, and plants ``m`` *gradient
canaries* in the training set, each independently with probability 1/2. From the noisy
gradients the run releases, it guesses which canaries were in, and turns the number of
right guesses into a lower bound on epsilon with the theorem of Steinke, Nasr & Jagielski,
"Privacy Auditing with One (1) Training Run" (NeurIPS 2023). An honest implementation
always gives ``epsilon_lower_bound <= epsilon`` (at the stated confidence); a bound above
the accountant's epsilon proves that the run leaks more than it promises.

How the canaries go through the engine's path (see docs/audit.md):

* The audited model is wrapped in :class:`CanaryModel`, which adds a *probe*, a
  one-dimensional ``nn.Embedding(m + 1, 1)``. A batch element is ``(input, label,
  canary_id)`` with ``canary_id = -1`` for real samples, which read the probe's constant
  padding row. Canary ``i`` reads row ``i`` and its loss is ``64 R`` times that row (its
  classification loss is masked out), so its per-sample gradient is ``64 R`` on
  ``probe.weight[i, 0]`` and zero elsewhere, and real samples give the probe a zero
  gradient: canary directions are orthogonal to every real gradient and to each other.
* Canaries are ordinary samples to the engine: clipped (to exactly ``R``), summed,
  noised and sampled like the real ones.
* The sampling rate is fixed before the coins are flipped, ``q = batch_size / (n + m)``,
  so that it is the same for every pair of neighbouring datasets the theorem compares.

The auditor observes the noisy gradient of the probe after every step, and scores each
canary by the log-likelihood ratio of "included" against "excluded" under the
Poisson-subsampled Gaussian, summed over the steps. It does not use which steps sampled
a canary: the accountant's epsilon includes the amplification by subsampling.

With ``privacy_unit="user"`` the canaries are *users*: canary user ``i`` has ``k`` examples
(``examples_per_canary``), all reading probe row ``i``, included or excluded together with
probability 1/2. Its summed gradient, ``k * 64 R`` on that coordinate, is clipped as one unit
by ``engine.backward(losses, users=...)`` and adds exactly ``R``; the real examples belong to
real users (``users``, default: consecutive groups of ``k``), the loader samples users, and
the bound is compared with the user-level epsilon (q = the user sampling rate).
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .algorithms import DEFAULT_CLIPPING_MODE

__all__ = [
    "AUDIT_DEFAULTS",
    "AuditResult",
    "CanaryModel",
    "GuessingBound",
    "canary_losses",
    "epsilon_lower_bound",
    "format_report",
    "one_run_p_value",
    "run_audit",
    "subsampled_gaussian_scores",
]

# Defaults of `dptrain audit` and run_audit: the digits CNN at epsilon = 2. Simulated at
# epsilon = 2 (benchmarks/audit_sweep.py, 20 seeds): 10 steps at q = 0.5 give a mean bound
# of 0.88, many steps at small q 0.70-0.77 (q = 0.02-0.25); 10,000 canaries give 0.88
# where 1000 and 3000 give 0.55 and 0.65, and 30,000 only 0.90 (the theorem's delta term
# grows with m). A default audit takes about 5 s on two CPU cores.
AUDIT_DEFAULTS: dict[str, Any] = {
    "epsilon": 2.0,
    "delta": 1e-5,
    "canaries": 10_000,
    "steps": 10,
    "sample_rate": 0.5,
    "clipping_mode": DEFAULT_CLIPPING_MODE,
    "confidence": 0.95,
    "noise_scale": 1.0,
    "max_grad_norm": 1.0,
    "lr": 0.01,
    "accountant": "pld",
    "privacy_unit": "example",
    "examples_per_canary": 4,  # with privacy_unit="user": the examples of each canary user
    "noise": "gaussian",
    "bands": 2,  # with noise="bandmf": the bands of the strategy (and the cyclic groups)
}

# What a canary is, and what the audited epsilon protects (PrivacyEngine's privacy_unit).
_PRIVACY_UNITS = ("example", "user")
# A canary's gradient norm, in units of R: far above R, so that a canary that escaped
# clipping would stand out 64-fold, and a power of two, so that the clipping factor 1/64
# and the clipped contribution R are exact in float32.
CANARY_NORM_OVER_R = 64.0
# A clipping threshold, in units of R, that no gradient of an audit reaches (run_audit's clipping_off);
# a power of two, so that the noise multiplier of that run times the threshold is exactly sigma R.
_UNCLIPPED_NORM_OVER_R = 2.0**20
# Numbers of guesses the bound tries (then split between "in" and "out" guesses).
_GUESS_COUNTS = 8
_SMALLEST_GUESS_COUNT = 10


# ====================================================================== the statistics


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``correct`` right guesses out of ``guesses`` under (epsilon, delta)-DP.

    Theorem 3.1 of Steinke, Nasr & Jagielski (2023): if each of ``canaries`` canaries is
    included independently with probability 1/2 and the training run is (epsilon, delta)-DP,
    the number ``W`` of right guesses among ``guesses`` guesses satisfies, for every ``v``,

        P[W >= v] <= f(v) + 2 m delta * max_{1 <= i <= v} (f(v - i) - f(v)) / i,

    where ``f(v) = P[Binomial(guesses, e^eps / (1 + e^eps)) >= v]``; the second term is
    the price of delta (with delta = 0 the binomial alone dominates).
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    right = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0  # randomized response's accuracy
    tail = float(scipy.stats.binom.sf(correct - 1, guesses, right))  # f(v)
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    # f(v - i) - f(v) = P[v - i <= W < v], for i = 1..v: cumulative sums of the pmf from v-1 down.
    below = scipy.stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, right)
    slope = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, tail + 2 * canaries * delta * slope)


def _largest_rejected_epsilon(canaries: int, guesses: int, correct: int, delta: float, level: float) -> float:
    """The largest epsilon whose p-value is below ``level`` (0 if none is): bisection, rounded down."""
    if one_run_p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    rejected, kept = 0.0, 1.0
    # Terminates: past epsilon ~ 37, e^eps / (1 + e^eps) rounds to 1 and the p-value is 1.
    while one_run_p_value(canaries, guesses, correct, kept, delta) < level:
        rejected, kept = kept, 2 * kept
    while kept - rejected > 1e-4:
        middle = (rejected + kept) / 2
        if one_run_p_value(canaries, guesses, correct, middle, delta) < level:
            rejected = middle
        else:
            kept = middle
    return rejected


@dataclass
class GuessingBound:
    """The lower bound on epsilon and the guesses that gave it."""

    epsilon: float          # the lower bound (0 when no epsilon > 0 is rejected)
    guesses_in: int         # canaries guessed "included": the highest scores
    guesses_out: int        # canaries guessed "excluded": the lowest scores
    correct: int            # right guesses among them
    tried: int              # (guesses_in, guesses_out) pairs searched; each is tested at (1 - confidence) / tried


def _guess_splits(canaries: int) -> list[tuple[int, int]]:
    """(guesses "in", guesses "out") pairs to try: a few geometric totals, split evenly.

    Few candidates on purpose: each one is tested at (1 - confidence) / len(candidates),
    and at so small a level the delta term of the theorem (2 m delta times a binomial
    probability) soon dominates. Measured on simulated runs of the default audit, 8
    totals from m/100 to m beat 16 or 32 candidates (with all-"in" splits) by 0.05-0.25 in
    the bound; abstaining on all but the most extreme 1-100 % of the scores is where the
    best guesses are.
    """
    smallest = min(canaries, max(_SMALLEST_GUESS_COUNT, canaries // 100))
    totals = sorted({int(round(k)) for k in np.geomspace(smallest, canaries, _GUESS_COUNTS)})
    return [(k - k // 2, k // 2) for k in totals]


def epsilon_lower_bound(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    splits: Sequence[tuple[int, int]] | None = None,
) -> GuessingBound:
    """A lower bound on epsilon, valid with probability ``confidence``, from canary scores.

    Canaries are guessed "included" for the ``k+`` highest ``scores`` and "excluded" for
    the ``k-`` lowest; the rest abstain. Each pair ``(k+, k-)`` of ``splits`` (default:
    8 geometric totals from m/100 to m, half "in" and half "out") is tested at level
    ``(1 - confidence) / len(splits)`` (a union bound over the search), and the largest
    epsilon rejected by any of them is returned. ``included`` are the canaries' true
    coins, each drawn independently with probability 1/2 and independent of the order of
    the canaries (ties in scores are broken by that order).
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape:
        raise ValueError(f"scores and included must be 1-d and of the same length, got shapes "
                         f"{scores.shape} and {included.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores must be finite")
    confidence = checks.open_unit("confidence", confidence)
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    m = len(scores)
    splits = list(_guess_splits(m) if splits is None else splits)
    for k_in, k_out in splits:
        if k_in < 0 or k_out < 0 or k_in + k_out > m or k_in + k_out == 0:
            raise ValueError(f"a split (guesses in, guesses out) = ({k_in}, {k_out}) needs 0 < k_in + k_out <= {m}")
    best = GuessingBound(0.0, 0, 0, 0, len(splits))
    if m == 0:
        return best
    order = np.argsort(-scores, kind="stable")
    right_in = np.concatenate([[0], np.cumsum(included[order])])           # right among the top k
    right_out = np.concatenate([[0], np.cumsum(~included[order[::-1]])])   # right among the bottom k
    level = (1 - confidence) / len(splits)
    for k_in, k_out in splits:
        correct = int(right_in[k_in] + right_out[k_out])
        eps = _largest_rejected_epsilon(m, k_in + k_out, correct, delta, level)
        if eps > best.epsilon:
            best = GuessingBound(eps, k_in, k_out, correct, len(splits))
    return best


def subsampled_gaussian_scores(
    observations: np.ndarray, *, contribution: float, noise_std: float, sample_rate: float
) -> np.ndarray:
    """Per-canary log-likelihood ratio of "included" vs "excluded", summed over steps.

    ``observations[t, i]`` is the noisy gradient sum on canary ``i``'s coordinate after
    step ``t``: ``N(0, s^2)`` if the canary is out, and ``mu + N(0, s^2)`` with probability
    ``q`` (else ``N(0, s^2)``) if it is in, with ``mu = contribution``, ``s = noise_std``,
    ``q = sample_rate``. The score is ``sum_t log((1 - q) + q exp((2 x mu - mu^2) / (2 s^2)))``:
    the Neyman-Pearson statistic for one canary, which does not know when it was sampled.
    """
    x = np.asarray(observations, dtype=np.float64)
    if not (contribution > 0 and noise_std > 0 and 0 < sample_rate <= 1):
        raise ValueError(f"need contribution > 0, noise_std > 0 and sample_rate in (0, 1], got {contribution}, "
                         f"{noise_std}, {sample_rate}")
    shift = np.log(sample_rate) + (2 * x * contribution - contribution**2) / (2 * noise_std**2)
    if sample_rate == 1:
        return shift.sum(0)
    return np.logaddexp(math.log1p(-sample_rate), shift).sum(0)


def banded_scores(observations: np.ndarray, coefficients, groups: np.ndarray, *, contribution: float,
                  noise_std: float, sample_rate: float) -> np.ndarray:
    """Per-canary log-likelihood ratios for banded correlated noise with cyclic Poisson sampling.

    ``observations[t, i]`` is ``x[t, i] + noise_std (C^{-1} z)[t, i]`` for the b-banded Toeplitz ``C`` of
    ``coefficients`` (unit norm). The auditor applies ``C`` (post-processing): ``C y = C x + noise_std z``, white.
    Canary ``i`` can only be sampled at the steps ``s`` of its group, ``s mod b = groups[i]``, each time with
    probability ``q``, adding ``contribution * c`` to rows ``s .. s + b - 1`` of ``C x``: those blocks are disjoint
    for one canary, so its participations are independent observations. The projection of block ``s`` on ``c``
    (its rows before the end of the run) is ``N(0, s^2)`` or, if sampled, ``N(mu_s, s^2)`` with
    ``mu_s = contribution * ||c_kept||``: the subsampled Gaussian's ratio, summed over the canary's steps.
    """
    y = np.asarray(observations, dtype=np.float64)
    c = np.asarray(coefficients, dtype=np.float64)
    steps, bands = y.shape[0], len(c)
    column = np.zeros(steps)
    column[: min(bands, steps)] = c[:steps]
    whitened = np.zeros_like(y)
    for lag in range(min(bands, steps)):  # C y: lower-triangular Toeplitz, c_lag on the lag-th subdiagonal
        whitened[lag:] += column[lag] * y[: steps - lag]
    scores = np.zeros(y.shape[1])
    for start in range(steps):
        kept = c[: min(bands, steps - start)]
        norm = float(np.linalg.norm(kept))
        projection = kept @ whitened[start: start + len(kept)] / norm
        terms = subsampled_gaussian_scores(projection[None, :], contribution=contribution * norm,
                                           noise_std=noise_std, sample_rate=sample_rate)
        scores += np.where(groups == start % bands, terms, 0.0)
    return scores


# ====================================================================== canaries in the engine's path


class CanaryModel(nn.Module):
    """The audited model and a one-dimensional embedding, the *probe*, that only canaries train.

    ``forward(x, canary_id)`` returns ``(model(x), probe_output)``. ``canary_id`` is ``i`` for
    canary ``i``, whose probe output is ``probe.weight[i, 0]``, and -1 for a real sample,
    which reads the padding row ``canaries`` (constant zero, never trained). The probe
    output enters only the canaries' losses (:func:`canary_losses`), so canary ``i``'s
    per-sample gradient is a multiple of the unit vector on ``probe.weight[i, 0]``.
    (An embedding rather than a linear layer on one-hot vectors: a batch costs ``B``
    numbers, not ``B x canaries``.)
    """

    def __init__(self, model: nn.Module, canaries: int):
        super().__init__()
        canaries = checks.positive_int("canaries", canaries)
        self.model = model
        self.canaries = canaries
        self.probe = nn.Embedding(canaries + 1, 1, padding_idx=canaries)
        nn.init.zeros_(self.probe.weight)

    def forward(self, x: torch.Tensor, canary_id: torch.Tensor):
        probe_ids = torch.where(canary_id >= 0, canary_id, self.canaries)
        return self.model(x), self.probe(probe_ids)[:, 0]

    def probe_gradient(self) -> torch.Tensor:
        """The probe's gradient on the canaries' coordinates, ``[canaries]`` (zeros if none yet)."""
        grad = self.probe.weight.grad
        return grad[: self.canaries, 0] if grad is not None else self.probe.weight.new_zeros(self.canaries)


def canary_losses(logits, probe_output, labels, canary_id, canary_norm: float):
    """Per-sample losses: cross-entropy for real samples, ``canary_norm * probe_output`` for canaries.

    ``torch.where`` masks each branch's gradient, so a canary gives the real parameters a
    zero gradient, and its gradient on the probe is ``canary_norm`` on its own coordinate.
    """
    real = F.cross_entropy(logits, labels, reduction="none")
    return torch.where(canary_id >= 0, canary_norm * probe_output, real)


# ====================================================================== the audit run


@dataclass
class AuditResult:
    """What one audit found; ``to_dict()`` is the JSON of ``dptrain audit --json``."""

    epsilon: float                  # the accountant's epsilon for the run, at delta
    delta: float
    epsilon_lower_bound: float      # what the canaries prove, at the confidence
    confidence: float
    canaries: int
    steps: int
    clipping_mode: str
    noise_scale: float              # noise drawn / noise accounted (1 for an honest run)
    included_canaries: int
    guesses_in: int
    guesses_out: int
    correct_guesses: int
    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float
    accountant: str
    model: str                      # the model spec, or the class name of a model given as a module
    data: str                       # "digits" or "custom data"
    train_size: int                 # real training samples
    seed: int
    wall_time_s: float
    noise: str = "gaussian"         # "gaussian" (DP-SGD) or "bandmf" (banded correlated noise, cyclic sampling)
    bands: int | None = None        # with noise="bandmf": the bands (and cyclic groups)
    privacy_unit: str = "example"   # what a canary is, and what epsilon protects: "example" or "user"
    examples_per_canary: int = 1    # rows of each canary (> 1 only for canary users)
    clipped_unit: str = "example"   # what the engine clipped: the privacy unit, unless deliberately broken
    train_users: int | None = None  # real users (privacy_unit="user"), None for example-level audits

    @property
    def consistent(self) -> bool:
        """Whether the run kept its promise as far as this audit can tell."""
        return self.epsilon_lower_bound <= self.epsilon

    def to_dict(self) -> dict:
        out = asdict(self)
        out["consistent"] = self.consistent
        return out


def _digits():
    """All 1797 images of scikit-learn's digits, normalised as `dptrain train` does, and labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError("the digits data needs scikit-learn: pip install 'dptrain[cli]'") from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16  # [1797, 1, 8, 8] in [0, 1]
    return (images - 0.5) / 0.5, torch.tensor(digits.target, dtype=torch.long)


def _checked_data(data) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data)):
        raise ValueError("data must be a pair of tensors (inputs, labels)")
    inputs, labels = data
    if labels.dim() != 1 or labels.dtype != torch.long or len(labels) == 0 or len(inputs) != len(labels):
        raise ValueError(f"data needs inputs [N, ...] and class labels [N] of dtype long, N > 0; got shapes "
                         f"{tuple(inputs.shape)} and {tuple(labels.shape)} ({labels.dtype})")
    return inputs.cpu(), labels.cpu()


def _checked_users(users, n: int) -> torch.Tensor:
    """The real examples' user ids as dense ids 0..U-1 (int64 [n]), or a ValueError that says what is wrong."""
    if isinstance(users, (str, bytes)) or not hasattr(users, "__len__"):
        raise ValueError(f"users must be a sequence of integer user ids, one per training example, got "
                         f"{type(users).__name__}")
    try:
        ids = users.detach().cpu() if isinstance(users, torch.Tensor) else torch.as_tensor(np.asarray(users))
    except (TypeError, ValueError) as error:
        raise ValueError(f"users must be a sequence of integer user ids, one per training example ({error})") from None
    if ids.dim() != 1 or len(ids) != n:
        raise ValueError(f"users must hold one user id per training example: the data has {n} examples, users has "
                         f"shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"users must hold integer user ids, got {ids.dtype}")
    return torch.unique(ids, return_inverse=True)[1].long()


def _checked_unit(privacy_unit: str, examples_per_canary, users, clip_per_example: bool) -> int:
    """The examples of each canary (1 at the example level), after checking the user-level options."""
    if privacy_unit not in _PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {', '.join(map(repr, _PRIVACY_UNITS))}, got {privacy_unit!r}")
    if privacy_unit == "example":
        given = [name for name, value in (("examples_per_canary", examples_per_canary), ("users", users))
                 if value is not None] + (["clip_per_example"] if clip_per_example else [])
        if given:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for canary users, with "
                             "privacy_unit='user'; with privacy_unit='example' every canary is one example")
        return 1
    if examples_per_canary is None:
        return AUDIT_DEFAULTS["examples_per_canary"]
    return checks.positive_int("examples_per_canary", examples_per_canary)


def run_audit(
    *,
    epsilon: float = AUDIT_DEFAULTS["epsilon"],
    delta: float = AUDIT_DEFAULTS["delta"],
    canaries: int = AUDIT_DEFAULTS["canaries"],
    steps: int = AUDIT_DEFAULTS["steps"],
    sample_rate: float = AUDIT_DEFAULTS["sample_rate"],
    clipping_mode: str = AUDIT_DEFAULTS["clipping_mode"],
    confidence: float = AUDIT_DEFAULTS["confidence"],
    noise_scale: float = AUDIT_DEFAULTS["noise_scale"],
    clipping_off: bool = False,
    max_grad_norm: float = AUDIT_DEFAULTS["max_grad_norm"],
    lr: float = AUDIT_DEFAULTS["lr"],
    accountant: str = AUDIT_DEFAULTS["accountant"],
    model: str | nn.Module = "cnn",
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    seed: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    privacy_unit: str = AUDIT_DEFAULTS["privacy_unit"],
    examples_per_canary: int | None = None,
    users: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    clip_per_example: bool = False,
    noise: str = AUDIT_DEFAULTS["noise"],
    bands: int | None = None,
) -> AuditResult:
    """Train ``model`` with ``canaries`` gradient canaries, privately, and audit the run.

    The promise: clipping at ``max_grad_norm`` R and noise of sigma R per coordinate, with sigma
    calibrated (as the engine calibrates ``target_epsilon``) for ``epsilon`` at ``delta`` over
    ``steps`` Poisson steps of rate ``sample_rate`` (over real samples plus all potential
    canaries). The engine runs that mechanism and trains with DP-Adam in ``clipping_mode``.

    Two deliberately broken runs, to show that the audit catches a broken promise (the promise,
    and so the epsilon reported, stay those above): ``noise_scale`` != 1 makes the engine draw
    that multiple of the noise, and ``clipping_off`` makes it clip at a threshold that no
    gradient of the run reaches (``2**20`` R), with the noise still sigma R. ``seed`` fixes the coins, batches, noise and initialisation (default: fresh OS
    entropy, reported in the result). ``progress(step, steps)`` is called after each step.

    ``model`` is a built-in spec (``"cnn"``, ``"mlp"``: built with random weights for the
    data's image shape) or your own classifier module, of which a deep copy is trained
    (yours is left alone). ``data`` is ``(inputs, labels)`` for cross-entropy
    classification (default: scikit-learn's 1797 digits); a canary's input is all zeros.

    ``privacy_unit="user"`` audits user-level privacy: each canary is a *user* of
    ``examples_per_canary`` examples (default 4), in or out as a whole, each example with a
    gradient of ``64 R`` on the canary's coordinate; the engine (``privacy_unit="user"``) clips
    each user's summed gradient to R, the loader samples users with rate ``sample_rate`` (over
    real users plus all potential canary users), and the epsilon is the user-level one. ``users``
    gives each real example's user id (any integers; default: consecutive groups of
    ``examples_per_canary`` examples). A third deliberately broken run, only at the user level:
    ``clip_per_example`` gives the engine a distinct user id for every row, so it clips each
    example instead of each user (a canary user then adds ``examples_per_canary`` x R).

    ``noise="bandmf"`` audits banded correlated noise (``bands`` bands, default 2) with cyclic Poisson sampling
    over ``bands`` groups, ``sample_rate`` the rate within a group: canary ``i`` is in group ``i mod bands``
    (fixed in advance, so the auditor knows it whether the canary is in or out), the promise is the amplified
    BandMF epsilon (``dptrain.correlated``), and the auditor scores each canary on ``C y`` (:func:`banded_scores`).
    BLT noise is not audited: it is not amplified and its columns overlap, so a canary's steps are no longer
    independent observations for this one-run test; its epsilon rests on the sensitivity of its strategy.
    """
    started = time.perf_counter()
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    canaries = checks.positive_int("canaries", canaries)
    steps = checks.positive_int("steps", steps)
    sample_rate = checks.rate("sample_rate", sample_rate)
    confidence = checks.open_unit("confidence", confidence)
    noise_scale = checks.non_negative("noise_scale", noise_scale)
    per_canary = _checked_unit(privacy_unit, examples_per_canary, users, clip_per_example)
    if noise == "blt":
        raise ValueError("the audit supports noise='gaussian' and 'bandmf'; BLT noise is not amplified and its "
                         "columns overlap, so the one-run audit's per-step likelihood does not apply "
                         "(docs/correlated-noise.md)")
    noise = checks.choice("noise", noise, ("gaussian", "bandmf"))
    if noise == "gaussian" and bands is not None:
        raise ValueError("bands applies to noise='bandmf'")
    bands = 1 if noise == "gaussian" else checks.positive_int("bands", AUDIT_DEFAULTS["bands"] if bands is None
                                                              else bands)
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    from . import accounting
    from .data import poisson_loader
    from .engine import PrivacyEngine
    from .models import build_image_model

    if data is None:
        images, labels = _digits()
        data_name = "digits"
    else:
        images, labels = _checked_data(data)
        data_name = "custom data"
    n = len(labels)
    if privacy_unit == "user":
        real_users = (torch.arange(n) // per_canary if users is None else _checked_users(users, n))
        population = int(real_users.max()) + 1  # real users, ids 0 .. population - 1
    else:
        population = n
    if isinstance(model, nn.Module):
        base, model_name = copy.deepcopy(model), type(model).__name__
    elif isinstance(model, str):
        if images.dim() != 4:
            raise ValueError(f"model {model!r} is built for images [N, C, H, W], but the inputs have shape "
                             f"{tuple(images.shape)}; pass your own nn.Module for other inputs")
        with torch.random.fork_rng(devices=[]):  # the caller's global torch RNG stays as it was
            torch.manual_seed(seed)
            base = build_image_model(model, images.shape[1], int(labels.max()) + 1, images.shape[2]).model
        model_name = model
    else:
        raise ValueError(f"model must be a model spec ('cnn', 'mlp') or an nn.Module, got {type(model).__name__}")
    device = next(base.parameters(), torch.empty(0)).device

    coins = np.random.default_rng(seed)
    included = coins.random(canaries) < 0.5  # each canary in with probability 1/2, independently
    member_ids = torch.as_tensor(np.flatnonzero(included), dtype=torch.long)
    member_rows = member_ids.repeat_interleave(per_canary)  # a canary user's rows: all of them, or none
    dataset = torch.utils.data.TensorDataset(
        torch.cat([images, images.new_zeros((len(member_rows), *images.shape[1:]))]),
        torch.cat([labels, labels.new_zeros(len(member_rows))]),
        torch.cat([torch.full((n,), -1, dtype=torch.long), member_rows]),
    )
    # q is fixed by the pool of every potential member (unit: example or user), not by the coins:
    # neighbouring datasets (one canary in or out) are then sampled with the same q, as the accounting assumes.
    pool = population + canaries
    batch_size = max(1, round(sample_rate * pool / bands))  # sample_rate: within a cyclic group

    audited = CanaryModel(base, canaries).to(device)
    optimizer = torch.optim.Adam(audited.parameters(), lr=lr)
    mechanism, correlated = None, {}
    if noise == "bandmf":
        from .correlated import CorrelatedMechanism, banded_strategy

        mechanism = CorrelatedMechanism("bandmf", banded_strategy(steps, bands), bands, steps)
        sigma = mechanism.calibrate(epsilon, delta, batch_size * bands / pool, steps, accountant)
        correlated = {"noise": mechanism.strategy, "cyclic_groups": bands, "steps": steps}
    else:
        sigma = accounting.calibrate_noise_multiplier(epsilon, delta, batch_size / pool, steps, accountant=accountant)
    # The mechanism the engine runs: the promise, unless deliberately broken. Its own accountant then
    # charges for what it draws; the epsilon reported is the promise's.
    threshold = max_grad_norm * (_UNCLIPPED_NORM_OVER_R if clipping_off else 1.0)
    engine = PrivacyEngine(
        audited, batch_size=batch_size, sample_size=pool, max_grad_norm=threshold,
        noise_multiplier=sigma * noise_scale * (max_grad_norm / threshold),  # the noise drawn: sigma R noise_scale
        clipping_mode=clipping_mode, accountant=accountant, seed=seed + 1, privacy_unit=privacy_unit, **correlated,
    )
    cyclic = bands if noise == "bandmf" else None
    loader_generator = torch.Generator().manual_seed(seed + 2)
    if privacy_unit == "user":
        # Canary user i has the id population + i: distinct from every real user's.
        row_users = torch.cat([real_users, population + member_rows])
        loader = poisson_loader(dataset, sample_rate=engine.sample_rate, steps=steps, generator=loader_generator,
                                users=row_users, cyclic_groups=cyclic)
    else:
        loader = poisson_loader(dataset, sample_rate=engine.sample_rate, steps=steps, generator=loader_generator,
                                cyclic_groups=cyclic)
    canary_groups = np.arange(canaries) % bands
    if cyclic is not None:
        # Canary i is in group i mod b, decided before the coins: the same whether it is in or out, so the
        # auditor may use it. (Any fixed group of the differing unit is covered by the amplification theorem.)
        sampler = loader.batch_sampler
        if privacy_unit == "user":  # units are users: canary user i has the id population + i
            units, canary_of_unit = torch.searchsorted(sampler.user_ids, population + member_ids), member_ids
        else:  # units are rows: the canaries' rows follow the n real ones
            units, canary_of_unit = n + torch.arange(len(member_rows)), member_rows
        sampler.group_of[units] = torch.as_tensor(canary_groups)[canary_of_unit]
    engine.attach(optimizer, data_loader=loader)

    # What the auditor sees: the private gradient of the probe after each step, times the
    # divisor: the noisy sum of the clipped canary gradients on each canary's coordinate.
    observations: list[np.ndarray] = []

    def observe(optimizer, args, kwargs):
        observations.append(audited.probe_gradient().detach().double().cpu().numpy() * engine.batch_size)

    handle = optimizer.register_step_post_hook(observe)
    canary_norm = CANARY_NORM_OVER_R * max_grad_norm  # of each of a canary's examples
    try:
        audited.train()
        for step, batch in enumerate(loader, 1):
            if privacy_unit == "user":
                batch, batch_users = batch
                if clip_per_example:  # deliberately broken: every row its own user, so every example is clipped
                    batch_users = torch.arange(len(batch_users))
                unit = {"users": batch_users.to(device)}
            else:
                unit = {}
            x, y, canary_id = (t.to(device) for t in batch)
            logits, probe_output = audited(x, canary_id)
            engine.backward(canary_losses(logits, probe_output, y, canary_id, canary_norm), **unit)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if progress is not None:
                progress(step, steps)
    finally:
        handle.remove()
        engine.detach()
    if len(observations) != steps:
        raise RuntimeError(f"observed {len(observations)} of {steps} steps")  # a bug, not a user error

    # White-box knowledge of the claimed mechanism: a clipped canary (all of its examples
    # together) adds exactly R to its coordinate (abadi clipping of a per_canary x 64 R
    # gradient), and the noise claimed is sigma * R. The auditor uses the claimed mechanism,
    # not the one run: it tests the promise.
    canary_sum = canary_norm * per_canary
    contribution = canary_sum * min(1.0, max_grad_norm / canary_sum)
    if mechanism is not None:
        scores = banded_scores(np.stack(observations), mechanism.strategy.coefficients, canary_groups,
                               contribution=contribution, noise_std=sigma * max_grad_norm,
                               sample_rate=engine.sample_rate)
        claimed = mechanism.epsilon(sigma, engine.sample_rate, engine.steps_taken, delta, accountant)
    else:
        scores = subsampled_gaussian_scores(
            np.stack(observations), contribution=contribution,
            noise_std=sigma * max_grad_norm, sample_rate=engine.sample_rate,
        )
        claimed = accounting.compute_epsilon(sigma, engine.sample_rate, engine.steps_taken, delta, accountant)
    bound = epsilon_lower_bound(scores, included, delta=delta, confidence=confidence)
    return AuditResult(
        epsilon=claimed,
        delta=delta, epsilon_lower_bound=bound.epsilon,
        confidence=confidence, canaries=canaries, steps=steps, clipping_mode=clipping_mode,
        noise_scale=float(noise_scale), included_canaries=int(included.sum()), guesses_in=bound.guesses_in,
        guesses_out=bound.guesses_out, correct_guesses=bound.correct, noise_multiplier=sigma,
        sample_rate=engine.sample_rate, max_grad_norm=max_grad_norm, accountant=accountant, model=model_name,
        data=data_name, train_size=n, seed=seed, wall_time_s=round(time.perf_counter() - started, 3),
        privacy_unit=privacy_unit, examples_per_canary=per_canary, noise=noise,
        bands=bands if noise == "bandmf" else None,
        clipped_unit="example" if clip_per_example else privacy_unit,
        train_users=population if privacy_unit == "user" else None,
    )


def format_report(result: AuditResult) -> str:
    """The text output of ``dptrain audit``: the two numbers and what they mean."""
    r = result
    warnings_ = _broken_promise_warnings(r)
    samples = "images" if r.data == "digits" else "samples"
    if r.privacy_unit == "user":
        real = f"{r.train_size} {samples} of {r.train_users} users"
        planted = (f"{r.canaries} canary users of {r.examples_per_canary} "
                   f"example{'s' if r.examples_per_canary != 1 else ''} each")
        who = "one user (all of their examples together)"
    else:
        real, planted, who = f"{r.train_size} {samples}", f"{r.canaries} gradient canaries", "one training example"
    lines = list(warnings_)
    lines += [
        f"audit: {r.model} on {r.data} ({real}) + {planted} "
        f"({r.included_canaries} included at random), {r.steps} steps at sample rate {r.sample_rate:.4g}"
        f"{' per user' if r.privacy_unit == 'user' else ''}"
        f"{f' within {r.bands} cyclic groups, banded correlated noise (bandmf)' if r.noise == 'bandmf' else ''}, "
        f"clipping {r.clipping_mode}, max grad norm {r.max_grad_norm:g}",
        f"claimed:  epsilon = {r.epsilon:.3f} at delta = {r.delta:g}{' per user' if r.privacy_unit == 'user' else ''} "
        f"({r.accountant} accountant, noise multiplier {r.noise_multiplier:.4g})",
        f"measured: epsilon >= {r.epsilon_lower_bound:.3f} with {r.confidence:.0%} confidence "
        f"({r.correct_guesses} of {r.guesses_in + r.guesses_out} guesses right: {r.guesses_in} 'in', "
        f"{r.guesses_out} 'out', {r.canaries - r.guesses_in - r.guesses_out} abstentions)",
        f"The claimed epsilon is what the accountant promises for this run: no attack may learn more about any "
        f"{who} than it allows.",
        "The measured epsilon is what an attack on this very run proves, from the noisy gradients: above the "
        "claim it would show that the implementation breaks its promise; below it, the gap is the looseness of "
        "a one-run audit, not spare privacy.",
    ]
    if r.consistent:
        lines.append(f"verdict: consistent (lower bound {r.epsilon_lower_bound:.3f} <= epsilon {r.epsilon:.3f})")
    else:
        lines.append(f"verdict: PROMISE BROKEN (lower bound {r.epsilon_lower_bound:.3f} > epsilon "
                     f"{r.epsilon:.3f}, at {r.confidence:.0%} confidence)")
    lines += warnings_
    return "\n".join(lines)


def _broken_promise_warnings(result: AuditResult) -> list[str]:
    """One warning per deliberate break of the promise that the result records (none for an honest run)."""
    found = []
    if result.noise_scale != 1:
        found.append(_broken_promise_warning(result.noise_scale))
    if result.clipped_unit != result.privacy_unit:
        found.append(f"WARNING: clip_per_example: this run clips each example instead of each user, so a user of "
                     f"{result.examples_per_canary} examples moves the update by up to {result.examples_per_canary} "
                     "x the clipping norm; it DELIBERATELY BREAKS ITS PRIVACY PROMISE and exists only to show that "
                     "the audit catches a broken promise. Never train a real model this way.")
    return found


def _broken_promise_warning(noise_scale: float) -> str:
    return (f"WARNING: --noise-scale {noise_scale:g}: this run draws {noise_scale:g} x the noise its accountant "
            "charges for, so it DELIBERATELY BREAKS ITS PRIVACY PROMISE; it exists only to show that the audit "
            "catches a broken promise. Never train a real model this way.")


def run_command(options: dict, *, json_output: bool = False) -> int:
    """`dptrain audit`: run :func:`run_audit` with ``options`` and print its report (or JSON)."""
    from tqdm import tqdm

    noise_scale = options.get("noise_scale", AUDIT_DEFAULTS["noise_scale"])
    if noise_scale != 1:
        print(_broken_promise_warning(noise_scale), file=sys.stderr)
    threads = torch.get_num_threads()
    # The digits CNN is many tiny operations per step: one thread is faster (as in dptrain train).
    torch.set_num_threads(1)
    bars = []  # opened at the first step, so that a configuration error shows no bar

    def progress(step: int, steps: int) -> None:
        if not bars:
            bars.append(tqdm(total=steps, desc="audit", unit="step", file=sys.stderr, leave=False,
                             dynamic_ncols=True))
        bars[0].update(1)

    try:
        result = run_audit(**options, progress=progress)
    except KeyboardInterrupt:
        print("dptrain audit: interrupted", file=sys.stderr)
        return 130
    finally:
        for bar in bars:
            bar.close()
        torch.set_num_threads(threads)  # main() may run in-process
    if json_output:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_report(result))
    if noise_scale != 1:
        print(_broken_promise_warning(noise_scale), file=sys.stderr)
    return 0
