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

The parts, one concept per module (every name is imported from ``dptrain.audit``):

* :mod:`~dptrain.audit.bounds`: the statistics: the p-value of the guesses, the lower bound on epsilon
  (:class:`GuessingBound`), the canaries' scores under the subsampled Gaussian and banded noise.
* :mod:`~dptrain.audit.canaries`: :class:`CanaryModel` and :func:`canary_losses`, the canaries in the engine's path.
* :mod:`~dptrain.audit.run`: :func:`run_audit`, its defaults and data checks, and :class:`AuditResult`.
* :mod:`~dptrain.audit.report`: the text report, the warnings of a deliberately broken run, ``dptrain audit``.

Built on the engine as a user's code is: it may import ``engine`` and what is below it (``core``'s clipping modes,
``correlated``, ``accounting``, ``data``, ``models``), never ``cli``, ``testing`` or ``integrations``.
"""
from __future__ import annotations

# banded_scores, CANARY_NORM_OVER_R and run_command are imported from here too (tests, docs, the CLI),
# outside __all__ as before.
from .bounds import GuessingBound, banded_scores, epsilon_lower_bound, one_run_p_value, subsampled_gaussian_scores  # noqa: F401
from .canaries import CANARY_NORM_OVER_R, CanaryModel, canary_losses  # noqa: F401
from .report import format_report, run_command  # noqa: F401
from .run import AUDIT_DEFAULTS, AuditResult, run_audit

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
