"""The loaders: :func:`poisson_loader` builds a :class:`DPDataLoader` from a dataset and the sampler it asks for.

It picks the sampler (examples or users, one rank's shard, cyclic groups through :mod:`dptrain.data.cyclic`) and the
collate (empty batches, fixed shapes, user batches); :func:`is_poisson_loader` tells the engine whether a loader
draws its batches by Poisson sampling.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
from typing import Any, Callable, Iterator, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

from .. import _checks
from . import cyclic
from .batches import _EmptyBatchCollate, batch_len
from .distributed import DistributedPoissonSampler, DistributedUserPoissonSampler
from .fixed_shape import _FixedShapeCollate
from .poisson import PoissonSampler
from .users import UserPoissonSampler, _ExamplesWithUsers, _FixedShapeUserCollate, _user_ids, _UserCollate


@contextlib.contextmanager
def drawing(sampler: PoissonSampler):
    """The ``DPDataLoader`` of ``sampler`` draws from it (its iterator starts drawing inside, at the first batch): the
    batches another loader drew before are behind."""
    sampler.drawn_by_owner, sampler.drawn_elsewhere = True, False
    try:
        yield
    finally:
        sampler.drawn_by_owner = False


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over Poisson-sampled batches; build it with :func:`poisson_loader`.

    ``sample_rate`` is the probability q that an example is in a batch, and
    ``expected_batch_size`` is ``q * len(dataset)``, the denominator DP-SGD uses to
    average the noisy gradient sum (the actual batch size is random and private).
    With a :class:`DistributedPoissonSampler` (one rank of data-parallel training) both
    are global: q is the rate every rank samples its shard with, and
    ``expected_batch_size`` the expected size of the union of all ranks' batches.
    ``max_batch_size`` is K for fixed-shape batches (:class:`FixedShapeBatch`), else None.

    ``privacy_unit`` is what the sampling includes or leaves out, ``"example"`` or ``"user"``.
    For ``"user"`` (``poisson_loader(..., users=...)``), ``sample_rate`` is the probability that a
    *user* is in a batch, ``num_users`` the number of distinct users, ``expected_batch_size`` the
    expected number of users per batch (``q * num_users``), ``max_examples_per_user`` the cap m
    (None: all of a user's examples), and ``dataset`` wraps the given dataset (its ``dataset``
    attribute) to pair each example with its user. For ``"example"``, ``num_users`` and
    ``max_examples_per_user`` are None.

    What the engine reads at every backward (``attach(optimizer, data_loader=loader)``): ``batches_handed_out``, and
    ``recent_real_rows``, the fewest real rows of the last two batches handed out that carry padding. A backward
    without the mask over more rows is refused, naming ``mask_call`` (how this loader's masks reach the engine: a
    framework integration names its own call). ``mask_key``: where a dict batch keeps its mask.
    """

    def __init__(self, dataset: Dataset, sampler: PoissonSampler, **kwargs: Any):
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        sampler.owned = True
        self.sample_rate = sampler.sample_rate
        #: g of cyclic Poisson sampling (dptrain.data.cyclic; 1: plain Poisson sampling): q is then the rate within a group
        self.cyclic_groups = getattr(sampler, "cyclic_groups", 1)
        self.expected_batch_size = sampler.sample_rate * sampler.num_samples / self.cyclic_groups
        #: with cyclic groups, the run's step number of the last batch handed out (None before the first)
        self.last_batch_step: int | None = None
        self.max_batch_size = sampler.max_batch_size
        self.privacy_unit = sampler.privacy_unit
        self.num_users = getattr(sampler, "num_users", None)
        self.max_examples_per_user = getattr(sampler, "max_examples_per_user", None)
        self._consumed: int | None = None  # batches handed out in the current epoch
        #: the key of a dict batch's fixed-shape mask (integrations.loaders' ``mask_key``; None: not a dict batch)
        self.mask_key: str | None = None
        #: the call that gives the engine this loader's masks, named when a backward without the mask is refused
        self.mask_call = "engine.backward(losses, mask=mask)"
        #: batches handed out so far, over every epoch
        self.batches_handed_out = 0
        # rows, real rows (None: no padding) and masks of the last two batches handed out (two: a loop may fetch
        # the next batch before the last backward)
        self._recent_rows: collections.deque[int] = collections.deque(maxlen=2)
        self._recent_real: collections.deque[int | None] = collections.deque(maxlen=2)
        self._recent_masks: collections.deque[torch.Tensor | None] = collections.deque(maxlen=2)

    @property
    def poisson_sampler(self) -> PoissonSampler:
        return cast(PoissonSampler, self.batch_sampler)  # (the constructor's)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # (a generator over DataLoader's iterator)
        sampler = self.poisson_sampler
        self._consumed = sampler._position if sampler._resume_pending else 0
        with drawing(sampler):
            for batch in super().__iter__():
                self._consumed += 1
                self._note_batch(batch)
                if self.cyclic_groups > 1:
                    assert isinstance(sampler, cyclic._CyclicGroups)  # (only a cyclic sampler has groups)
                    self.last_batch_step = sampler.step_of(self._consumed - 1)
                yield batch
        self._consumed = None

    def _note_batch(self, batch: Any) -> None:
        """What the engine checks a backward against: the batch's rows, and which of them are real."""
        rows = batch_len(batch) or 0
        mask = self.padding_mask(batch)
        self._recent_rows.append(rows)
        self._recent_masks.append(mask)
        real = rows if mask is None else int(mask.sum())  # (a collated mask: on the CPU)
        self._recent_real.append(real if real < rows else None)
        self.batches_handed_out += 1

    def padding_mask(self, batch: Any) -> torch.Tensor | None:
        """The fixed-shape mask of one of this loader's batches (True for the real rows), None without padding."""
        if self.mask_key is not None and isinstance(batch, collections.abc.Mapping):
            return batch.get(self.mask_key)
        return getattr(batch, "mask", None) if "mask" in getattr(type(batch), "_fields", ()) else None

    @property
    def recent_batch_rows(self) -> int | None:
        """The most rows of the last two batches handed out (None before the first): a backward over more rows
        than that treats rows as samples that are not (``torch.cat([x, x_augmented])``)."""
        return max(self._recent_rows) if self._recent_rows else None

    @property
    def recent_real_rows(self) -> int | None:
        """The fewest real rows (not padding) of those of the last two batches handed out that carry padding (None if
        neither does): a backward without the batch's mask over more rows than that may count padding as samples."""
        return min((real for real in self._recent_real if real is not None), default=None)

    @property
    def recent_masks(self) -> list[torch.Tensor]:
        """The fixed-shape masks of the last two batches handed out (the batch being trained on is one of them)."""
        return [mask for mask in self._recent_masks if mask is not None]

    def state_dict(self) -> dict:
        """Sampler checkpoint counting the batches *consumed*, not prefetched by workers."""
        sampler = self.poisson_sampler
        if self._consumed is None or sampler._resume_pending:
            return sampler.state_dict()
        return sampler._state_at(self._consumed)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``: the next ``iter()`` resumes the saved epoch."""
        self.poisson_sampler.load_state_dict(state)


def poisson_loader(
    dataset: Dataset,
    sample_rate: float | None = None,
    batch_size: int | None = None,
    *,
    steps: int | None = None,
    generator: torch.Generator | None = None,
    num_workers: int = 0,
    collate_fn: Callable[[list], Any] | None = None,
    pin_memory: bool = False,
    distributed: bool = False,
    num_replicas: int | None = None,
    rank: int | None = None,
    max_batch_size: int | None = None,
    users: Any = None,
    max_examples_per_user: int | None = None,
    cyclic_groups: int | None = None,
) -> DPDataLoader:
    """A ``DataLoader`` with Poisson sampling over a map-style ``dataset``.

    Give exactly one of ``sample_rate`` (q in (0, 1]) or ``batch_size`` (the *expected*
    batch size, q = batch_size / len(dataset)). One epoch is ``steps`` batches, by
    default ``round(1 / q)``. Empty batches keep the structure of a real batch (shape
    ``[0, ...]``, same dtypes), learned from ``dataset[0]``.

    ``distributed=True`` builds the loader of one rank of ``torch.distributed``
    data-parallel training (one process per device; see
    :class:`DistributedPoissonSampler`). ``batch_size`` / ``sample_rate`` are then
    *global*: q = batch_size / len(dataset), the q the accountant uses, and rank ``r``
    includes each index of its shard ``r, r + W, r + 2W, ...`` with probability q, so the
    union over the ``W = num_replicas`` ranks is a Poisson sample of the whole dataset
    (expected size ``batch_size``, the divisor of the noisy gradient sum). Every rank runs
    the same ``steps``; a rank's batch may be empty. ``num_replicas`` / ``rank`` default
    to the initialised process group's world size / rank. Each rank draws from its own
    generator, derived from ``generator`` and the rank (or seeded from ``os.urandom``
    without one): pass the same seeded generator on every rank for reproducible runs.

    ``max_batch_size=K`` makes every batch a :class:`FixedShapeBatch` ``(data, mask)``:
    ``data`` has exactly K rows (tensors ``[K, ...]``), ``mask`` is a ``[K]`` bool tensor,
    True for the real rows, which come first. A Poisson draw of more than K examples keeps
    a uniformly random K of them; a smaller one is padded with zero rows. Fixed shapes
    let a compiled model compile once. Train on ``engine.backward(losses, mask=mask)``, and
    account with ``PrivacyEngine(..., max_batch_size=K)``: truncation adds
    ``dptrain.accounting.truncation_delta(len(dataset), q, K, steps)`` to delta, and
    ``dptrain.accounting.default_max_batch_size`` is the smallest K that keeps it below a
    tenth of delta. Not available with ``distributed=True`` yet.

    ``users`` (one integer user id per dataset index: a list, numpy array or tensor) makes the
    loader sample *users* for user-level privacy (:class:`UserPoissonSampler`): each distinct
    user is in a batch independently with probability q = ``batch_size / number of users`` (or
    ``sample_rate``), with up to ``max_examples_per_user`` = m of their examples, a uniformly
    random m of them when they have more (``None``: all of them). Every batch is a
    :class:`UserBatch` ``(data, users)``, ``users`` the ``[N]`` int64 user id of each row; train
    with ``engine.backward(losses, users=users)`` and ``PrivacyEngine(..., privacy_unit="user",
    sample_size=<number of users>, batch_size=<expected users per batch>)``. The guarantee holds
    whatever m is, ``None`` included: the engine clips the sum of a user's gradients, so a user
    moves the update by at most the clipping norm however many rows they have. m bounds the rows,
    hence the memory and time, of a step (a prolific user otherwise brings all of their
    examples). Epochs are ``round(1 / q)`` steps. With ``distributed=True`` the ranks own
    disjoint sets of users, all of a user's examples on one rank
    (:class:`DistributedUserPoissonSampler`). Not available with ``max_batch_size`` yet.

    ``cyclic_groups=g`` makes the sampling *cyclic* (:mod:`dptrain.data.cyclic`, what amplified banded matrix
    factorization needs: ``PrivacyEngine(..., noise="bandmf", bands=b)`` with ``g >= b``): every unit (example,
    or user) is assigned once to one of g groups, uniformly at random, and step t samples only group
    ``t mod g``, each of its units with probability q, the *within-group* rate: ``q = batch_size * g / N`` for
    an expected batch of ``batch_size`` (``sample_rate`` gives q itself). Epochs are ``round(g / q)`` steps.
    Fixed shapes, users and ``distributed=True`` work as without it. Take exactly one optimizer step per batch,
    in order: the engine checks that step t trains on the loader's batch t.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            "Poisson sampling needs a map-style dataset with __len__ and __getitem__ "
            f"(every example must be addressable), got {type(dataset).__name__}."
        )
    num_samples = len(dataset)
    if num_samples == 0:
        raise ValueError("The dataset is empty: there is nothing to sample.")
    if users is not None:
        user_ids = _user_ids(users, num_samples)
        num_samples = len(torch.unique(user_ids))  # the units q applies to
    elif max_examples_per_user is not None:
        raise ValueError(
            "max_examples_per_user only applies to user-level sampling: pass users= (one user id per example) too"
        )
    if (sample_rate is None) == (batch_size is None):
        raise ValueError(
            "Give exactly one of sample_rate (probability q that an example is in a batch) "
            "or batch_size (the expected batch size, q = batch_size / len(dataset))."
        )
    groups = 1 if cyclic_groups is None else _checks.positive_int("cyclic_groups", cyclic_groups,
                                                                "the number of cyclic groups, g")
    if batch_size is not None:
        batch_size = _checks.positive_int("batch_size", batch_size)
        if groups > 1 and batch_size * groups > num_samples:
            raise ValueError(
                f"batch_size={batch_size} with cyclic_groups={groups} needs batch_size * cyclic_groups <= "
                f"{num_samples} (the units to sample): each group of about {num_samples // groups} units supplies a "
                "whole expected batch at its steps (within-group rate q = batch_size * g / N <= 1). Use fewer groups "
                "or a smaller batch_size")
        if batch_size > num_samples:
            raise ValueError(
                f"batch_size={batch_size} exceeds the number of users {num_samples}; with users=, batch_size is "
                "the expected number of users per batch, at most the number of distinct users (sample rate <= 1)."
                if users is not None else
                f"batch_size={batch_size} exceeds the dataset size {num_samples}; the "
                "expected batch size must be at most len(dataset) (sample rate <= 1)."
            )
        sample_rate = batch_size * groups / num_samples
    assert sample_rate is not None  # (given, or from batch_size: exactly one of them, checked above)
    if not isinstance(distributed, bool):
        raise ValueError(f"distributed must be True or False, got {distributed!r}")
    if max_batch_size is not None:
        max_batch_size = _checks.positive_int("max_batch_size", max_batch_size,
                                             "the fixed number of rows of every batch, K")
        if distributed:
            raise ValueError(
                "max_batch_size is not supported with distributed=True yet: each rank would truncate its own "
                "shard, which the accounting (one Binomial(N, q) draw per step) does not cover"
            )
    if not distributed and (num_replicas is not None or rank is not None):
        raise ValueError(
            "num_replicas / rank only apply to distributed sampling: pass distributed=True "
            "(without it, every process would sample the whole dataset)."
        )
    if groups > 1:
        sampler: PoissonSampler = _cyclic_sampler(num_samples, sample_rate, groups, distributed, num_replicas, rank,
                                                  steps, generator, max_batch_size, user_ids if users is not None
                                                  else None, max_examples_per_user)
    elif distributed and users is not None:
        sampler = DistributedUserPoissonSampler(
            user_ids, sample_rate, num_replicas, rank, steps=steps, generator=generator,
            max_examples_per_user=max_examples_per_user)
    elif distributed:
        sampler = DistributedPoissonSampler(
            num_samples, sample_rate, num_replicas, rank, steps=steps, generator=generator
        )
    elif users is not None:
        sampler = UserPoissonSampler(user_ids, sample_rate, steps=steps, generator=generator,
                                     max_examples_per_user=max_examples_per_user, max_batch_size=max_batch_size)
    else:
        sampler = PoissonSampler(num_samples, sample_rate, steps=steps, generator=generator,
                                 max_batch_size=max_batch_size)
    if users is not None:
        collate: Callable[[list], Any]
        if max_batch_size is None:
            collate = _UserCollate(collate_fn or default_collate, dataset[0])
        else:
            assert max_examples_per_user is not None  # (the sampler requires it with max_batch_size)
            first_free_id = int(user_ids.max()) + 1  # ids of the empty slots: no real user's
            if first_free_id + max_batch_size > torch.iinfo(torch.int64).max:
                raise ValueError(f"user ids up to {first_free_id - 1} leave no int64 ids for the {max_batch_size} "
                                 "empty slots of a fixed-shape batch; renumber the users from 0")
            collate = _FixedShapeUserCollate(collate_fn or default_collate, dataset[0], max_batch_size,
                                             max_examples_per_user, first_free_id)
        return DPDataLoader(_ExamplesWithUsers(dataset, user_ids), sampler, num_workers=num_workers,
                            collate_fn=collate, pin_memory=pin_memory)
    if max_batch_size is None:
        collate = _EmptyBatchCollate(collate_fn or default_collate, dataset[0])
    else:
        collate = _FixedShapeCollate(collate_fn or default_collate, dataset[0], max_batch_size)
    return DPDataLoader(
        dataset, sampler, num_workers=num_workers, collate_fn=collate, pin_memory=pin_memory
    )


def _cyclic_sampler(num_samples, sample_rate, groups, distributed, num_replicas, rank, steps, generator,
                    max_batch_size, user_ids, max_examples_per_user) -> PoissonSampler:
    """The sampler of ``poisson_loader(..., cyclic_groups=groups)`` (``dptrain.data.cyclic``)."""

    if distributed and user_ids is not None:
        return cyclic.CyclicDistributedUserPoissonSampler(user_ids, sample_rate, groups, num_replicas, rank,
                                                          steps=steps, generator=generator,
                                                          max_examples_per_user=max_examples_per_user)
    if distributed:
        return cyclic.CyclicDistributedPoissonSampler(num_samples, sample_rate, groups, num_replicas, rank,
                                                      steps=steps, generator=generator)
    if user_ids is not None:
        return cyclic.CyclicUserPoissonSampler(user_ids, sample_rate, groups, steps=steps, generator=generator,
                                               max_examples_per_user=max_examples_per_user,
                                               max_batch_size=max_batch_size)
    return cyclic.CyclicPoissonSampler(num_samples, sample_rate, groups, steps=steps, generator=generator,
                                       max_batch_size=max_batch_size)


def is_poisson_loader(loader: Any) -> bool:
    """Whether ``loader`` draws its batches by Poisson sampling."""
    return isinstance(loader, DPDataLoader) or isinstance(
        getattr(loader, "batch_sampler", None), PoissonSampler
    )
