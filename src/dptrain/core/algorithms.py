"""The seven clipping algorithms as recipes over the per-layer operation modules.

Book-keeping paper, Table 3 / section 2.2: every implementation is a choice of how to get
each layer's per-sample gradient norm (module 3: ghost norm, module 4: instantiation) and
how to get the clipped gradient (module 5: weighted sum of instantiated gradients,
module 2b(C): book-keeping a^T diag(C) g, or a second back-propagation of sum_i C_i L_i).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class _Named(str, Enum):
    """A choice that prints, formats and serialises (JSON) as its value, and compares equal to it."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # (the value's format, as __str__: intended)


class NormVia(_Named):
    GHOST = "ghost"              # module 3 wherever the layer has a ghost norm
    INSTANTIATE = "instantiate"  # module 4
    MIXED = "mixed"              # per layer and call: the planner's min(3, 4)


class GradVia(_Named):
    WEIGHTED_SUM = "weighted-sum"    # module 5 on the instantiated per-sample gradients
    BOOK_KEEPING = "book-keeping"    # module 2b(C) from the kept activations and output gradients
    FOLLOW_NORM = "follow-norm"      # BK-MixOpt: 2b(C) after a ghost norm, 5 after instantiation
    SECOND_PASS = "second-pass"      # Lee & Kifer: back-propagate sum_i C_i L_i


@dataclass(frozen=True)
class Recipe:
    norm: NormVia
    grad: GradVia

    @property
    def two_pass(self) -> bool:
        return self.grad is GradVia.SECOND_PASS


class Norm(_Named):
    """How one layer's per-sample norm was formed in one backward."""

    GHOST = "ghost"              # module 3
    INSTANTIATE = "instantiate"  # module 4
    FALLBACK = "fallback"        # module 4 by replaying the call with torch.func (no rule)


class Grad(_Named):
    """How one layer's clipped gradient was formed in one backward."""

    WEIGHTED_SUM = "weighted-sum"    # module 5
    BOOK_KEEPING = "book-keeping"    # module 2b(C)
    SECOND_PASS = "second-pass"      # module 2b of the re-weighted second backward


RECIPES: dict[str, Recipe] = {
    "per-sample": Recipe(NormVia.INSTANTIATE, GradVia.WEIGHTED_SUM),  # Opacus
    "fast-grad-clip": Recipe(NormVia.INSTANTIATE, GradVia.SECOND_PASS),  # Lee & Kifer
    "ghost": Recipe(NormVia.GHOST, GradVia.SECOND_PASS),  # Li et al.; Bu, Mao & Xu
    "mix-ghost": Recipe(NormVia.MIXED, GradVia.SECOND_PASS),  # Bu, Mao & Xu
    "bk": Recipe(NormVia.GHOST, GradVia.BOOK_KEEPING),  # Book-Keeping
    "bk-mix-ghost": Recipe(NormVia.MIXED, GradVia.BOOK_KEEPING),  # Book-Keeping
    "bk-mixopt": Recipe(NormVia.MIXED, GradVia.FOLLOW_NORM),  # Book-Keeping
}
"""Each clipping mode's recipe: how the per-sample norm is got and how the clipped gradient is formed
(docs/clipping-modes.md)."""

CLIPPING_MODES = tuple(RECIPES)
"""The names of the seven clipping modes, the valid values of ``clipping_mode``."""
# The one default of the engine, plan(), the command line, the audit and the Hugging Face Trainer.
DEFAULT_CLIPPING_MODE = "bk-mixopt"
