"""Virtual batches: :func:`split_batches` cuts each logical batch into physical batches that fit in memory.

A user-level batch is cut only between users (a user's rows go to one backward).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from .. import _checks
from .batches import _batch_size, _map_batch
from .users import FixedShapeUserBatch, UserBatch, UserPoissonSampler


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
    max_physical_batch_size = _checks.positive_int("max_physical_batch_size", max_physical_batch_size)
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, UserPoissonSampler) and sampler.max_rows_per_user > max_physical_batch_size:
        raise ValueError(
            f"the loader can put {sampler.max_rows_per_user} rows of one user in a batch (max_examples_per_user="
            f"{sampler.max_examples_per_user}), more than max_physical_batch_size={max_physical_batch_size}, and a "
            "user's rows cannot be split across physical batches; build the loader with max_examples_per_user <= "
            f"{max_physical_batch_size}"
        )
    return (_split_batch(batch, max_physical_batch_size) for batch in loader)
