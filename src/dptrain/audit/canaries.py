"""The gradient canaries in the engine's path: the probe that only canaries train (:class:`CanaryModel`) and
the per-sample losses that give each canary a gradient on its own coordinate (:func:`canary_losses`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks

# A canary's gradient norm, in units of R: far above R, so that a canary that escaped
# clipping would stand out 64-fold, and a power of two, so that the clipping factor 1/64
# and the clipped contribution R are exact in float32.
CANARY_NORM_OVER_R = 64.0


class CanaryModel(nn.Module):
    """The audited model and a one-dimensional embedding, the *probe*, that only canaries train.

    ``forward(x, canary_id)`` returns ``(model(x), probe_output)``. ``canary_id`` is ``i`` for
    canary ``i``, whose probe output is ``probe.weight[i, 0]``, and -1 for a real sample,
    which reads the padding row ``canaries`` (constant zero, never trained). The probe
    output enters only the canaries' losses (:func:`canary_losses`), so canary ``i``'s
    per-sample gradient is a multiple of the unit vector on ``probe.weight[i, 0]``.
    (An embedding rather than a linear layer on one-hot vectors: a batch costs ``B``
    numbers, not ``B x canaries``.)
    """

    def __init__(self, model: nn.Module, canaries: int):
        super().__init__()
        canaries = _checks.positive_int("canaries", canaries)
        self.model = model
        self.canaries = canaries
        self.probe = nn.Embedding(canaries + 1, 1, padding_idx=canaries)
        nn.init.zeros_(self.probe.weight)

    def forward(self, x: torch.Tensor, canary_id: torch.Tensor):
        probe_ids = torch.where(canary_id >= 0, canary_id, self.canaries)
        return self.model(x), self.probe(probe_ids)[:, 0]

    def probe_gradient(self) -> torch.Tensor:
        """The probe's gradient on the canaries' coordinates, ``[canaries]`` (zeros if none yet)."""
        grad = self.probe.weight.grad
        return grad[: self.canaries, 0] if grad is not None else self.probe.weight.new_zeros(self.canaries)


def canary_losses(logits, probe_output, labels, canary_id, canary_norm: float):
    """Per-sample losses: cross-entropy for real samples, ``canary_norm * probe_output`` for canaries.

    ``torch.where`` masks each branch's gradient, so a canary gives the real parameters a
    zero gradient, and its gradient on the probe is ``canary_norm`` on its own coordinate.
    """
    real = F.cross_entropy(logits, labels, reduction="none")
    return torch.where(canary_id >= 0, canary_norm * probe_output, real)
