"""Cyclic Poisson sampling (b-min-separation): the units split into ``g`` groups, step ``t`` samples group ``t mod g``.

Amplified banded matrix factorization (Choquette-Choo et al. 2023, Algorithm 2) needs every unit's steps to be
at least ``b`` apart: each unit (example, or user) is assigned once, for the whole run, to one of ``g >= b``
groups, independently and uniformly at random (jax_privacy's ``PartitionType.INDEPENDENT``, the assignment that
suits the add/remove neighbouring relation: a unit's presence changes nobody else's group), and step ``t``
includes each unit of group ``t mod g`` independently with probability ``q``. Expected batch size: ``q N / g``.

The samplers here are the Poisson samplers of :mod:`dptrain.data` with that restriction; batches, fixed shapes
(``max_batch_size``), user-level units and data-parallel shards work as there. They count the run's steps
across epochs (an epoch of ``round(g / q)`` steps need not be a multiple of ``g``) and checkpoint the count and
the group assignment with the generator, so a resumed run keeps every unit in its group.
:func:`dptrain.data.poisson_loader` builds them for ``cyclic_groups=g``.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .. import _checks
from .distributed import DistributedPoissonSampler, DistributedUserPoissonSampler
from .poisson import PoissonSampler
from .users import UserPoissonSampler, _user_ids

__all__ = [
    "CyclicDistributedPoissonSampler",
    "CyclicDistributedUserPoissonSampler",
    "CyclicPoissonSampler",
    "CyclicUserPoissonSampler",
    "cyclic_groups_of",
    "default_cyclic_steps",
]


def default_cyclic_steps(sample_rate: float, groups: int) -> int:
    """Steps of one epoch, one expected pass over the units: ``round(g / q)``."""
    return max(1, round(groups / sample_rate))


def cyclic_groups_of(loader: Any) -> int:
    """The number of cyclic groups a loader samples with (1: plain Poisson sampling)."""
    return getattr(getattr(loader, "batch_sampler", None), "cyclic_groups", 1)


class _CyclicGroups(PoissonSampler):
    """What the cyclic samplers add to a Poisson sampler: the groups, and which one each draw samples.

    ``_draws`` counts the run's draws (the next draw samples group ``_draws mod g``); ``_epoch_first_draw`` is
    the count at the current epoch's start, where a resumed epoch replays from.
    """

    cyclic_groups: int
    group_of: torch.Tensor

    def _init_groups(self, groups: int, units: int, sample_rate: float, steps: int | None) -> int | None:
        self.cyclic_groups = _checks.positive_int("cyclic_groups", groups, "the number of cyclic groups, g")
        if self.cyclic_groups > units:
            raise ValueError(f"cyclic_groups={self.cyclic_groups} exceeds the {units} units to sample: every group "
                             "needs some")
        self._draws = 0
        self._epoch_first_draw = 0
        return default_cyclic_steps(sample_rate, self.cyclic_groups) if steps is None else steps

    def _assign(self, units: int) -> None:
        """Each unit's group, uniform and independent, drawn once from the sampler's generator."""
        gen = self.generator
        self.group_of = torch.randint(self.cyclic_groups, (units,), generator=gen, device=gen.device).cpu()

    def _next_group(self) -> int:
        group = self._draws % self.cyclic_groups
        self._draws += 1
        return group

    def step_of(self, position: int) -> int:
        """The run's step number of batch ``position`` (0-based) of the current epoch."""
        return self._epoch_first_draw + position

    def __iter__(self) -> Iterator[list[int]]:
        # a resumed epoch replays its drawn batches from the epoch's start; a new epoch starts at the next draw
        if self._resume_pending:
            self._draws = self._epoch_first_draw
        else:
            self._epoch_first_draw = self._draws
        yield from super().__iter__()

    def _state_at(self, position: int) -> dict:
        state = super()._state_at(position)
        within = position < self.steps and self._epoch_start_state is not None
        return {**state, "cyclic_groups": self.cyclic_groups, "group_of": self.group_of.clone(),
                "first_draw": self._epoch_first_draw if within else self._draws}

    def load_state_dict(self, state: dict) -> None:
        if "group_of" not in state:
            raise ValueError(f"This state was saved by a plain Poisson sampler; a {type(self).__name__} "
                             "(cyclic_groups) only loads the state of a cyclic one")
        saved = state.get("cyclic_groups", 1)
        if saved != self.cyclic_groups:
            raise ValueError(
                f"This state was saved by a sampler with cyclic_groups={saved}, but this sampler has cyclic_groups="
                f"{self.cyclic_groups}; the saved batches cannot be reproduced. Build the loader with the saved "
                "cyclic_groups.")
        if state["group_of"].shape != self.group_of.shape:
            raise ValueError("This state's group assignment is for another number of units; build the loader over "
                             "the saved dataset")
        super().load_state_dict(state)
        # the saved assignment, not this sampler's: a unit moved to another group could be sampled twice within g
        # steps (a fresh assignment comes from a fresh generator when the loader is built without a seed)
        self.group_of = state["group_of"].clone()
        self._epoch_first_draw = self._draws = int(state["first_draw"])


class CyclicPoissonSampler(_CyclicGroups, PoissonSampler):
    """Cyclic Poisson sampling of examples: group ``t mod g`` at step ``t``, each of its examples with
    probability ``sample_rate``. ``steps`` (per epoch) defaults to ``round(g / q)``."""

    def __init__(self, num_samples: int, sample_rate: float, cyclic_groups: int, steps: int | None = None,
                 generator: torch.Generator | None = None, max_batch_size: int | None = None):
        steps = self._init_groups(cyclic_groups, _checks.positive_int("num_samples", num_samples),
                                  _checks.sample_rate(sample_rate), steps)
        PoissonSampler.__init__(self, num_samples, sample_rate, steps=steps, generator=generator,
                                max_batch_size=max_batch_size)
        self._assign(self.num_samples)

    def _draw(self) -> list[int]:
        group = self._next_group()
        drawn = torch.rand(self.num_samples, generator=self.generator, device=self.generator.device)
        mask = (drawn < self.sample_rate).cpu() & (self.group_of == group)
        return self._truncate(mask.nonzero().flatten()).tolist()


class CyclicUserPoissonSampler(_CyclicGroups, UserPoissonSampler):
    """Cyclic Poisson sampling of users: group ``t mod g`` at step ``t``, each of its users with probability
    ``sample_rate``, with up to ``max_examples_per_user`` of their examples (:class:`UserPoissonSampler`)."""

    def __init__(self, users: Any, sample_rate: float, cyclic_groups: int, steps: int | None = None,
                 generator: torch.Generator | None = None, max_examples_per_user: int | None = None,
                 max_batch_size: int | None = None):
        units = len(torch.unique(_user_ids(users)))
        steps = self._init_groups(cyclic_groups, units, _checks.sample_rate(sample_rate), steps)
        UserPoissonSampler.__init__(self, users, sample_rate, steps=steps, generator=generator,
                                    max_examples_per_user=max_examples_per_user, max_batch_size=max_batch_size)
        self._assign(self.num_users)

    def _included_users(self) -> torch.Tensor:
        group = self._next_group()
        drawn = torch.rand(len(self.own_users), generator=self.generator, device=self.generator.device)
        keep = (drawn < self.sample_rate).cpu() & (self.group_of[self.own_users] == group)
        return self._truncate(self.own_users[keep])


class CyclicDistributedPoissonSampler(_CyclicGroups, DistributedPoissonSampler):
    """Cyclic Poisson sampling of one rank's shard: each rank assigns its own examples to groups (independent
    and uniform, so the assignment of the whole dataset is too) and samples group ``t mod g`` of its shard at
    step ``t``; every rank counts the same steps."""

    def __init__(self, num_samples: int, sample_rate: float, cyclic_groups: int, num_replicas: int | None = None,
                 rank: int | None = None, steps: int | None = None, generator: torch.Generator | None = None):
        steps = self._init_groups(cyclic_groups, _checks.positive_int("num_samples", num_samples),
                                  _checks.sample_rate(sample_rate), steps)
        DistributedPoissonSampler.__init__(self, num_samples, sample_rate, num_replicas, rank, steps=steps,
                                           generator=generator)
        self._assign(self.shard_size)

    def _draw(self) -> list[int]:
        group = self._next_group()
        drawn = torch.rand(self.shard_size, generator=self.generator, device=self.generator.device)
        mask = (drawn < self.sample_rate).cpu() & (self.group_of == group)
        return (mask.nonzero().flatten() * self.num_replicas + self.rank).tolist()


class CyclicDistributedUserPoissonSampler(_CyclicGroups, DistributedUserPoissonSampler):
    """Cyclic Poisson sampling of one rank's users (:class:`DistributedUserPoissonSampler`), group ``t mod g``
    at step ``t``; the groups cover all users, each rank reading those of its own."""

    def __init__(self, users: Any, sample_rate: float, cyclic_groups: int, num_replicas: int | None = None,
                 rank: int | None = None, steps: int | None = None, generator: torch.Generator | None = None,
                 max_examples_per_user: int | None = None):
        units = len(torch.unique(_user_ids(users)))
        steps = self._init_groups(cyclic_groups, units, _checks.sample_rate(sample_rate), steps)
        DistributedUserPoissonSampler.__init__(self, users, sample_rate, num_replicas, rank, steps=steps,
                                               generator=generator, max_examples_per_user=max_examples_per_user)
        self._assign(self.num_users)

    _included_users = CyclicUserPoissonSampler._included_users
