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
* ``poisson_loader(..., cyclic_groups=g)`` samples *cyclically* (:mod:`dptrain.cyclic`): each unit in one of g
  fixed groups, step t samples group ``t mod g`` (what amplified banded matrix factorization needs).
"""

from __future__ import annotations

import collections

import itertools
import numbers
import os
from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import default_collate

from . import checks

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


def _secure_generator() -> torch.Generator:
    # A seed from the OS entropy pool, so the batches cannot be predicted from a seed
    # that leaked into logs or configs (63 bits: manual_seed's safe range; note that
    # PyTorch's CPU Mersenne Twister only keeps the low 32 bits of a seed).
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    return generator


class PoissonSampler(Sampler[list[int]]):
    """Batch sampler for Poisson sampling: yields lists of dataset indices.

    Each of the ``steps`` batches of an epoch includes every index in
    ``range(num_samples)`` independently with probability ``sample_rate``; batches can be
    empty. ``steps`` defaults to ``round(1 / sample_rate)``, one expected pass over the
    data. Randomness comes only from ``generator`` (default: a fresh generator seeded
    from ``os.urandom``), so a seeded generator makes the batches reproducible.

    With ``max_batch_size=K`` a draw of more than K indices keeps a uniformly random K of
    them (drawn from the same generator), so no batch has more than K indices; the
    loader pads them to exactly K rows (:func:`poisson_loader`).

    :meth:`state_dict` / :meth:`load_state_dict` save and restore the generator and the
    position in the epoch: a resumed run continues with exactly the batches the stopped
    run would have drawn.
    """

    #: What one Poisson trial includes or leaves out: an example here, a user in :class:`UserPoissonSampler`.
    privacy_unit = "example"

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        max_batch_size: int | None = None,
    ):
        self.num_samples = checks.positive_int("num_samples", num_samples)
        self.sample_rate = checks.sample_rate(sample_rate)
        self.max_batch_size = (
            None if max_batch_size is None else checks.positive_int(
                "max_batch_size", max_batch_size, "the fixed number of rows of every batch, K")
        )
        self.steps = (
            max(1, round(1.0 / self.sample_rate))
            if steps is None
            else checks.positive_int("steps", steps)
        )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}")
        self.generator = _secure_generator() if generator is None else generator
        # Generator state at the start of the current epoch and batches drawn since: the
        # checkpoint. (Replaying from the epoch start, rather than saving the state after
        # the last drawn batch, stays exact when a DataLoader prefetches batches.)
        self._epoch_start_state: torch.Tensor | None = None
        self._position = 0
        self._resume_pending = False

    def __len__(self) -> int:
        return self.steps

    def _draw(self) -> list[int]:
        mask = torch.rand(
            self.num_samples, generator=self.generator, device=self.generator.device
        ) < self.sample_rate
        return self._truncate(mask.nonzero().flatten()).tolist()

    def _truncate(self, drawn: torch.Tensor) -> torch.Tensor:
        """At most ``max_batch_size`` of the drawn indices: a uniformly random subset, in order."""
        if self.max_batch_size is None or len(drawn) <= self.max_batch_size:
            return drawn
        keep = torch.randperm(len(drawn), generator=self.generator, device=self.generator.device)
        return drawn[keep[: self.max_batch_size].sort().values.to(drawn.device)]

    def __iter__(self) -> Iterator[list[int]]:
        if self._resume_pending:
            self._resume_pending = False
            self.generator.set_state(self._epoch_start_state)
            for _ in range(self._position):
                self._draw()  # replay the batches the stopped run already used
        else:
            self._epoch_start_state = self.generator.get_state()
            self._position = 0
        while self._position < self.steps:
            batch = self._draw()
            self._position += 1
            yield batch

    def _state_at(self, position: int) -> dict:
        if position >= self.steps or self._epoch_start_state is None:
            # Between epochs: the next epoch starts from the current generator state.
            generator_state, position = self.generator.get_state(), 0
        else:
            generator_state = self._epoch_start_state.clone()
        return {
            "privacy_unit": self.privacy_unit,
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "max_batch_size": self.max_batch_size,
            "generator_state": generator_state,
            "position": position,
        }

    def state_dict(self) -> dict:
        """Generator state and position in the epoch, counting batches drawn so far."""
        return self._state_at(self._position)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next ``iter()`` resumes the saved epoch."""
        missing = {"num_samples", "sample_rate", "steps", "generator_state", "position"} - set(state)
        if missing:
            raise ValueError(
                f"Not a PoissonSampler state: missing {sorted(missing)}; pass the dict "
                "returned by PoissonSampler.state_dict() (or DPDataLoader.state_dict())."
            )
        saved_unit = state.get("privacy_unit", "example")  # absent: saved before user-level sampling existed
        if saved_unit != self.privacy_unit:
            raise ValueError(
                f"This state was saved by a sampler of {saved_unit}s, but this one samples {self.privacy_unit}s; "
                "the saved batches cannot be reproduced. Build the loader as the saved run did "
                "(poisson_loader(..., users=...) for user-level sampling, without users= for examples)."
            )
        self._check_shard(state)
        saved = (state["num_samples"], state["sample_rate"], state["steps"])
        if saved != (self.num_samples, self.sample_rate, self.steps):
            raise ValueError(
                f"This state was saved by a sampler with (num_samples, sample_rate, steps) = "
                f"{saved}, but this sampler has {(self.num_samples, self.sample_rate, self.steps)}; "
                "the saved batches cannot be reproduced. Build the sampler with the saved "
                "settings."
            )
        if state.get("max_batch_size") != self.max_batch_size:  # absent: saved before truncation existed
            raise ValueError(
                f"This state was saved by a sampler with max_batch_size={state.get('max_batch_size')!r}, but "
                f"this sampler has max_batch_size={self.max_batch_size!r}; the saved batches cannot be "
                "reproduced. Build the loader with the saved max_batch_size."
            )
        position = checks.index("position", state["position"], self.steps, "steps")
        self._epoch_start_state = state["generator_state"].clone()
        self._position = position
        self._resume_pending = True

    def _check_shard(self, state: dict) -> None:
        if state.get("num_replicas", 1) != 1:
            raise ValueError(
                f"This state was saved by a DistributedPoissonSampler (rank {state.get('rank')!r} "
                f"of {state['num_replicas']}), which samples one shard of the dataset; load it "
                "into the loader of the same rank (poisson_loader(..., distributed=True))."
            )


# --------------------------------------------------------------- user-level sampling


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
        self.max_examples_per_user = None if max_examples_per_user is None else checks.positive_int(
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

    def __call__(self, pairs: list[tuple[Any, int]]) -> FixedShapeUserBatch:
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


# ------------------------------------------------------------ data-parallel sampling


def _distributed_default(value: Any, what: str) -> int:
    """``value``, or the world size / rank of the initialised default process group."""
    if value is not None:
        return value
    import torch.distributed as dist  # local: only needed on this path

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"distributed Poisson sampling needs {what}: pass it explicitly, or initialise "
            "torch.distributed (torch.distributed.init_process_group) before building the "
            "loader so it defaults to the process group's "
            + ("world size." if what == "num_replicas" else "rank.")
        )
    return dist.get_world_size() if what == "num_replicas" else dist.get_rank()


def _fmix32(value: int) -> int:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) that scrambles its bits."""
    value &= 0xFFFFFFFF
    value ^= value >> 16
    value = (value * 0x85EBCA6B) & 0xFFFFFFFF
    value ^= value >> 13
    value = (value * 0xC2B2AE35) & 0xFFFFFFFF
    value ^= value >> 16
    return value


def _rank_seed(base: int, rank: int, num_replicas: int) -> int:
    """Seed of rank ``rank``'s generator: ``fmix32(rank + W * (base mod floor(2^32 / W)))``.

    ``rank + W * x`` is congruent to ``rank`` modulo ``W``, so two ranks never get the same
    seed, whatever their ``base`` (shared or not); ``fmix32`` is a bijection, so that
    stays true after it scrambles the bits. 32 bits because PyTorch's CPU generator keeps
    only the low 32 bits of a seed.
    """
    return _fmix32(rank + num_replicas * (base % (2**32 // num_replicas)))


def _rank_generator(
    generator: torch.Generator | None, rank: int, num_replicas: int
) -> torch.Generator:
    if generator is None:
        base, device = int.from_bytes(os.urandom(4), "little"), torch.device("cpu")
    else:
        device = generator.device
        base = int(torch.randint(0, 2**32, (1,), generator=generator, device=device).item())
    derived = torch.Generator(device=device)
    derived.manual_seed(_rank_seed(base, rank, num_replicas))
    return derived


class DistributedPoissonSampler(PoissonSampler):
    """Poisson sampling for one rank of data-parallel training (DDP, FSDP, ...).

    The dataset's ``num_samples`` indices are split into ``num_replicas`` disjoint shards
    like ``DistributedSampler`` does, but without padding (Poisson sampling must never
    include an example twice): rank ``r`` owns ``r, r + W, r + 2W, ...`` (``W =
    num_replicas``). Each of the ``steps`` batches includes every index of the shard
    independently with probability ``sample_rate``, the *global* rate q, so the union of
    all ranks' batches at a step is a Poisson sample of the whole dataset with rate q:
    the q the accountant uses, with global expected batch size ``q * num_samples``.
    ``steps`` defaults to ``round(1 / q)`` on every rank, so all ranks run the same number
    of steps (collective operations would otherwise deadlock); a rank's batch can be
    empty while others are not.

    ``num_replicas`` and ``rank`` default to the world size and rank of the initialised
    default ``torch.distributed`` process group; pass the data-parallel group's size and
    rank when not every process is a data-parallel replica (e.g. tensor parallelism).

    Randomness: every rank draws from its own generator, whose seed is distinct from every
    other rank's (see below), so inclusions are independent across ranks. With
    ``generator=None`` the seed comes from ``os.urandom``. With a ``generator`` (e.g.
    ``torch.Generator().manual_seed(s)``, the same ``s`` on every rank), one number ``b``
    is drawn from it (``torch.randint(0, 2**32, (1,), generator=generator)``, which
    advances it) and rank ``r`` uses a fresh generator on ``generator.device`` seeded with
    ``fmix32(r + W * (b mod floor(2**32 / W)))`` (``fmix32``: MurmurHash3's 32-bit
    finaliser, a bijection). This is deterministic in ``(b, r, W)`` and gives distinct
    seeds to distinct ranks. :attr:`generator` is that per-rank generator.

    :meth:`state_dict` / :meth:`load_state_dict` checkpoint each rank separately; a state
    loads only into the sampler of the same rank and ``num_replicas``.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        num_replicas: int | None = None,
        rank: int | None = None,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ):
        num_samples = checks.positive_int("num_samples", num_samples)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}")
        num_replicas = _distributed_default(num_replicas, "num_replicas")
        rank = _distributed_default(rank, "rank")
        self.num_replicas = checks.positive_int("num_replicas", num_replicas)
        if self.num_replicas > num_samples:
            raise ValueError(
                f"num_replicas={self.num_replicas} exceeds the dataset size {num_samples}: "
                "every rank needs at least one example of its own to sample."
            )
        self.rank = checks.index("rank", rank, self.num_replicas, "num_replicas")
        # Validate sample_rate / steps before drawing from the caller's generator.
        PoissonSampler.__init__(self, num_samples, sample_rate, steps=steps, generator=None)
        self.generator = _rank_generator(generator, self.rank, self.num_replicas)
        #: Number of indices in this rank's shard, ``len(range(rank, num_samples, W))``.
        self.shard_size = len(range(self.rank, self.num_samples, self.num_replicas))

    @property
    def indices(self) -> range:
        """This rank's shard of dataset indices: ``range(rank, num_samples, num_replicas)``."""
        return range(self.rank, self.num_samples, self.num_replicas)

    def _draw(self) -> list[int]:
        mask = torch.rand(
            self.shard_size, generator=self.generator, device=self.generator.device
        ) < self.sample_rate
        return (mask.nonzero().flatten() * self.num_replicas + self.rank).tolist()

    def _state_at(self, position: int) -> dict:
        return {**super()._state_at(position), "num_replicas": self.num_replicas, "rank": self.rank}

    def _check_shard(self, state: dict) -> None:
        if "num_replicas" not in state or "rank" not in state:
            raise ValueError(
                "This state was saved by a non-distributed PoissonSampler (it has no "
                "num_replicas / rank); a DistributedPoissonSampler only loads the state "
                "saved by the same rank."
            )
        saved = (state["num_replicas"], state["rank"])
        if saved != (self.num_replicas, self.rank):
            raise ValueError(
                f"This state was saved by rank {saved[1]} of num_replicas={saved[0]}, but this "
                f"sampler is rank {self.rank} of num_replicas={self.num_replicas}: each rank "
                "must load its own checkpoint (loading another rank's would make two ranks "
                "draw the same batches)."
            )


class DistributedUserPoissonSampler(UserPoissonSampler):
    """User-level Poisson sampling for one rank of data-parallel training: ranks own disjoint sets of *users*.

    The distinct users, in increasing id order, are dealt to the ``num_replicas`` ranks like the
    examples of :class:`DistributedPoissonSampler`: rank ``r`` owns users ``r, r + W, r + 2W, ...``
    (positions in :attr:`user_ids`) and *all of their examples*, so a user's rows of a step are
    always on one rank, in one backward there. Each rank includes each of its users independently
    with the global rate q, so the union of the ranks' batches is a user-level Poisson sample of all
    users (expected ``q * num_users`` users: the global divisor). Steps, generators (one per rank,
    derived from ``generator`` and the rank), ``max_examples_per_user`` and checkpoints (a state
    loads only into the same rank of the same ``num_replicas``) are as in the samplers it combines.
    """

    def __init__(
        self,
        users: Any,
        sample_rate: float,
        num_replicas: int | None = None,
        rank: int | None = None,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        max_examples_per_user: int | None = None,
    ):
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}")
        # Everything checked before drawing from the caller's generator.
        UserPoissonSampler.__init__(self, users, sample_rate, steps=steps, generator=None,
                                    max_examples_per_user=max_examples_per_user)
        self.num_replicas = checks.positive_int("num_replicas", _distributed_default(num_replicas, "num_replicas"))
        if self.num_replicas > self.num_users:
            raise ValueError(
                f"num_replicas={self.num_replicas} exceeds the number of users {self.num_users}: every rank needs "
                "at least one user of its own to sample."
            )
        self.rank = checks.index("rank", _distributed_default(rank, "rank"), self.num_replicas, "num_replicas")
        self.generator = _rank_generator(generator, self.rank, self.num_replicas)
        self.own_users = torch.arange(self.rank, self.num_users, self.num_replicas)  # this rank's users

    def _state_at(self, position: int) -> dict:
        return {**super()._state_at(position), "num_replicas": self.num_replicas, "rank": self.rank}

    _check_shard = DistributedPoissonSampler._check_shard


# ------------------------------------------------------------------ batch structure
# A batch is a tensor, or a Mapping / tuple / list nesting of batches, or a per-sample
# list or tuple of plain values (what default_collate makes of strings: a list in a dict,
# a tuple in a tuple of fields).

_PLAIN_VALUES = (str, bytes, numbers.Number, type(None))


def batch_len(batch: Any) -> int | None:
    """The number of samples in a batch, read leniently: the length along dim 0 of its first tensor that has a
    dim 0 (in dicts, tuples and lists, depth first); None if it holds none. ``_batch_size`` is the strict reading."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    return next((n for n in map(batch_len, values) if n is not None), None)


def _is_per_sample_list(batch: Any) -> bool:
    return (
        isinstance(batch, (list, tuple))
        and not hasattr(batch, "_fields")
        and all(isinstance(item, _PLAIN_VALUES) for item in batch)
    )


def _map_batch(batch: Any, fn: Callable[..., Any], *others: Any) -> Any:
    """Apply ``fn`` to every per-sample leaf (tensor or per-sample list) of a batch.

    With ``others`` (batches of the same structure), ``fn`` gets the leaf and theirs.
    """
    if isinstance(batch, torch.Tensor) or _is_per_sample_list(batch):
        return fn(batch, *others)
    if isinstance(batch, Mapping):
        mapped = {key: _map_batch(value, fn, *(o[key] for o in others)) for key, value in batch.items()}
        try:
            return type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_batch(value, fn, *rest) for value, *rest in zip(batch, *others)))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_batch(value, fn, *rest) for value, *rest in zip(batch, *others))
    raise TypeError(
        f"Cannot split a batch element of type {type(batch).__name__}: batches must be "
        "tensors, or dicts / tuples / lists of tensors (lists of strings are also fine)."
    )


def _batch_size(batch: Any) -> int:
    sizes: set[int] = set()

    def record(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0:
            raise ValueError(
                "A batch contains a 0-dimensional tensor, which has no batch dimension to "
                "split; every tensor in a batch must have the samples along dim 0."
            )
        sizes.add(len(leaf))
        return leaf

    _map_batch(batch, record)
    if len(sizes) != 1:
        raise ValueError(
            f"Inconsistent batch: its tensors / lists have sizes {sorted(sizes)} along dim 0; "
            "every element of a batch must have one entry per sample along dim 0."
            if sizes
            else "The batch contains no tensors, so its number of samples is unknown."
        )
    return sizes.pop()


def _empty_like_batch(batch: Any) -> Any:
    return _map_batch(batch, lambda leaf: leaf[:0])


class _EmptyBatchCollate:
    """Collate function that also handles empty batches.

    ``default_collate([])`` fails, and a user's collate function rarely expects an empty
    list. The empty batch is instead made from the collated first dataset item, sliced
    to 0 samples: the same structure, dtypes and trailing shapes as a real batch.
    """

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any):
        self.collate_fn = collate_fn
        try:
            self.empty_batch = _empty_like_batch(collate_fn([example_item]))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"Cannot build the empty batch for Poisson sampling from dataset[0] ({error}). "
                "Collated batches must be tensors, or dicts / tuples / lists of tensors."
            ) from error

    def __call__(self, items: list) -> Any:
        if len(items) == 0:
            return _empty_like_batch(self.empty_batch)  # fresh views: nothing shared
        return self.collate_fn(items)


class FixedShapeBatch(NamedTuple):
    """A fixed-shape batch from ``poisson_loader(..., max_batch_size=K)``.

    ``data``: the collated batch (same structure as without ``max_batch_size``), every
    tensor with exactly K rows along dim 0 (per-sample lists: K entries). The first
    ``n`` rows are the real examples (``n = int(mask.sum())``, at most K), the rest are
    padding: zeros (``""`` / ``0`` in per-sample lists). ``mask``: ``torch.bool`` of shape
    ``[K]``, True for real rows.

    Unpack it as ``for (x, y), mask in loader`` (or ``batch.data`` / ``batch.mask``) and
    give the engine the mask, ``engine.backward(losses, mask=mask)``: a padded row's loss
    then counts as 0, its per-sample gradient 0 and its clipped contribution exactly 0,
    while its unmasked loss still shows the engine where its rows are, so each layer's
    layout is read once and cached. (``engine.backward(masked_losses(losses, mask))`` is
    exact too, but a padded row without a gradient hides its layout: it is read at every
    step.) Padded rows are never counted as samples: the engine divides the noisy sum
    by the *expected* batch size, ``q * len(dataset)``, not by a number of rows. (For a
    plain ``loss.backward()`` with ``loss_reduction="mean"``, take the mean over all K
    rows, ``masked_losses(losses, mask).mean()``, not over the real ones.)
    """

    data: Any
    mask: torch.Tensor


def masked_losses(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``losses`` with the rows of padding (``mask`` False) set to exactly 0.

    ``losses``: per-sample losses ``[K]`` or ``[K, ...]``; ``mask``: the batch's boolean
    ``[K]`` mask (:class:`FixedShapeBatch`). Unlike ``losses * mask``, a non-finite loss
    on a padded row (zero inputs can give one) becomes 0 too.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        raise ValueError(
            "mask must be the boolean [K] mask of a FixedShapeBatch (True for real rows), got "
            + (f"a {mask.dtype} tensor of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor)
               else type(mask).__name__)
        )
    if not isinstance(losses, torch.Tensor) or losses.dim() == 0 or losses.shape[0] != mask.shape[0]:
        shape = list(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"losses must be per-sample losses with one row per row of the batch ({mask.shape[0]}), got {shape}; "
            "use reduction='none'"
        )
    keep = mask.to(losses.device).view(-1, *([1] * (losses.dim() - 1)))
    return torch.where(keep, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))


def _zero_value(value: Any) -> Any:
    """The padding entry of a per-sample list: an empty string, a zero number, None."""
    if value is None:
        return None
    try:
        return type(value)()
    except TypeError:
        return 0


def _zero_row(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return torch.zeros_like(leaf[:1])
    return [_zero_value(leaf[0])]


def _append_rows(leaf: Any, pad: Any, count: int) -> Any:
    if count == 0:
        return leaf
    if isinstance(leaf, torch.Tensor):
        if leaf.shape[1:] != pad.shape[1:] or leaf.dtype != pad.dtype:
            raise ValueError(
                f"fixed-shape batches need every example to collate to the same shapes: a batch tensor of "
                f"{leaf.dtype} with trailing shape {list(leaf.shape[1:])} differs from dataset[0]'s "
                f"({pad.dtype}, {list(pad.shape[1:])}); pad or crop the examples to one shape in the dataset"
            )
        return torch.cat([leaf, pad.to(leaf.device).expand(count, *pad.shape[1:])])
    return type(leaf)(list(leaf) + list(pad) * count)


class _FixedShapeCollate(_EmptyBatchCollate):
    """Collate to a :class:`FixedShapeBatch` of exactly ``max_batch_size`` rows: the real
    rows first, then zero rows (made from the collated ``dataset[0]``)."""

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any, max_batch_size: int):
        super().__init__(collate_fn, example_item)
        self.max_batch_size = max_batch_size
        self.zero_row = _map_batch(collate_fn([example_item]), _zero_row)

    def __call__(self, items: list) -> FixedShapeBatch:
        real, rows = len(items), self.max_batch_size
        if real > rows:
            raise RuntimeError(f"a batch of {real} examples reached a loader of max_batch_size={rows}")
        batch = super().__call__(items)
        collated = _batch_size(batch)
        if collated != real:
            raise ValueError(
                f"collate_fn made {collated} rows of {real} examples: fixed-shape batches need one row per example"
            )
        data = _map_batch(batch, lambda leaf, pad: _append_rows(leaf, pad, rows - real), self.zero_row)
        return FixedShapeBatch(data, torch.arange(rows) < real)


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
    """

    def __init__(self, dataset: Dataset, sampler: PoissonSampler, **kwargs: Any):
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self.sample_rate = sampler.sample_rate
        #: g of cyclic Poisson sampling (dptrain.cyclic; 1: plain Poisson sampling): q is then the rate within a group
        self.cyclic_groups = getattr(sampler, "cyclic_groups", 1)
        self.expected_batch_size = sampler.sample_rate * sampler.num_samples / self.cyclic_groups
        #: with cyclic groups, the run's step number of the last batch handed out (None before the first)
        self.last_batch_step: int | None = None
        self.max_batch_size = sampler.max_batch_size
        self.privacy_unit = sampler.privacy_unit
        self.num_users = getattr(sampler, "num_users", None)
        self.max_examples_per_user = getattr(sampler, "max_examples_per_user", None)
        self._consumed: int | None = None  # batches handed out in the current epoch
        # rows of the last two batches handed out (two: a loop may fetch the next batch before the last backward)
        self._recent_rows: collections.deque[int] = collections.deque(maxlen=2)

    @property
    def poisson_sampler(self) -> PoissonSampler:
        return self.batch_sampler

    def __iter__(self) -> Iterator[Any]:
        sampler = self.poisson_sampler
        self._consumed = sampler._position if sampler._resume_pending else 0
        for batch in super().__iter__():
            self._consumed += 1
            self._recent_rows.append(batch_len(batch) or 0)
            if self.cyclic_groups > 1:
                self.last_batch_step = sampler.step_of(self._consumed - 1)
            yield batch
        self._consumed = None

    @property
    def recent_batch_rows(self) -> int | None:
        """The most rows of the last two batches handed out (None before the first): a backward over more rows
        than that treats rows as samples that are not (``torch.cat([x, x_augmented])``)."""
        return max(self._recent_rows) if self._recent_rows else None

    def state_dict(self) -> dict:
        """Sampler checkpoint counting the batches *consumed*, not prefetched by workers."""
        sampler = self.poisson_sampler
        if self._consumed is None or sampler._resume_pending:
            return sampler.state_dict()
        return sampler._state_at(self._consumed)

    def load_state_dict(self, state: dict) -> None:
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

    ``cyclic_groups=g`` makes the sampling *cyclic* (:mod:`dptrain.cyclic`, what amplified banded matrix
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
    groups = 1 if cyclic_groups is None else checks.positive_int("cyclic_groups", cyclic_groups,
                                                                "the number of cyclic groups, g")
    if batch_size is not None:
        batch_size = checks.positive_int("batch_size", batch_size)
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
    if not isinstance(distributed, bool):
        raise ValueError(f"distributed must be True or False, got {distributed!r}")
    if max_batch_size is not None:
        max_batch_size = checks.positive_int("max_batch_size", max_batch_size,
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
        if max_batch_size is None:
            collate = _UserCollate(collate_fn or default_collate, dataset[0])
        else:
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
    """The sampler of ``poisson_loader(..., cyclic_groups=groups)`` (``dptrain.cyclic``)."""
    from . import cyclic  # it builds on the samplers of this module

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


def _split_user_batch(batch: UserBatch | FixedShapeUserBatch, max_physical_batch_size: int) -> list[Any]:
    """Physical batches of at most ``max_physical_batch_size`` rows that never cut a user's rows apart
    (the engine clips a user's summed gradient, so all of a user's rows go to one backward)."""
    users = batch.users
    if len(users) == 0:
        return [batch]
    run_starts = torch.cat([torch.tensor([True]), users[1:] != users[:-1]]).nonzero().flatten().tolist()
    if len(run_starts) != len(torch.unique(users)):
        raise ValueError(
            "a UserBatch's rows of one user are not next to each other, so it cannot be cut into physical batches "
            "without splitting a user; keep each user's rows together (poisson_loader(..., users=...) does)"
        )
    run_ends = run_starts[1:] + [len(users)]
    longest = max(end - start for start, end in zip(run_starts, run_ends))
    if longest > max_physical_batch_size:
        raise ValueError(
            f"a user has {longest} rows in this batch, more than max_physical_batch_size={max_physical_batch_size}, "
            "and a user's rows cannot be split across physical batches; raise max_physical_batch_size or build "
            f"the loader with max_examples_per_user <= {max_physical_batch_size}"
        )
    cuts, start = [], 0  # greedy: fill a physical batch with whole users
    for run_start, run_end in zip(run_starts, run_ends):
        if run_end - start > max_physical_batch_size:
            cuts.append((start, run_start))
            start = run_start
    cuts.append((start, len(users)))
    # Every field after data (users, and mask for fixed shapes) is a [N] tensor, cut like the data.
    return [
        type(batch)(_map_batch(batch.data, lambda leaf, a=a, b=b: leaf[a:b]), *(rows[a:b] for rows in batch[1:]))
        for a, b in cuts
    ]


def _split_batch(batch: Any, max_physical_batch_size: int) -> list[Any]:
    if isinstance(batch, (UserBatch, FixedShapeUserBatch)):
        return _split_user_batch(batch, max_physical_batch_size)
    size = _batch_size(batch)
    if size == 0:
        return [batch]  # one empty physical batch, so the step still happens
    return [
        _map_batch(batch, lambda leaf, start=start: leaf[start : start + max_physical_batch_size])
        for start in range(0, size, max_physical_batch_size)
    ]


def split_batches(loader: Any, max_physical_batch_size: int) -> Iterator[list[Any]]:
    """Yield each logical batch of ``loader`` as a list of physical batches.

    Every tensor of a batch (also inside dicts, tuples and lists) is cut along dim 0
    into views of at most ``max_physical_batch_size`` samples. An empty logical batch
    gives exactly one empty physical batch. Step the optimizer once per logical batch::

        for logical in split_batches(loader, 64):
            for x, y in logical:
                engine.backward(F.cross_entropy(model(x), y, reduction="none"))
            optimizer.step()
            optimizer.zero_grad()

    A :class:`UserBatch` (user-level sampling) is cut only between users: each physical batch is
    a ``UserBatch`` of whole users, at most ``max_physical_batch_size`` rows, so that
    ``engine.backward(losses, users=users)`` sees all of a user's rows at once. Its
    ``max_examples_per_user`` must not exceed ``max_physical_batch_size``. A
    :class:`FixedShapeUserBatch` is cut between slots the same way, with its mask; a physical size
    that is a multiple of m and divides K * m gives physical batches of one shape.
    """
    # Checked here, not inside a generator, so a bad value fails at the call site.
    max_physical_batch_size = checks.positive_int("max_physical_batch_size", max_physical_batch_size)
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, UserPoissonSampler) and sampler.max_rows_per_user > max_physical_batch_size:
        raise ValueError(
            f"the loader can put {sampler.max_rows_per_user} rows of one user in a batch (max_examples_per_user="
            f"{sampler.max_examples_per_user}), more than max_physical_batch_size={max_physical_batch_size}, and a "
            "user's rows cannot be split across physical batches; build the loader with max_examples_per_user <= "
            f"{max_physical_batch_size}"
        )
    return (_split_batch(batch, max_physical_batch_size) for batch in loader)
