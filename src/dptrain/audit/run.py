"""The audit run: its defaults, the checks of its data and options, the private training with canaries
(:func:`run_audit`) and what it found (:class:`AuditResult`)."""
from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import _checks
from ..core.algorithms import DEFAULT_CLIPPING_MODE
from .bounds import banded_scores, epsilon_lower_bound, subsampled_gaussian_scores
from .canaries import CANARY_NORM_OVER_R, CanaryModel, canary_losses

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
# A clipping threshold, in units of R, that no gradient of an audit reaches (run_audit's clipping_off);
# a power of two, so that the noise multiplier of that run times the threshold is exactly sigma R.
_UNCLIPPED_NORM_OVER_R = 2.0**20


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
    return _checks.positive_int("examples_per_canary", examples_per_canary)


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
    epsilon = _checks.positive("epsilon", epsilon)
    delta = _checks.open_unit("delta", delta)
    canaries = _checks.positive_int("canaries", canaries)
    steps = _checks.positive_int("steps", steps)
    sample_rate = _checks.rate("sample_rate", sample_rate)
    confidence = _checks.open_unit("confidence", confidence)
    noise_scale = _checks.non_negative("noise_scale", noise_scale)
    per_canary = _checked_unit(privacy_unit, examples_per_canary, users, clip_per_example)
    if noise == "blt":
        raise ValueError("the audit supports noise='gaussian' and 'bandmf'; BLT noise is not amplified and its "
                         "columns overlap, so the one-run audit's per-step likelihood does not apply "
                         "(docs/correlated-noise.md)")
    noise = _checks.choice("noise", noise, ("gaussian", "bandmf"))
    if noise == "gaussian" and bands is not None:
        raise ValueError("bands applies to noise='bandmf'")
    bands = 1 if noise == "gaussian" else _checks.positive_int("bands", AUDIT_DEFAULTS["bands"] if bands is None
                                                              else bands)
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    from .. import accounting
    from ..data import poisson_loader
    from ..engine import PrivacyEngine
    from ..models.build import build_image_model

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
    mechanism = None
    correlated: dict[str, Any] = {}
    if noise == "bandmf":
        from ..correlated import CorrelatedMechanism, banded_strategy

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
        from ..data.cyclic import CyclicPoissonSampler, CyclicUserPoissonSampler

        sampler = loader.batch_sampler
        if privacy_unit == "user":  # units are users: canary user i has the id population + i
            assert isinstance(sampler, CyclicUserPoissonSampler)  # (poisson_loader's, for users and cyclic groups)
            units, canary_of_unit = torch.searchsorted(sampler.user_ids, population + member_ids), member_ids
        else:  # units are rows: the canaries' rows follow the n real ones
            assert isinstance(sampler, CyclicPoissonSampler)  # (poisson_loader's, for cyclic groups)
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
        from ..correlated import BandedToeplitz

        assert isinstance(mechanism.strategy, BandedToeplitz)  # (banded_strategy's)
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
