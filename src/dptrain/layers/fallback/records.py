"""What the fallback keeps of a module's calls: each call's arguments (``FallbackCall``), a call whose rows are not
the samples in order with the sample of each row (``FoldedRows``), and the calls of one backward with their output
gradients (``FallbackOperands``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..protocol import OutputLeaves
from .objects import _snapshot


@dataclass
class FallbackCall:
    """One recorded call: its arguments as a flat list of leaves (``spec`` rebuilds args and kwargs)."""

    leaves: list
    spec: Any
    batched: list[int]            # positions of the leaves that carry the batch in dim 0
    batch: int
    versions: list[tuple[int, int]]  # (leaf position, version counter) of the tensor leaves
    autocast: tuple[str, bool, torch.dtype]
    signature: tuple
    #: the samples are segments of a flat input, not a dimension of the arguments (an EmbeddingBag's bags
    #: given as 1-D ids with offsets): each sample's arguments are cut out of the call (``bag_arguments``)
    bags: bool = False
    #: a container output (tuple, dict, ModelOutput): the leaves replayed and differentiated; None: a tensor output
    outputs: OutputLeaves | None = None
    #: the batch axis of each leaf in ``batched`` where the call's batch is not its arguments' first axis (a module
    #: run sequence-first in a batch-first model), found and verified by ``FallbackRule._axes_of_call``; None: axis 0
    axes: list[int] | None = None
    #: one row broadcast over the batch (``expand_batch``): each sample's rows are that row
    broadcast: bool = False
    #: positions of the leaves that are objects the call may change (``FallbackRule.before_call``), copied per replay
    objects: list[int] = field(default_factory=list)
    #: positions of the tensor leaves that required grad in the call (activations, not tables or masks)
    differentiable: frozenset[int] = frozenset()

    def arguments(self, replaced: dict[int, torch.Tensor] | None = None) -> tuple[tuple, dict]:
        """The call's arguments for a replay: ``replaced`` put in, and each object the call may change (a cache of
        keys and values the module adds its own to, kept as it was before the call) copied, its tensors detached,
        so that a replay changes neither the user's object nor the one kept for the next replay."""
        leaves = list(self.leaves)
        for k in self.objects:
            leaves[k] = _snapshot(leaves[k])
        for k, t in (replaced or {}).items():
            leaves[k] = t
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass
class FoldedRows:
    """A recorded call whose rows are not the samples in order (windows or tokens folded into the batch, rows
    reordered or routed), with its output gradient and the sample of each row (``dptrain.rows``)."""

    call: FallbackCall
    grad: torch.Tensor
    samples: torch.Tensor  # long, on the CPU: the sample of each row, -1 for a row with no gradient
    batch: int

    def chunks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, counts): the rows that have a sample, sample by sample and in the call's order within each
        sample, and how many rows each sample has."""
        known = self.samples >= 0
        key = torch.where(known, self.samples, torch.full_like(self.samples, self.batch))
        rows = torch.sort(key, stable=True).indices[: int(known.sum())]
        return rows, torch.bincount(self.samples[known], minlength=self.batch)[: self.batch]

    def row_factors(self, factor: torch.Tensor) -> torch.Tensor:
        """Each row's sample's factor (``factor[samples[r]]``; 0 for a row with no sample)."""
        samples = self.samples.to(factor.device)
        known = samples >= 0
        return torch.where(known, factor[samples.clamp(min=0)], torch.zeros((), dtype=factor.dtype,
                                                                             device=factor.device))


@dataclass
class FallbackOperands:
    """The calls of one module in one backward with their output gradients; per-sample gradients once formed."""

    calls: list[tuple[FallbackCall, torch.Tensor]]
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)
    #: calls whose rows were regrouped by sample (``FallbackRule.regroup_call``)
    folded: list[FoldedRows] = field(default_factory=list)
