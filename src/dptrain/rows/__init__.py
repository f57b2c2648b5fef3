"""The row check: which sample each row of a layer call belongs to, read from the gradient, never inferred from a shape.

- ``layout``: what a row map is (identity, reordered, folded, sequence-first) and the structural layouts;
- ``reading``: the tags of a tag pass and the reading of a call's rows from them;
- ``sketch``: the per-row sketches the reading keeps instead of whole tagged gradients (bounded memory);
- ``watch``: watching every training forward (its trace, reordering ops on the batch axis), ``traces`` the verified
  traces, ``inputs`` the rows of the model's input;
- ``losses``: the loss at every ``engine.backward``; ``proof``: layouts proven from the autograd graph;
- ``outputs``: the model's outputs, tagged for a plain ``loss.backward()``;
- ``reader``: what is kept across steps (``RowReader``) and for one backward (``BackwardRows``).
"""
from .errors import NonFiniteRows, RowsMixSamples
from .layout import IDENTITY, Layout, RowMap, can_regroup, describe_layouts, map_from_layout, pattern_key
from .outputs import carries_input_rows, gradient_edge, tag_rows, tensors_in
from .reader import BackwardRows, RowReader
from .reading import DIGITS, computing_precision, make_tags, read_rows, read_sketches, tag_passes
from .sketch import Projections, sketch_rows
from .inputs import InputRows
from .traces import Traces, op_key
from .watch import ForwardWatch

__all__ = [
    "BackwardRows", "DIGITS", "ForwardWatch", "IDENTITY", "InputRows", "Layout", "NonFiniteRows", "Projections", "Traces",
    "RowMap", "RowReader", "RowsMixSamples", "can_regroup", "carries_input_rows", "computing_precision",
    "describe_layouts", "gradient_edge", "make_tags", "map_from_layout", "pattern_key", "read_rows", "read_sketches",
    "op_key", "sketch_rows", "tag_passes", "tag_rows", "tensors_in",
]
