"""One Poisson draw per step, shared out to micro-batches and processes: the loader the framework integrations use.

Frameworks cut a step into pieces: ``gradient_accumulation_steps`` micro-batches (the Trainer, Accelerate,
Lightning's ``accumulate_grad_batches``) on each of ``W`` processes. :class:`ShardedPoissonSampler` draws the
*logical* batch of a step exactly as one process would (``PoissonSampler``: each example with probability q,
and with ``max_batch_size=K`` a uniformly random K of the draw when it is larger), from a generator that
every process holds in the same state, and gives each (micro-batch, process) pair its share: the drawn
indices ``j, j + S, j + 2S, ...`` for share ``j = micro * W + rank`` of ``S = micro_batches * W``. The union
over all pieces of a step is therefore the single-process draw, and the accounting is the single-process
accounting: Poisson with rate q, plus ``accounting.truncation_delta`` for K (one truncation of the whole
draw, not one per process).

With ``max_batch_size=K`` every piece is a :class:`~dptrain.data.FixedShapeBatch` of exactly ``K / S`` rows
(the real rows first, then zero rows, and the mask), so shapes never change; ``K`` must be a multiple of
``S`` (:func:`fixed_shape_rows` rounds the smallest good K up to one). Without it the pieces are the bare
shares, of varying size (possibly empty).

The generator: give one seeded the same on every process for reproducible batches, or none: then process 0
draws a seed from ``os.urandom`` and sends it to the others (``torch.distributed.broadcast_object_list``) at
the first iteration, so the batches stay secret and agree across processes. The sampler's checkpoint is the
``PoissonSampler`` one (the generator at the start of the epoch and the logical batches drawn), the same on
every process; it loads into a loader with any number of processes or micro-batches (the logical batches do
not depend on how they are shared out).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

from .. import _checks, accounting
from ..data import DPDataLoader, FixedShapeBatch, PoissonSampler
from ..data.batches import _EmptyBatchCollate
from ..data.fixed_shape import _FixedShapeCollate
from ..data.loaders import drawing

__all__ = ["MASK_KEY", "ShardedPoissonLoader", "ShardedPoissonSampler", "fixed_shape_rows", "sharded_poisson_loader"]

#: The key under which a dict batch carries its fixed-shape mask when the loader is built with ``mask_key``.
MASK_KEY = "dptrain_mask"
"""The key of the fixed-shape mask in a dict batch (which rows are real samples)."""


def fixed_shape_rows(sample_size: int, batch_size: int, delta: float, steps: int, shares: int = 1) -> int:
    """The K for fixed-shape batches: the smallest whose truncation costs at most a tenth of ``delta`` over
    ``steps`` steps (``accounting.default_max_batch_size``), rounded up to a multiple of ``shares`` (micro-batches
    times processes, so every piece has ``K / shares`` rows). A larger K only truncates less."""
    shares = _checks.positive_int("shares", shares, "micro-batches times processes")
    k = accounting.default_max_batch_size(sample_size, batch_size / sample_size, delta, steps)
    return -(-k // shares) * shares


def _world() -> tuple[int, int]:
    """(world size, rank) of the initialised default process group, or (1, 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _shared_seed(world: int) -> int:
    """A secret seed, the same on every process: process 0's ``os.urandom``, broadcast."""
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    if world > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{world} processes must draw the same batches, from one secret seed that process 0 sends to the "
                "others: initialise torch.distributed before the first batch, or pass a generator seeded the same "
                "on every process")
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    return seed


class ShardedPoissonSampler(PoissonSampler):
    """Poisson sampling of one logical batch per step, shared out to ``micro_batches`` x ``num_replicas`` pieces.

    Yields this process's ``micro_batches`` index lists of each step in turn (``len``: ``steps *
    micro_batches``). ``num_replicas`` / ``rank`` default to the initialised process group's (or 1 / 0),
    read at the first iteration, as is the shared secret seed when ``generator`` is None (see the module
    documentation). ``max_batch_size`` is the global K, a multiple of ``micro_batches * num_replicas``.
    """

    def __init__(self, num_samples: int, sample_rate: float, *, micro_batches: int = 1,
                 num_replicas: int | None = None, rank: int | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, max_batch_size: int | None = None):
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator, max_batch_size=max_batch_size)
        self.micro_batches = _checks.positive_int("micro_batches", micro_batches, "pieces of a step per process")
        self._given_rank = rank
        self._seed_agreed = generator is not None  # (a given generator is seeded the same everywhere: documented)
        self.num_replicas: int | None = None
        self.rank: int | None = None
        if num_replicas is not None:
            self._set_world(num_replicas, rank if rank is not None else 0)

    def _set_world(self, num_replicas: int, rank: int) -> None:
        self.num_replicas = _checks.positive_int("num_replicas", num_replicas, "the number of processes")
        self.rank = _checks.index("rank", rank, self.num_replicas, "num_replicas")
        shares = self.shares
        if self.max_batch_size is not None and self.max_batch_size % shares:
            raise ValueError(
                f"max_batch_size={self.max_batch_size} does not split into {self.micro_batches} micro-batch(es) on "
                f"{self.num_replicas} process(es) of equal rows: use a multiple of {shares}, e.g. "
                f"{-(-self.max_batch_size // shares) * shares} (dptrain.integrations.loaders.fixed_shape_rows)"
            )

    @property
    def shares(self) -> int:
        """Pieces of one step: micro-batches times processes."""
        return self.micro_batches * (self.num_replicas or 1)

    @property
    def rows(self) -> int | None:
        """Rows of every piece with fixed shapes (``K / shares``), else None."""
        return None if self.max_batch_size is None else self.max_batch_size // self.shares

    def resolve(self) -> None:
        """Read the process group and agree on the secret seed (once; collective when several processes)."""
        if self.num_replicas is None:
            world, rank = _world()
            self._set_world(world, rank if self._given_rank is None else self._given_rank)
        if not self._seed_agreed:
            assert self.num_replicas is not None  # (read just above, or given)
            if not self._resume_pending:  # (a resumed sampler continues the checkpoint's generator, on every process)
                self.generator = torch.Generator().manual_seed(_shared_seed(self.num_replicas))
            self._seed_agreed = True

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        self.resolve()
        shares, rank, replicas = self.shares, self.rank, self.num_replicas
        assert replicas is not None and rank is not None  # (resolve read the process group)
        for indices in super().__iter__():
            for micro in range(self.micro_batches):
                yield indices[micro * replicas + rank::shares]

    def state_in_epoch(self, position: int) -> dict:
        """The checkpoint after ``position`` steps of the current epoch (0: between epochs, the next one starts
        from the generator's current state), whatever was drawn ahead by a prefetching loader."""
        position = _checks.index("position", position, self.steps, "steps")
        return {**self._state_at(position if position else self.steps), "position": position}


class ShardedPoissonLoader(DPDataLoader):
    """A ``DataLoader`` over one process's pieces of each step (build it with :func:`sharded_poisson_loader`).

    ``sample_rate``, ``expected_batch_size`` and ``max_batch_size`` are global (the whole logical batch of a
    step); ``micro_batches`` pieces make a step on each process. ``state_dict`` counts the steps whose pieces
    were all handed out (a partly handed-out step is drawn again on resume: its sum was never applied).
    """

    def __init__(self, dataset, sampler: ShardedPoissonSampler, **kwargs: Any):
        super().__init__(dataset, sampler, **kwargs)
        self.micro_batches = sampler.micro_batches

    @property
    def poisson_sampler(self) -> ShardedPoissonSampler:
        return cast(ShardedPoissonSampler, self.batch_sampler)  # (the constructor's)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # (a generator over DataLoader's iterator)
        sampler = self.poisson_sampler
        sampler.resolve()  # before workers copy the collate function, which needs the rows of a piece
        start = sampler._position * self.micro_batches if sampler._resume_pending else 0
        self._consumed = start
        with drawing(sampler):
            for batch in super(DPDataLoader, self).__iter__():
                self._consumed += 1
                self._note_batch(batch)
                yield batch
        self._consumed = None

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Draw the batches from now on with ``max_batch_size`` rows per step (a run resumed with a longer plan keeps
        its checkpoint's K: ``common.resumed_settings``); not while the loader is being iterated."""
        if self._consumed is not None:
            raise RuntimeError("max_batch_size cannot change while the loader is being iterated")
        sampler = self.poisson_sampler
        if sampler.max_batch_size is None:
            raise ValueError("this loader makes batches of varying size: build it with max_batch_size to fix K")
        previous = sampler.max_batch_size
        sampler.max_batch_size = _checks.positive_int("max_batch_size", max_batch_size, "the fixed rows of a step, K")
        try:
            if sampler.num_replicas is not None:
                assert sampler.rank is not None  # (_set_world sets both)
                sampler._set_world(sampler.num_replicas, sampler.rank)  # (checks that K splits into the pieces)
        except ValueError:
            sampler.max_batch_size = previous
            raise
        self.max_batch_size = sampler.max_batch_size
        collate = self.collate_fn.collate if isinstance(self.collate_fn, _MaskInDict) else self.collate_fn
        cast(_LazyRows, collate)._collate = None  # (sharded_poisson_loader's collate of fixed shapes)  # (the rows of a piece, read again from the sampler at the next batch)

    def state_dict(self) -> dict:
        """The sampler's checkpoint, counting the logical steps consumed, not the batches prefetched by workers."""
        sampler = self.poisson_sampler
        if self._consumed is None or sampler._resume_pending:
            return sampler.state_dict()
        return sampler.state_in_epoch(self._consumed // self.micro_batches % sampler.steps)


class _MaskInDict:
    """Collate a fixed-shape piece into the dict batch itself, the mask under ``key`` (for frameworks whose
    training step takes the batch as keyword arguments, like the Trainer)."""

    def __init__(self, collate: _LazyRows, key: str):
        self.collate, self.key = collate, key

    def __call__(self, items: list) -> dict:
        data, mask = self.collate(items)
        if not isinstance(data, Mapping):
            raise ValueError(f"mask_key={self.key!r} needs batches that collate to a dict, got {type(data).__name__}")
        if self.key in data:
            raise ValueError(f"the batch already has a {self.key!r} entry; the fixed-shape mask cannot go there")
        return {**data, self.key: mask}


def sharded_poisson_loader(dataset, batch_size: int, *, max_batch_size: int | None = None, micro_batches: int = 1,
                           steps: int | None = None, generator: torch.Generator | None = None,
                           num_replicas: int | None = None, rank: int | None = None,
                           collate_fn: Callable[[list], Any] | None = None, num_workers: int = 0,
                           pin_memory: bool = False, mask_key: str | None = None) -> ShardedPoissonLoader:
    """This process's loader of Poisson batches of expected (global) size ``batch_size``, each step shared out
    to ``micro_batches`` pieces per process (see the module documentation).

    ``max_batch_size=K``: every piece a :class:`~dptrain.data.FixedShapeBatch` ``(data, mask)`` of ``K /
    (micro_batches * processes)`` rows (``mask_key``: a dict batch with the mask under that key instead). Give
    the engine the same K (``PrivacyEngine(..., max_batch_size=K)``). One epoch is ``steps`` steps (default
    ``round(1 / q)``).
    """
    if not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"Poisson sampling needs a map-style dataset with __len__, got {type(dataset).__name__}")
    sample_size = len(dataset)
    if sample_size == 0:
        raise ValueError("the dataset is empty: there is nothing to sample")
    batch_size = _checks.positive_int("batch_size", batch_size, "the expected logical batch size")
    if batch_size > sample_size:
        raise ValueError(f"batch_size={batch_size} exceeds the dataset size {sample_size}")
    sampler = ShardedPoissonSampler(sample_size, batch_size / sample_size, micro_batches=micro_batches,
                                    num_replicas=num_replicas, rank=rank, steps=steps, generator=generator,
                                    max_batch_size=max_batch_size)
    collate_fn = collate_fn or torch.utils.data.default_collate
    if max_batch_size is None:
        if mask_key is not None:
            raise ValueError("mask_key only applies to fixed-shape batches: give max_batch_size too")
        collate: Callable = _EmptyBatchCollate(collate_fn, dataset[0])
    else:
        collate = _LazyRows(collate_fn, dataset[0], sampler)
        if mask_key is not None:
            collate = _MaskInDict(collate, mask_key)
    loader = ShardedPoissonLoader(dataset, sampler, collate_fn=collate, num_workers=num_workers, pin_memory=pin_memory)
    loader.mask_key = mask_key
    return loader


class _LazyRows:
    """``_FixedShapeCollate`` with the rows of a piece, known once the sampler has read the process group."""

    def __init__(self, collate_fn: Callable[[list], Any], example_item: Any, sampler: ShardedPoissonSampler):
        self.collate_fn, self.example_item, self.sampler = collate_fn, example_item, sampler
        self._collate: _FixedShapeCollate | None = None

    def __call__(self, items: list) -> FixedShapeBatch:
        if self._collate is None:
            rows = self.sampler.rows
            assert rows is not None  # (a sampler of fixed shapes: the loader's max_batch_size)
            self._collate = _FixedShapeCollate(self.collate_fn, self.example_item, rows)
        return self._collate(items)


def steps_per_epoch(sample_rate: float) -> int:
    """Poisson steps of one epoch: ``round(1 / q)``, as the samplers run it."""
    return max(1, round(1.0 / sample_rate))


def planned_steps(sample_rate: float, epochs: float) -> int:
    return int(math.ceil(epochs * steps_per_epoch(sample_rate)))

