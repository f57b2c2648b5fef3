"""What the row check keeps: across steps (``RowReader``: the layouts verified so far, the tags' generator) and for
one backward (``BackwardRows``: the sketches its tag passes deliver, the maps it reads)."""
from __future__ import annotations

import torch

from .errors import NonFiniteRows, RowsMixSamples
from .layout import RowMap, _describe, can_regroup, map_from_layout
from .reading import make_tags, read_sketches, tolerance
from .sketch import Projections, sketch_rows
from .proof import Rows, call_layout, edges_by_call, prove
from .inputs import InputRows, _add, _one_sample_per_row
from .traces import Traces


class RowReader:
    """What row reading keeps across steps: the forwards verified so far (``Traces``) and the layouts their calls were
    read to have, the tags' generator. Each backward reads its maps through its own ``BackwardRows``."""

    def __init__(self, seed: int | None = None):
        #: (trace record, call pattern) -> the layout its rows were read to have
        self.layouts: dict[tuple, object] = {}
        self.traces = Traces()
        #: verifying forwards whose backward has not completed yet: forward id -> (trace, record)
        self._pending: dict[int, tuple[list, int]] = {}
        # The tags need no secrecy: their random order only keeps a structured mixture of rows (a mean of
        # two samples' gradients) from landing on a third sample's tag.
        self.generator = torch.Generator()
        self.generator.manual_seed(0x5EED if seed is None else seed + 1)
        #: the trace record of the last model call, and whether it picked no rows by the data: its recomputations
        #: (activation checkpointing) are its calls again
        self.last_trace: int | None = None
        self.forward_clean = False
        #: where the last model call left the verified traces (None: it followed one, or nothing was verified yet),
        #: and whether it followed one to its end (nothing in it to verify)
        self.last_divergence: str | None = None
        self.last_followed = False
        #: batch sizes whose recomputed calls (activation checkpointing) were verified: a backward of another
        #: batch size runs a tag pass, as recomputed calls are only known once they are recomputed
        self.recomputed_batches: set[int] | None = None

    def has_layout(self, module) -> bool:
        """Whether a layout of some call of ``module`` is cached (for tests and reports)."""
        return any(key[1] == id(module) for key in self.layouts)

    def pending_trace(self, forward_id: int, keys: list, record: int) -> None:
        """A verifying forward's trace, kept once its backward has read every row (``verified``)."""
        self._pending[forward_id] = (keys, record)
        while len(self._pending) > 16:  # (forwards never back-propagated)
            self._pending.pop(next(iter(self._pending)))

    def verified(self, forward_ids) -> None:
        """A backward completed over these model calls: their traces are verified."""
        for forward_id in forward_ids:
            got = self._pending.pop(forward_id, None)
            if got is not None:
                self.traces.insert(*got)

    @staticmethod
    def pattern(state, call) -> tuple | None:
        """The cache key of a call: the verified trace of its forward, its layer, which of the layer's calls it is,
        its shape relative to B."""
        if call.ordinal is None or call.trace is None:
            return None
        return (call.trace, id(state.module), call.recomputed, call.ordinal, call.key)

    def cached(self, state, call):
        pattern = self.pattern(state, call)
        return self.layouts.get(pattern) if pattern is not None else None

    def needs_tags(self, state, call) -> bool:
        """Whether this call's layout must be read from a tag pass (it is not known for its pattern)."""
        if call.rowmap is not None:
            return False
        layout = self.cached(state, call)
        return layout is None or call.batch_size is None or not layout.fits(call.shape, call.batch_size)

    def prove(self, roots: list, batch: int, calls: list) -> bool:
        """Read the layouts of the unread calls (``calls``: (layer state, call)) that the graph below ``roots`` proves
        (``proof.py``), and whether nothing is left for a tag pass (every unread call, and every reading of the model
        input's rows reached, proven)."""
        unread = [(s, c) for s, c in calls if c.unread and c.rowmap is None]
        if not unread:
            return True
        if batch <= 0:  # (an empty batch: no row belongs to a sample; its maps are empty, BackwardRows.resolve)
            return False
        if not all(c.provable for _, c in unread):
            return False
        proof = prove(roots, batch)
        by_edge = edges_by_call(proof)
        complete = True
        for state, call in unread:
            layout = None
            if call.shared_use is None and not call.recomputed and call.batch_size == batch:
                layout = call_layout(proof, by_edge, call, batch, getattr(state.rule, "rows_fold_into_tokens", False))
            rowmap = map_from_layout(layout, call.shape, batch) if layout is not None else None
            if rowmap is None or (not rowmap.identity and not can_regroup(state.rule, call.activation, call.shape,
                                                                             rowmap.axes)):
                complete = False
                continue
            call.rowmap = rowmap
            pattern = self.pattern(state, call)
            if call.cacheable and pattern is not None:
                self.layouts[pattern] = layout
        for (node, _), value in proof.edges.items():
            reading = getattr(node, "reading", None) if node.name() == "_InputRowsNodeBackward" else None
            if isinstance(reading, InputRows):
                reading.proven = any(value == Rows(axis) for axis in reading.axes)
                complete &= reading.proven
        return complete

    def new_tags(self, batch: int, passes: int | None = None) -> list[torch.Tensor]:
        """The tags of the tag passes of a backward of ``batch`` samples (one pass per base-4 digit, or
        ``passes``, which all ranks agree on under data parallelism)."""
        return make_tags(batch, self.generator, passes)

    def new_projections(self) -> Projections:
        """The random projections of one backward's sketches (``sketch.py``)."""
        return Projections(int(torch.randint(1 << 31, (1,), generator=self.generator)))


def _two_axes(state, grad: torch.Tensor) -> bool:
    return getattr(state.rule, "rows_fold_into_tokens", False) and grad.dim() >= 3


class BackwardRows:
    """The row maps of one backward: the sketches of the tagged gradients its tag passes deliver, and the maps it
    reads (owned by the backward, so nothing of one backward's reading reaches the next)."""

    def __init__(self, reader: RowReader):
        self.reader = reader
        self.projections = reader.new_projections()
        #: a tag pass is running: output gradients that arrive are tagged ones
        self.tagging = False
        #: the tags of every tag pass of this backward, and which pass runs
        self.tags: list[torch.Tensor] | None = None
        self.tag_pass = 0
        #: sketches of the tagged gradients of calls recorded during a tag pass (recomputations), by pattern
        self.tagged: dict[tuple, tuple[list[dict], list[torch.Tensor]]] = {}
        #: maps read for recomputed calls (a second pass recomputes them again), by pattern
        self.resolved: dict[tuple, RowMap] = {}

        #: the model input's rows seen in this backward (``InputRows``), by identity
        self.inputs: dict[int, InputRows] = {}
        #: the last tag pass weights every sample 1 (of the unmasked losses of a fixed-shape batch): rows are read
        #: against it rather than the real gradient, in which the padded rows have none
        self.reference_pass = False
        #: the padded samples of a fixed-shape batch ([B] bool; None: none): rows that hold inf or NaN are read
        #: around where the layout puts them in padded samples
        self.padded: torch.Tensor | None = None

    def begin_tags(self, tags: list[torch.Tensor]) -> None:
        self.tags = tags
        self.tagged.clear()

    def _sketch(self, state, grad: torch.Tensor) -> dict[int, torch.Tensor]:
        """A call's output gradient as the sketches of its rows along the axes its rule's rows are read over."""
        if _two_axes(state, grad):
            return {1: sketch_rows(grad, 1, self.projections), 2: sketch_rows(grad, 2, self.projections)}
        return {1: sketch_rows(grad, 1, self.projections)}

    def record_input(self, reading: InputRows, grad: torch.Tensor) -> None:
        """The gradient of a tensor carrying the model input's rows (``_InputRowsNode``), kept as sketches."""
        if reading.proven:  # (its rows stay apart by the graph itself: rows.proof)
            return
        self.inputs[id(reading)] = reading
        sketches = reading.sketches(grad, self.projections)
        if self.tagging:
            if reading.tags is not self.tags:  # (each model call of a plain backward tags with its own tags)
                reading.tagged, reading.tags = [], self.tags
            if len(reading.tagged) > self.tag_pass:
                reading.tagged[self.tag_pass] = _add(reading.tagged[self.tag_pass], sketches)
            else:
                reading.tagged.append(sketches)
        else:
            reading.real = _add(reading.real, sketches)

    def check_inputs(self, layers: str) -> None:
        """Refuse a forward that mixes samples before the trainable layers (``InputRows``); ``layers`` names
        the trainable layers for the message."""
        for reading in self.inputs.values():
            tags, real, tagged = reading.tags, reading.real, reading.tagged
            if self.reference_pass and tags is not None and len(tagged) == len(tags):
                real, tagged, tags = tagged[-1], tagged[:-1], tags[:-1]
            if real is None or tags is None or len(tagged) != len(tags) or tags[0].numel() != reading.batch:
                continue
            if not any(_one_sample_per_row(reading, axis, tags, real, tagged, self.padded) for axis in reading.axes):
                raise RowsMixSamples(
                    f"the forward mixes samples before its trainable layers{self._where()}: a row of the model's "
                    "input reaches other samples' losses (a mixup of the input, a statistic over the batch such as a "
                    "mean or a BatchNorm in training mode, or rows of one sample fed to another, in a frozen part of "
                    "the model), so every "
                    f"trainable layer after it ({layers}) sees the other samples' data. Per-sample clipping "
                    "cannot bound such a sample's influence: compute the statistic per sample, or freeze those "
                    "layers"
                )
        self.inputs.clear()

    def record_tagged(self, state, call, grad: torch.Tensor) -> None:
        """An output gradient of tag pass ``self.tag_pass``: kept as the sketches of its rows, never whole."""
        sketches = self._sketch(state, grad)
        if call.recomputed:  # the real pass recomputes it again, as another call: found by its pattern
            pattern = self.reader.pattern(state, call)
            if pattern is None:
                return
            got = self.tagged.setdefault(pattern, ([], self.tags))[0]
        else:
            if call.tagged is None or call.tags is not self.tags:
                call.tagged, call.tags = [], self.tags
            got = call.tagged
        if len(got) > self.tag_pass:  # a model with several outputs: each adds its part of the pass
            got[self.tag_pass] = _add(got[self.tag_pass], sketches)
        else:
            got.append(sketches)

    def resolve(self, state, call, batch: int) -> RowMap:
        """The row map of a call that received its output gradient, for a step of ``batch`` samples."""
        if call.rowmap is not None:
            return call.rowmap
        if call.recomputed and self.reader.pattern(state, call) in self.resolved:
            call.rowmap = self.resolved[self.reader.pattern(state, call)]
            return call.rowmap
        if batch == 0:  # no sample: no row can belong to one
            rows = call.shape[0] if call.shape else 0
            call.rowmap = RowMap(1, torch.full((rows,), -1, dtype=torch.long), 0, rows == 0, None)
            return call.rowmap
        name = f"{state.path} ({type(state.module).__name__})"
        # (a table of batch size 1 used without broadcasting it is read at every step: broadcast.py)
        layout = self.reader.cached(state, call) if call.shared_use is None else None
        rowmap = map_from_layout(layout, call.shape, batch) if layout is not None else None
        if rowmap is None:
            rowmap = self._read(state, call, batch, name)
            if rowmap.layout is not None and call.cacheable and rowmap.complete:
                self.reader.layouts[self.reader.pattern(state, call)] = rowmap.layout
        if not rowmap.identity and not can_regroup(state.rule, call.activation, call.grad, rowmap.axes):
            raise RowsMixSamples(
                f"{name}: its rows are samples in another order or layout ({_describe(rowmap)}, output of shape "
                f"{tuple(call.grad.shape)}), which the rule {type(state.rule).__name__} cannot regroup. Give the "
                "layer the batch as its first dimension, or freeze it"
            )
        call.rowmap = rowmap
        call.tagged = None
        if call.recomputed and self.reader.pattern(state, call) is not None:
            self.resolved[self.reader.pattern(state, call)] = rowmap
            self.reader.recomputed_batches = (self.reader.recomputed_batches or set()) | {batch}
        return rowmap

    def _read_around_padding(self, real, tagged, tags, batch, shape, axes, eps, rel, bad: torch.Tensor) -> RowMap:
        """A call of a fixed-shape batch whose rows hold inf or NaN: read from its other rows, and accepted only where
        the layout they show puts every unreadable row in a padded sample (which counts for nothing)."""
        clean = lambda s: torch.where(bad.unsqueeze(1), torch.zeros((), dtype=s.dtype, device=s.device), s)  # noqa
        rowmap = read_sketches(clean(real), [clean(t) for t in tagged], tags, batch, shape, axes, eps, rel)
        samples = rowmap.layout.samples(shape, batch) if rowmap.layout is not None else None
        bad = bad.cpu()
        if samples is None or bool((samples[bad] < 0).any()) or not bool(self.padded[samples[bad]].all()):
            raise NonFiniteRows("a layer's output gradient is inf or NaN in rows that are not padding")
        return rowmap

    def _where(self) -> str:
        """Where the last forward left the steps verified before, in words (empty if it did not)."""
        where = self.reader.last_divergence
        return f" (this forward left the ones verified before at `{where}`)" if where else ""

    def _read(self, state, call, batch: int, name: str) -> RowMap:
        """A call's map read from its tag passes' sketches and its real output gradient."""
        tagged, tags = call.tagged, call.tags
        if tagged is None and call.recomputed:
            tagged, tags = self.tagged.get(self.reader.pattern(state, call), (None, None))
        if tagged is None or tags is None or tags[0].numel() != batch or len(tagged) != len(tags):
            raise RuntimeError(
                f"{name}: the engine could not read which sample each row of this call belongs to (its output "
                "gradient did not come from the model's per-sample outputs or losses: a layer called outside "
                "the model, or a loss computed inside the model). Return per-sample outputs from model(...) "
                "and use engine.backward(per_sample_losses)"
            )
        if self.reference_pass:  # the last pass tagged every sample 1: the reference, padded rows included
            real, tagged, tags = tagged[-1], tagged[:-1], tags[:-1]
        else:
            real = self._sketch(state, call.grad)
        unreadable = {axes: ~torch.isfinite(sketch).all(1) for axes, sketch in real.items()}
        for sketches in tagged:
            for axes, sketch in sketches.items():
                unreadable[axes] = unreadable[axes] | ~torch.isfinite(sketch).all(1)
        if any(bool(rows.any()) for rows in unreadable.values()) and self.padded is None:
            raise NonFiniteRows("a layer's output gradient is inf or NaN")
        eps, rel = tolerance(call.grad.dtype, call.precision)
        err = None
        for axes in sorted(real):
            try:
                bad = unreadable[axes]
                if not bool(bad.any()):
                    return read_sketches(real[axes], [t[axes] for t in tagged], tags, batch, tuple(call.grad.shape),
                                         axes, eps, rel)
                return self._read_around_padding(real[axes], [t[axes] for t in tagged], tags, batch,
                                                 tuple(call.grad.shape), axes, eps, rel, bad)
            except RowsMixSamples as e:
                err = e
        if call.shared_use is not None:
            raise RowsMixSamples(
                f"{name}: its output, of batch size 1 and broadcast over the batch ({tuple(call.grad.shape[1:])} "
                f"per sample), was used by {call.shared_use} as a whole rather than broadcast against the "
                f"batch, so {err} (batch of {batch}): per-sample clipping cannot split such rows. Use the "
                "output only where it meets the batch (x + pos), index or reduce it after that, or give the "
                "layer per-sample ids (ids.expand(B, -1)), or freeze it"
            ) from None
        raise RowsMixSamples(
            f"{name}: {err} (output of shape {tuple(call.grad.shape)}, batch of {batch}){self._where()}: per-sample "
            "clipping cannot split such rows. Typical causes: an operation over the batch axis after this layer "
            "(a mixup or CutMix of hidden features, h.roll(1, 0)), a table broadcast over the batch (position "
            "embeddings looked up on [T] ids), per-class or pooled vectors, an input of the model concatenated "
            "with itself. Freeze this layer; for a table, give it ids with a batch axis of size 1 "
            "(torch.arange(T)[None]: its [1, T, d] output then broadcasts over the batch, exactly) or per-sample "
            "ids (ids.expand(B, -1)); or register a rule for the module that mixes the samples"
        ) from None
