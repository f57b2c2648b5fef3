"""What a backward is refused for, as the exception to raise: per-sample losses that are not finite, and a backward
compiled by torch.compile that cannot run twice. (``runner`` raises them; nothing of the backward is kept.)"""
from __future__ import annotations

import torch


def non_finite_losses(losses: torch.Tensor) -> ValueError | None:
    """The refusal of a batch whose per-sample losses hold inf or NaN, naming their positions; None if they do not."""
    bad = (~torch.isfinite(losses.detach())).nonzero().flatten().tolist()
    if not bad:
        return None
    return ValueError(f"non-finite per-sample losses at batch positions {bad[:10]}: nothing was accumulated")


def compiled_backward_refusal(err: RuntimeError) -> RuntimeError | None:
    """What to do where torch.compile's backward refused to run twice (inductor's donated buffers), or None."""
    if "donated_buffer" not in str(err):
        return None
    return RuntimeError(
        "torch.compile compiled a backward that frees its buffers as it runs (inductor's donated buffers), so it "
        "cannot be back-propagated twice; the engine back-propagates a step more than once where the graph does not "
        "prove which sample each row belongs to (a compiled region is opaque to it: its tag passes read the rows), "
        "and the two-pass clipping modes always do. Set torch._functorch.config.donated_buffer = False before the "
        "first compiled step (it costs a little memory, no speed), or compile only parts of the model between its "
        "trainable layers. Nothing of this backward was accumulated")
