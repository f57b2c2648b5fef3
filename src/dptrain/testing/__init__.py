"""dptrain's own test kit, public so that users can check their own layer rules: the specification every
clipping mode is tested against, the engine run the same way, and the comparison of the two.

``assert_rule_exact`` runs the engine in every clipping mode and on both backward paths against the oracle::

    dptrain.testing.assert_rule_exact(Scale(6), torch.randn(5, 3, 6, dtype=torch.float64))

It is built from four parts, each usable alone:

- the oracle, ``reference_clipped_gradient`` (``reference_user_clipped_gradient`` for ``privacy_unit="user"``)::

    ref = dptrain.testing.reference_clipped_gradient(
        model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), (x, y), max_grad_norm=R)

- the engine, ``clipped_gradient`` (the same arguments, and the mode): ``p.grad`` after one private step at
  noise 0 and batch size 1, which is the clipped sum (``attached_engine`` sets up the same engine for a loop
  of one's own);
- ``threshold_between``, a ``max_grad_norm`` that clips some samples and not others;
- ``mismatches``, every parameter where the two differ beyond a tolerance (``max_relative_error`` for reports).

And DP's own definition, which needs no oracle: ``neighbour_test`` (``assert_neighbours_bounded``) runs one private
step of a user's own loss and forward on a batch and on the batch without one sample, and reports how far apart they
are in units of ``max_grad_norm`` (at most 1 for a private step): ``neighbours``.

The oracle shares no code with the engine: per-sample gradients come from autograd on
each sample alone, and the clipping functions and groups are written out again here.

The kit, one part a module: ``oracle`` (the specification), ``engine_step`` (the engine run the same way),
``comparison``, ``rule_check`` (``assert_rule_exact``) and ``neighbours`` (the neighbour test). Import the names
from ``dptrain.testing``. The kit may import the engine and every package below it; nothing in dptrain imports the
kit.
"""
from __future__ import annotations

# In the order of the API reference (mkdocstrings renders them in import order), so not sorted.
# isort: off
from .oracle import trainable_named_parameters, per_sample_gradients, reference_clipped_gradient
from .oracle import reference_user_clipped_gradient, threshold_between
from .engine_step import PATHS, attached_engine, clipped_gradient, split_batch
from .comparison import mismatches, max_relative_error
from .rule_check import assert_rule_exact
from .neighbours import NeighbourReport, assert_neighbours_bounded, neighbour_test
# isort: on

__all__ = [
    "trainable_named_parameters", "per_sample_gradients", "reference_clipped_gradient",
    "reference_user_clipped_gradient", "threshold_between", "attached_engine", "clipped_gradient", "split_batch",
    "mismatches", "max_relative_error", "assert_rule_exact", "neighbour_test", "assert_neighbours_bounded",
    "NeighbourReport", "PATHS",
]
