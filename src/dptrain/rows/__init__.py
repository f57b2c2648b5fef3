"""The row check: which sample each row of a layer call belongs to, read from the gradient, never inferred from a shape.

- ``layout``: what a row map is (identity, reordered, folded, sequence-first) and the structural layouts;
- ``reading``: the tags of a tag pass and the reading of a call's rows from them;
- ``sketch``: the per-row sketches the reading keeps instead of whole tagged gradients (bounded memory);
- ``inputs``: the rows of the model's input, carried through the graph;
- ``losses``: the loss at every ``engine.backward``; ``proof``: layouts proven from the autograd graph by the node
  types' ``rules``, ``memo`` the proofs by the structure of the graph they were made on;
- ``outputs``: the model's outputs, tagged for a plain ``loss.backward()``;
- ``reader``: what is kept across steps (``RowReader``: the tags' generator, the proofs' memo) and for one backward
  (``BackwardRows``);
- ``errors``: the refusals (``RowsMixSamples``, ``NonFiniteRows``).

docs/row-check.md says what it guarantees. It may import ``layers`` (and ``_checks``); the engine's step
machinery (``core``) builds on it, never the other way round.
"""
from .errors import NonFiniteRows, RowsMixSamples
from .inputs import InputRows
from .layout import IDENTITY, Layout, RowMap, can_regroup, describe_layouts, map_from_layout, pattern_key
from .memo import ProofMemo
from .outputs import carries_input_rows, gradient_edge, map_tensors, refuse_uncarried, tag_rows, tensors_in
from .reader import BackwardRows, RowReader
from .reading import DIGITS, computing_precision, make_tags, read_rows, read_sketches, tag_passes
from .sketch import Projections, sketch_rows

__all__ = [
    "BackwardRows", "DIGITS", "IDENTITY", "InputRows", "Layout", "NonFiniteRows", "Projections", "ProofMemo",
    "RowMap", "RowReader", "RowsMixSamples", "can_regroup", "carries_input_rows", "computing_precision",
    "describe_layouts", "gradient_edge", "make_tags", "map_from_layout", "map_tensors", "pattern_key", "read_rows",
    "read_sketches", "refuse_uncarried", "sketch_rows", "tag_passes", "tag_rows", "tensors_in",
]
