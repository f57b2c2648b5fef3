"""Poisson sampling and virtual (physical) batches.

DP-SGD's privacy analysis assumes *Poisson sampling*: every step includes each training
example independently with probability ``q`` (the sample rate), so batch sizes vary and
can be zero. A shuffled fixed-size ``DataLoader`` does not match that analysis.

* :class:`PoissonSampler` is a batch sampler that draws such batches, deterministically
  from a ``torch.Generator`` and checkpointable mid-epoch.
* :func:`poisson_loader` wraps a map-style dataset into a ``DataLoader`` that uses it and
  that returns correctly shaped empty batches.
* :func:`split_batches` cuts each (logical) batch into physical batches that fit in
  memory; the optimizer steps once per logical batch.
"""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import default_collate

__all__ = [
    "DPDataLoader",
    "PoissonSampler",
    "is_poisson_loader",
    "poisson_loader",
    "split_batches",
]


def _check_sample_rate(sample_rate: Any) -> float:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real):
        raise ValueError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}.")
    q = float(sample_rate)
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1] (the probability that each example is in a "
            f"batch, i.e. expected batch size / dataset size), got {sample_rate!r}."
        )
    return q


def _check_positive_int(value: Any, what: str) -> int:
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return number


def _secure_generator() -> torch.Generator:
    # A seed from the OS entropy pool, so the batches cannot be predicted from a seed
    # that leaked into logs or configs (63 bits: manual_seed's safe range).
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

    :meth:`state_dict` / :meth:`load_state_dict` save and restore the generator and the
    position in the epoch: a resumed run continues with exactly the batches the stopped
    run would have drawn.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ):
        self.num_samples = _check_positive_int(num_samples, "num_samples")
        self.sample_rate = _check_sample_rate(sample_rate)
        self.steps = (
            max(1, round(1.0 / self.sample_rate))
            if steps is None
            else _check_positive_int(steps, "steps")
        )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}.")
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
        return mask.nonzero().flatten().tolist()

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
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
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
        saved = (state["num_samples"], state["sample_rate"], state["steps"])
        if saved != (self.num_samples, self.sample_rate, self.steps):
            raise ValueError(
                f"This state was saved by a sampler with (num_samples, sample_rate, steps) = "
                f"{saved}, but this sampler has {(self.num_samples, self.sample_rate, self.steps)}; "
                "the saved batches cannot be reproduced. Build the sampler with the saved "
                "settings."
            )
        position = state["position"]
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < self.steps:
            raise ValueError(f"Invalid position {position!r}: expected 0 <= position < {self.steps}.")
        self._epoch_start_state = state["generator_state"].clone()
        self._position = position
        self._resume_pending = True


# ------------------------------------------------------------------ batch structure
# A batch is a tensor, or a Mapping / tuple / list nesting of batches, or a per-sample
# list of plain values (what default_collate makes of strings).

_PLAIN_VALUES = (str, bytes, numbers.Number, type(None))


def _is_per_sample_list(batch: Any) -> bool:
    return isinstance(batch, list) and all(isinstance(item, _PLAIN_VALUES) for item in batch)


def _map_batch(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every per-sample leaf (tensor or per-sample list) of a batch."""
    if isinstance(batch, torch.Tensor) or _is_per_sample_list(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {key: _map_batch(value, fn) for key, value in batch.items()}
        try:
            return type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_batch(value, fn) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_batch(value, fn) for value in batch)
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


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over Poisson-sampled batches; build it with :func:`poisson_loader`.

    ``sample_rate`` is the probability q that an example is in a batch, and
    ``expected_batch_size`` is ``q * len(dataset)``, the denominator DP-SGD uses to
    average the noisy gradient sum (the actual batch size is random and private).
    """

    def __init__(self, dataset: Dataset, sampler: PoissonSampler, **kwargs: Any):
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self.sample_rate = sampler.sample_rate
        self.expected_batch_size = sampler.sample_rate * sampler.num_samples
        self._consumed: int | None = None  # batches handed out in the current epoch

    @property
    def poisson_sampler(self) -> PoissonSampler:
        return self.batch_sampler

    def __iter__(self) -> Iterator[Any]:
        sampler = self.poisson_sampler
        self._consumed = sampler._position if sampler._resume_pending else 0
        for batch in super().__iter__():
            self._consumed += 1
            yield batch
        self._consumed = None

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
) -> DPDataLoader:
    """A ``DataLoader`` with Poisson sampling over a map-style ``dataset``.

    Give exactly one of ``sample_rate`` (q in (0, 1]) or ``batch_size`` (the *expected*
    batch size, q = batch_size / len(dataset)). One epoch is ``steps`` batches, by
    default ``round(1 / q)``. Empty batches keep the structure of a real batch (shape
    ``[0, ...]``, same dtypes), learned from ``dataset[0]``.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            "Poisson sampling needs a map-style dataset with __len__ and __getitem__ "
            f"(every example must be addressable), got {type(dataset).__name__}."
        )
    num_samples = len(dataset)
    if num_samples == 0:
        raise ValueError("The dataset is empty: there is nothing to sample.")
    if (sample_rate is None) == (batch_size is None):
        raise ValueError(
            "Give exactly one of sample_rate (probability q that an example is in a batch) "
            "or batch_size (the expected batch size, q = batch_size / len(dataset))."
        )
    if batch_size is not None:
        batch_size = _check_positive_int(batch_size, "batch_size")
        if batch_size > num_samples:
            raise ValueError(
                f"batch_size={batch_size} exceeds the dataset size {num_samples}; the "
                "expected batch size must be at most len(dataset) (sample rate <= 1)."
            )
        sample_rate = batch_size / num_samples
    sampler = PoissonSampler(num_samples, sample_rate, steps=steps, generator=generator)
    collate = _EmptyBatchCollate(collate_fn or default_collate, dataset[0])
    return DPDataLoader(
        dataset, sampler, num_workers=num_workers, collate_fn=collate, pin_memory=pin_memory
    )


def is_poisson_loader(loader: Any) -> bool:
    """Whether ``loader`` draws its batches by Poisson sampling."""
    return isinstance(loader, DPDataLoader) or isinstance(
        getattr(loader, "batch_sampler", None), PoissonSampler
    )


def _split_batch(batch: Any, max_physical_batch_size: int) -> list[Any]:
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
    """
    # Checked here, not inside a generator, so a bad value fails at the call site.
    max_physical_batch_size = _check_positive_int(max_physical_batch_size, "max_physical_batch_size")
    return (_split_batch(batch, max_physical_batch_size) for batch in loader)
