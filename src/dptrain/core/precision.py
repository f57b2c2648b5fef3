"""fp16 with a ``torch.amp.GradScaler``: the scale, the search for one that works, and the skip marker.

The engine's gradients exist only from ``optimizer.step()`` on, so the scaler, which decides in
``scaler.step`` whether to skip by looking for inf/NaN in the gradients it unscales, is shown one
small *marker* gradient (``step.PendingMarker``): finite normally, inf for a backward that overflowed. Through
``engine.backward`` in one process an overflow is not a skip: the engine runs the backward again
at the scaler's back-off (``can_retry``) and installs the scale that worked (``worked``).
"""
from __future__ import annotations


class LossScaling:
    def __init__(self, scaler):
        self.scaler = scaler
        self.good_scale = 0.0   # the largest scale known not to overflow
        self.overflowed = False  # this logical step overflowed and is being skipped

    def scale(self) -> float:
        """The current scale (the factor on this step's losses)."""
        return float(self.scaler.get_scale())

    def backoff(self) -> float:
        return float(self.scaler.get_backoff_factor())

    def can_retry(self, scale: float, keeps_graph: bool, data_parallel: bool) -> bool:
        """Whether an overflow at ``scale`` can be met by running the backward again: in one process, when the
        graph is kept anyway (two passes) or the scale is above the last one that worked (then the graph is
        kept for it)."""
        return not data_parallel and (keeps_graph or scale > self.good_scale)

    def worked(self, scale: float, attempt: float) -> None:
        self.good_scale = scale * attempt
        if attempt != 1.0:
            self.scaler.update(scale * attempt)  # the scale that worked, for the next steps

    def show(self, overflow: bool, still_skipping: bool) -> tuple[bool, bool]:
        """(first overflow of this step, step skipped) after a backward; ``still_skipping``: the inf marker of a
        skipped step is still shown (``zero_grad()`` clears it: the skipped step is over). The engine shows the
        scaler its marker (``step.PendingMarker``): inf when the step is skipped."""
        if self.overflowed and not still_skipping:
            self.overflowed = False
        first = False
        if overflow or self.overflowed:
            first = not self.overflowed
            self.overflowed = True
        return first, self.overflowed
