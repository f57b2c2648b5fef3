"""Poisson sampling for one rank of data-parallel training: each rank its own shard (of examples, or of users).

:class:`DistributedPoissonSampler` and :class:`DistributedUserPoissonSampler` sample their rank's shard with the
global rate q; every rank draws from its own generator, seeded distinctly from the caller's (``_rank_seed``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import _checks
from .poisson import PoissonSampler
from .users import UserPoissonSampler


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
        num_samples = _checks.positive_int("num_samples", num_samples)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}")
        num_replicas = _distributed_default(num_replicas, "num_replicas")
        rank = _distributed_default(rank, "rank")
        self.num_replicas = _checks.positive_int("num_replicas", num_replicas)
        if self.num_replicas > num_samples:
            raise ValueError(
                f"num_replicas={self.num_replicas} exceeds the dataset size {num_samples}: "
                "every rank needs at least one example of its own to sample."
            )
        self.rank = _checks.index("rank", rank, self.num_replicas, "num_replicas")
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
        self.num_replicas = _checks.positive_int("num_replicas", _distributed_default(num_replicas, "num_replicas"))
        if self.num_replicas > self.num_users:
            raise ValueError(
                f"num_replicas={self.num_replicas} exceeds the number of users {self.num_users}: every rank needs "
                "at least one user of its own to sample."
            )
        self.rank = _checks.index("rank", _distributed_default(rank, "rank"), self.num_replicas, "num_replicas")
        self.generator = _rank_generator(generator, self.rank, self.num_replicas)
        self.own_users = torch.arange(self.rank, self.num_users, self.num_replicas)  # this rank's users

    def _state_at(self, position: int) -> dict:
        return {**super()._state_at(position), "num_replicas": self.num_replicas, "rank": self.rank}

    _check_shard = DistributedPoissonSampler._check_shard
