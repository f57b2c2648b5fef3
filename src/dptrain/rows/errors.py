"""The row check's refusals."""
from __future__ import annotations


class NonFiniteRows(FloatingPointError):
    """A call's output gradient holds inf or NaN: its rows cannot be read (the step is skipped or refused)."""


class RowsMixSamples(ValueError):
    """Rows of a layer call, of the model's input or of its outputs combine several samples' gradients: per-sample
    clipping cannot split them. The message says where the coupling was read (the loss, the forward before a layer,
    a layer)."""
