"""User-level units: Poisson sampling of users (:class:`UserPoissonSampler`) and the batches that say whose each row is.

The loader's dataset pairs each example with its user id (``_ExamplesWithUsers``); the user collates build a
:class:`UserBatch` ``(data, users)``, or a :class:`FixedShapeUserBatch` of K slots of m rows each.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
from torch.utils.data import Dataset

from .. import _checks
from .batches import _batch_size, _EmptyBatchCollate, _map_batch
from .fixed_shape import _append_rows, _zero_row
from .poisson import PoissonSampler


def _user_ids(users: Any, num_examples: int | None = None) -> torch.Tensor:
    """``users`` as a 1-D int64 tensor (of ``num_examples`` ids, if given), or a ValueError that says what is wrong."""
    how = "pass one integer user id per dataset index (a list, a numpy array or an integer tensor)"
    if isinstance(users, (str, bytes, Mapping)) or not hasattr(users, "__len__"):
        raise ValueError(f"users must be a sequence of integer user ids, got {type(users).__name__}: {how}")
    try:
        ids = users.detach().cpu() if isinstance(users, torch.Tensor) else torch.as_tensor(users)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"users must be a sequence of integer user ids ({error}): {how}") from error
    if ids.numel() == 0:
        raise ValueError("users is empty: there is no user to sample")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"users must hold integer user ids, got a {ids.dtype} sequence: {how}; map other ids (names, "
            "strings) to integers first, e.g. {name: i for i, name in enumerate(sorted(set(names)))}"
        )
    if ids.dim() != 1 or (num_examples is not None and len(ids) != num_examples):
        raise ValueError(
            f"users must have one user id per example: the dataset has {num_examples} examples, users has shape "
            f"{list(ids.shape)}; {how}"
        )
    return ids.to(torch.int64)


class UserPoissonSampler(PoissonSampler):
    """Batch sampler for user-level privacy: Poisson sampling of *users*, then of their examples.

    ``users[i]`` is the integer id of the user who wrote example ``i``. Each of the ``steps``
    batches includes every distinct user independently with probability ``sample_rate`` (the
    q the accountant uses, with the user as the unit), and, for each included user, up to
    ``max_examples_per_user`` of their examples, chosen uniformly at random without
    replacement (all of them when the user has no more; ``None``: always all of them).
    A batch lists the included users in increasing id order, each user's examples next to each
    other, in dataset order. ``steps`` defaults to ``round(1 / sample_rate)``.

    ``num_samples`` is the number of distinct users (the population the rate applies to), so the
    loader's ``expected_batch_size`` is the expected number of *users* per batch. Randomness,
    :meth:`state_dict` and :meth:`load_state_dict` behave as in :class:`PoissonSampler`.
    """

    privacy_unit = "user"

    def __init__(
        self,
        users: Any,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        max_examples_per_user: int | None = None,
        max_batch_size: int | None = None,
    ):
        ids = _user_ids(users)
        self.max_examples_per_user = None if max_examples_per_user is None else _checks.positive_int(
            "max_examples_per_user", max_examples_per_user,
            "the most examples of one user in a batch; None takes all of them")
        if max_batch_size is not None and self.max_examples_per_user is None:
            raise ValueError(
                "fixed-shape user batches (max_batch_size=K users) need max_examples_per_user=m too: a batch is K "
                "users of m rows each, so m must be bounded"
            )
        #: The distinct user ids, increasing; position u of this tensor is the u-th user.
        self.user_ids, dense = torch.unique(ids, sorted=True, return_inverse=True)
        super().__init__(len(self.user_ids), sample_rate, steps=steps, generator=generator,
                         max_batch_size=max_batch_size)
        self.num_users = self.num_samples
        self.num_examples = len(ids)
        # Dataset indices grouped by user (dataset order within a user): user u owns
        # _by_user[_starts[u] : _starts[u] + _counts[u]].
        self._by_user = torch.argsort(dense, stable=True)
        self._counts = torch.bincount(dense, minlength=self.num_users)
        self._starts = self._counts.cumsum(0) - self._counts
        #: The users this sampler draws from, as positions in :attr:`user_ids`: all of them (one
        #: rank's share in :class:`DistributedUserPoissonSampler`).
        self.own_users = torch.arange(self.num_users)

    @property
    def max_rows_per_user(self) -> int:
        """The most rows one user can have in a batch: ``min(max_examples_per_user, largest user's examples)``,
        or ``max_examples_per_user`` with ``max_batch_size`` (fixed-shape batches pad every user to m rows)."""
        if self.max_batch_size is not None:
            assert self.max_examples_per_user is not None  # (required with max_batch_size: checked at construction)
            return self.max_examples_per_user
        largest = int(self._counts[self.own_users].max())
        return largest if self.max_examples_per_user is None else min(largest, self.max_examples_per_user)

    def _included_users(self) -> torch.Tensor:
        """This step's users (positions in :attr:`user_ids`): each of :attr:`own_users` with probability q, then
        (``max_batch_size=K``) a uniformly random K of them when more were drawn."""
        drawn = torch.rand(len(self.own_users), generator=self.generator, device=self.generator.device)
        return self._truncate(self.own_users[(drawn < self.sample_rate).cpu()])

    def _draw(self) -> list[int]:
        device = self.generator.device
        included = self._included_users()
        counts = self._counts[included]
        total = int(counts.sum())
        user_of_row = torch.repeat_interleave(torch.arange(len(included)), counts)
        rank_in_user = torch.arange(total) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        rows = self._by_user[self._starts[included][user_of_row] + rank_in_user]
        if self.max_examples_per_user is not None:
            # Each user keeps their examples with the m smallest of i.i.d. uniform keys: a uniformly
            # random m-subset, drawn for all included users at once (no Python loop over users).
            keys = torch.rand(total, generator=self.generator, device=device).cpu()
            by_key = keys.argsort()
            by_user_then_key = by_key[user_of_row[by_key].argsort(stable=True)]
            key_rank = torch.empty_like(rank_in_user)
            key_rank[by_user_then_key] = rank_in_user  # the same users and counts, so the same offsets
            rows = rows[key_rank < self.max_examples_per_user]
        return rows.tolist()

    def _state_at(self, position: int) -> dict:
        return {**super()._state_at(position), "num_examples": self.num_examples,
                "max_examples_per_user": self.max_examples_per_user}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; a user sampler's state loads only into a sampler of the same dataset and
        ``max_examples_per_user``."""
        if state.get("privacy_unit") == "user":
            saved = (state.get("num_examples"), state.get("max_examples_per_user"))
            if saved != (self.num_examples, self.max_examples_per_user):
                raise ValueError(
                    f"This state was saved by a user sampler with (num_examples, max_examples_per_user) = {saved}, "
                    f"but this sampler has {(self.num_examples, self.max_examples_per_user)}; the saved batches "
                    "cannot be reproduced. Build the loader with the saved dataset and max_examples_per_user."
                )
        super().load_state_dict(state)


class _ExamplesWithUsers(Dataset):
    """The user's dataset, each item paired with its user id: what lets the collate build a :class:`UserBatch`.

    A user-level loader's ``dataset`` is this wrapper; the original is its ``dataset`` attribute.
    """

    def __init__(self, dataset: Dataset, users: torch.Tensor):
        self.dataset = dataset
        self.users = users.tolist()  # plain ints: cheap to index per item, cheap to send to workers

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.dataset[index], self.users[index]

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, int]]:
        fetch_many = getattr(self.dataset, "__getitems__", None)  # batched fetching (e.g. Hugging Face datasets)
        items = fetch_many(indices) if fetch_many else [self.dataset[i] for i in indices]
        return [(item, self.users[i]) for item, i in zip(items, indices)]


class UserBatch(NamedTuple):
    """A batch from ``poisson_loader(..., users=...)``: the collated examples and whose each row is.

    ``data``: the collated batch, as without ``users=`` (empty batches keep its structure).
    ``users``: ``torch.int64`` of shape ``[N]``, the user id of each of the N rows of ``data``;
    a user's rows are next to each other. Unpack it as ``for (x, y), users in loader`` and give
    both to the engine: ``engine.backward(per_example_losses, users=users)``.
    """

    data: Any
    users: torch.Tensor


class FixedShapeUserBatch(NamedTuple):
    """A fixed-shape user batch from ``poisson_loader(..., users=..., max_examples_per_user=m, max_batch_size=K)``.

    Exactly ``K * m`` rows: K *slots* of m rows. The drawn users come first, each in one slot: their
    rows, then zero rows up to m; the slots left empty follow, all zero rows. ``users`` (int64,
    ``[K * m]``): a user's slot carries their id on all m rows; each empty slot carries an id of its own,
    larger than every real user's. ``mask`` (bool, ``[K * m]``): True for the real rows. Give the engine
    ``engine.backward(masked_losses(losses, mask), users=users)``: padding rows then have loss 0 and
    contribute exactly 0, and a slot never straddles two physical batches of ``split_batches`` when
    the physical size is a multiple of m.
    """

    data: Any
    users: torch.Tensor
    mask: torch.Tensor


class _UserCollate:
    """Collate ``(item, user)`` pairs into a :class:`UserBatch`; one row per example, checked."""

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any):
        self.collate = _EmptyBatchCollate(collate_fn, example_item)

    def __call__(self, pairs: list[tuple[Any, int]]) -> UserBatch:
        data = self.collate([item for item, _ in pairs])
        if pairs and _batch_size(data) != len(pairs):
            raise ValueError(
                f"collate_fn made {_batch_size(data)} rows of {len(pairs)} examples: user-level batches need one "
                "row per example (each row's user is the example's); pack or merge examples in the dataset instead"
            )
        return UserBatch(data, torch.tensor([user for _, user in pairs], dtype=torch.int64))


class _FixedShapeUserCollate(_UserCollate):
    """Collate ``(item, user)`` pairs into a :class:`FixedShapeUserBatch` of ``slots`` users of ``rows_per_user``
    rows each; empty slots get the ids ``first_free_id, first_free_id + 1, ...``."""

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any, slots: int, rows_per_user: int,
                 first_free_id: int):
        super().__init__(collate_fn, example_item)
        self.slots, self.rows_per_user, self.first_free_id = slots, rows_per_user, first_free_id
        self.zero_row = _map_batch(collate_fn([example_item]), _zero_row)

    def __call__(self, pairs: list[tuple[Any, int]]) -> FixedShapeUserBatch:  # type: ignore[override]  # (its own batch)
        real = super().__call__(pairs)
        m, real_rows = self.rows_per_user, len(pairs)
        # Where each output row comes from: a real row's index, or real_rows (the zero row appended below).
        source, row_users = [], []
        for user, run in itertools.groupby(range(real_rows), key=lambda row: pairs[row][1]):
            rows = list(run)
            if len(rows) > m:
                raise RuntimeError(f"user {user} has {len(rows)} rows in a batch of a loader with "
                                   f"max_examples_per_user={m}")
            source += rows + [real_rows] * (m - len(rows))
            row_users += [user] * m
        drawn = len(row_users) // m
        if drawn > self.slots:  # the sampler truncates to K users: never reached from poisson_loader
            raise RuntimeError(f"{drawn} users reached a loader of max_batch_size={self.slots}")
        for slot in range(self.slots - drawn):
            source += [real_rows] * m
            row_users += [self.first_free_id + slot] * m
        index = torch.tensor(source, dtype=torch.int64)
        with_zero_row = _map_batch(real.data, lambda leaf, pad: _append_rows(leaf, pad, 1), self.zero_row)
        data = _map_batch(with_zero_row, lambda leaf: _gather_rows(leaf, index))
        return FixedShapeUserBatch(data, torch.tensor(row_users, dtype=torch.int64), index < real_rows)


def _gather_rows(leaf: Any, index: torch.Tensor) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf[index.to(leaf.device)]
    return type(leaf)(leaf[i] for i in index.tolist())
