"""Poisson sampling of examples: :class:`PoissonSampler`, its checkpoint (state) and resume."""

from __future__ import annotations

import os
from typing import Iterator

import torch
from torch.utils.data import Sampler

from .. import _checks


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
        self.num_samples = _checks.positive_int("num_samples", num_samples)
        self.sample_rate = _checks.sample_rate(sample_rate)
        self.max_batch_size = (
            None if max_batch_size is None else _checks.positive_int(
                "max_batch_size", max_batch_size, "the fixed number of rows of every batch, K")
        )
        self.steps = (
            max(1, round(1.0 / self.sample_rate))
            if steps is None
            else _checks.positive_int("steps", steps)
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
        #: set by the ``DPDataLoader`` built on this sampler: whether it is drawing now, and whether another loader
        #: drew batches of it (``accelerator.prepare(loader)`` builds one on the same sampler), whose batches the
        #: engine, reading the ``DPDataLoader``'s record of them, would not see
        self.owned = False
        self.drawn_by_owner = False
        self.drawn_elsewhere = False

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
        if self.owned and not self.drawn_by_owner:
            self.drawn_elsewhere = True
        if self._resume_pending:
            self._resume_pending = False
            assert self._epoch_start_state is not None  # (load_state_dict sets both)
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
        position = _checks.index("position", state["position"], self.steps, "steps")
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
