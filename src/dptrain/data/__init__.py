"""Poisson sampling and virtual (physical) batches.

DP-SGD's privacy analysis assumes *Poisson sampling*: every step includes each training
example independently with probability ``q`` (the sample rate), so batch sizes vary and
can be zero. A shuffled fixed-size ``DataLoader`` does not match that analysis.

* :class:`PoissonSampler` is a batch sampler that draws such batches, deterministically
  from a ``torch.Generator`` and checkpointable mid-epoch.
* :class:`DistributedPoissonSampler` does the same for one rank of ``torch.distributed``
  data-parallel training: each rank samples its own shard with the global ``q``.
* :func:`poisson_loader` wraps a map-style dataset into a ``DataLoader`` that uses it and
  that returns correctly shaped empty batches (``distributed=True``: one rank's loader).
* :func:`split_batches` cuts each (logical) batch into physical batches that fit in
  memory; the optimizer steps once per logical batch.
* ``poisson_loader(..., max_batch_size=K)`` makes *fixed-shape* batches: every batch is a
  :class:`FixedShapeBatch` of exactly K rows, the Poisson draw (cut to a uniformly random K
  of its examples when larger) followed by zero rows, with a mask saying which rows are
  real; :func:`masked_losses` zeroes the losses of the padding. The accounting adds
  :func:`dptrain.accounting.truncation_delta` to delta.
* ``poisson_loader(..., users=user_ids)`` samples *users* rather than examples (user-level
  privacy): each user is in a batch independently with probability q, with up to
  ``max_examples_per_user`` of their examples, and every batch is a :class:`UserBatch`
  ``(data, users)`` that says whose each row is (:class:`UserPoissonSampler`).
* ``poisson_loader(..., cyclic_groups=g)`` samples *cyclically* (:mod:`dptrain.data.cyclic`): each unit in one of g
  fixed groups, step t samples group ``t mod g`` (what amplified banded matrix factorization needs).

The modules, one concept each: ``poisson`` (``PoissonSampler``, its checkpoint and resume), ``users``
(user-level sampling, ``UserBatch``), ``distributed`` (one rank's shard), ``batches`` (a batch's structure, empty
batches), ``fixed_shape`` (``FixedShapeBatch``, ``masked_losses``), ``loaders`` (``poisson_loader``,
``DPDataLoader``), ``physical_batches`` (``split_batches``) and ``cyclic`` (the cyclic samplers). Import the names from
``dptrain.data``. The package imports nothing of dptrain but ``_checks``: the engine reads its loaders, never the
other way round.
"""

from __future__ import annotations

# In the order of the API reference (mkdocstrings renders them in import order), so not sorted.
# isort: off
from .poisson import PoissonSampler
from .users import UserPoissonSampler, UserBatch, FixedShapeUserBatch
from .distributed import DistributedPoissonSampler, DistributedUserPoissonSampler
from .fixed_shape import FixedShapeBatch, masked_losses
from .loaders import DPDataLoader, poisson_loader, is_poisson_loader
from .physical_batches import split_batches
# isort: on

__all__ = [
    "DPDataLoader",
    "DistributedPoissonSampler",
    "DistributedUserPoissonSampler",
    "FixedShapeBatch",
    "FixedShapeUserBatch",
    "PoissonSampler",
    "UserBatch",
    "UserPoissonSampler",
    "is_poisson_loader",
    "masked_losses",
    "poisson_loader",
    "split_batches",
]
