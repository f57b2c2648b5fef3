"""Per-layer decision between the ghost norm and per-sample gradient instantiation.

Space rule (mixed-ghost paper eq. 4.1; book-keeping paper section 3.2): ghost norm iff
2T^2 < p*d. Time rule (mixed-ghost paper Table 1, one layer): ghost norm costs
2BT^2(d+p+1) - B operations, instantiation 2B(T+1)pd; pick the cheaper.
Decisions are made per call from the real shapes, since T changes between batches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .layers.base import LayerDims

DECISION_RULES = ("space", "time")


def ghost_time(dims: LayerDims) -> int:
    return dims.blocks * (2 * dims.T * dims.T * (dims.d + dims.p + 1) - 1)


def instantiate_time(dims: LayerDims) -> int:
    return dims.blocks * 2 * (dims.T + 1) * dims.p * dims.d


def prefers_ghost(dims: LayerDims, rule: str = "space") -> bool:
    """True when the ghost norm is the better primitive for this layer call."""
    if not dims.ghost_supported:
        return False
    if rule == "space":
        return dims.ghost_cost < dims.instantiate_cost
    if rule == "time":
        return ghost_time(dims) < instantiate_time(dims)
    raise ValueError(f"unknown decision rule {rule!r}; valid: {', '.join(DECISION_RULES)}")


@dataclass(frozen=True)
class LayerDecision:
    """What the engine did for one layer in the last backward."""

    name: str
    type: str
    T: int
    p: int
    d: int
    ghost_cost: int
    instantiate_cost: int
    norm: str   # "ghost" or "instantiate"
    grad: str   # "book-keeping", "weighted-sum" or "second-pass"

    def as_dict(self) -> dict:
        return asdict(self)
