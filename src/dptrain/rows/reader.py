"""What the row check keeps: across steps (``RowReader``: the tags' generator and the proofs' memo, never a verdict
on values) and for one backward (``BackwardRows``: the sketches its tag passes deliver, the maps it reads)."""
from __future__ import annotations

import torch

from .errors import NonFiniteRows, RowsMixSamples
from .inputs import InputRows, _add, _one_sample_per_row
from .layout import RowMap, _describe, can_regroup, map_from_layout
from .memo import ProofMemo
from .proof import Rows, call_layout, edges_by_call
from .reading import make_tags, read_sketches, tolerance
from .sketch import Projections, sketch_rows


class RowReader:
    """What row reading keeps across steps: the tags' generator and the proofs' memo (``memo.ProofMemo``: what the
    graph's structure proves holds for every value in it). No layout read from values is kept: every backward's
    rows are proven from its own graph, or read by its own tag passes. Each backward reads its maps through its own
    ``BackwardRows``."""

    def __init__(self, seed: int | None = None):
        self.proofs = ProofMemo()
        # The tags need no secrecy: their random order only keeps a structured mixture of rows (a mean of
        # two samples' gradients) from landing on a third sample's tag.
        self.generator = torch.Generator()
        self.generator.manual_seed(0x5EED if seed is None else seed + 1)
        #: layer calls received their gradient as recomputed in a backward (reentrant activation checkpointing): such
        #: calls are only known once recomputed, after any proof, so every backward reads rows by tag passes
        self.recomputes = False
        self.graph_recomputes = False  # the last graph proven holds a region reentrant checkpointing recomputes

    @staticmethod
    def pattern(state, call) -> tuple | None:
        """A recomputed call's key within one backward (its tag passes and its real pass recompute it as different
        calls): its layer, which of the layer's calls it is, its shape relative to B."""
        if call.ordinal is None:
            return None
        return (id(state.module), call.recomputed, call.ordinal, call.key)

    def prove(self, roots: list, batch: int, calls: list) -> bool:
        """Read the layouts of the unread calls (``calls``: (layer state, call)) that the graph below ``roots`` proves
        (``proof.py``, through the memo), and whether nothing is left for a tag pass (every unread call, and every
        reading of the model input's rows reached, proven)."""
        unread = [(s, c) for s, c in calls if c.rowmap is None]
        if batch <= 0:  # (an empty batch: no row belongs to a sample; its maps are empty, BackwardRows.resolve)
            return not unread
        proof = self.proofs.prove(roots, batch)
        by_edge = edges_by_call(proof)
        self.graph_recomputes = proof.recomputes  # (named where rows read as mixed: BackwardRows._read)
        complete = not self.recomputes and not proof.recomputes
        for state, call in unread:
            layout = None
            if call.shared_use is None and not call.recomputed and not call.hooked and call.batch_size == batch:
                layout = call_layout(proof, by_edge, call, batch, getattr(state.rule, "rows_fold_into_tokens", False))
            rowmap = map_from_layout(layout, call.shape, batch) if layout is not None else None
            if rowmap is None or (not rowmap.identity and not can_regroup(state.rule, call.activation, call.shape,
                                                                             rowmap.axes)):
                complete = False
                continue
            call.rowmap = rowmap
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
        self._projections: Projections | None = None
        #: a tag pass is running: output gradients that arrive are tagged ones
        self.tagging = False
        #: the tags of every tag pass of this backward, and which pass runs
        self.tags: list[torch.Tensor] | None = None
        self.tag_pass = 0
        #: sketches of the tagged gradients of calls recorded during a tag pass (recomputations), by pattern
        self.tagged: dict[tuple | None, tuple[list[dict], list[torch.Tensor] | None]] = {}  # (looked up by any pattern)
        #: maps read for recomputed calls (a second pass recomputes them again), by pattern
        self.resolved: dict[tuple | None, RowMap] = {}

        #: the model input's rows seen in this backward (``InputRows``), by identity
        self.inputs: dict[int, InputRows] = {}
        #: the last tag pass weights every sample 1 (of the unmasked losses of a fixed-shape batch): rows are read
        #: against it rather than the real gradient, in which the padded rows have none
        self.reference_pass = False
        #: the padded samples of a fixed-shape batch ([B] bool; None: none): rows that hold inf or NaN are read
        #: around where the layout puts them in padded samples
        self.padded: torch.Tensor | None = None
        #: the backward clips users (privacy_unit="user"): its refusals say that rows are still read per example
        self.per_user = False

    @property
    def projections(self) -> Projections:
        """The random projections of this backward's sketches, drawn at its first sketch (a backward whose rows are
        all proven draws none)."""
        if self._projections is None:
            self._projections = self.reader.new_projections()
        return self._projections

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
                    "the forward mixes samples before its trainable layers: a row of the model's "
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
        rowmap = self._read(state, call, batch, name)
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
            self.reader.recomputes = True
        return rowmap

    def _read_around_padding(self, real, tagged, tags, batch, shape, axes, eps, rel, bad: torch.Tensor) -> RowMap:
        """A call of a fixed-shape batch whose rows hold inf or NaN: read from its other rows, and accepted only where
        the layout they show puts every unreadable row in a padded sample (which counts for nothing)."""
        clean = lambda s: torch.where(bad.unsqueeze(1), torch.zeros((), dtype=s.dtype, device=s.device), s)  # noqa
        rowmap = read_sketches(clean(real), [clean(t) for t in tagged], tags, batch, shape, axes, eps, rel)
        samples = rowmap.layout.samples(shape, batch) if rowmap.layout is not None else None
        bad = bad.cpu()
        assert self.padded is not None  # (read around padding only where the batch has some)
        if samples is None or bool((samples[bad] < 0).any()) or not bool(self.padded[samples[bad]].all()):
            raise NonFiniteRows("a layer's output gradient is inf or NaN in rows that are not padding")
        return rowmap

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
        eps, rel = tolerance(call.grad.dtype, call.precision, call.grad.device)
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
        recomputed = (" Activation checkpointing recomputed calls in this backward: a recomputation that differs "
                      "from the forward (dropout with preserve_rng_state=False, a counter) reads as rows mixing "
                      "samples too; keep the RNG state, or checkpoint with use_reentrant=False."
                      if call.recomputed or self.reader.recomputes or self.reader.graph_recomputes else "")
        if call.precision == torch.float16:
            recomputed += (" Under fp16 a row of small gradients is subnormal, where its reading rounds: if the model "
                           "mixes nothing, a GradScaler (given to attach) helps, and bf16 keeps every row readable.")
        if self.per_user:
            recomputed += (" With privacy_unit='user' a layer's rows are read per example, then summed per user: a "
                           "forward that mixes the examples of one user is refused too. Couple them in the loss "
                           "instead: engine.backward(losses, users=...) takes a loss that couples one user's examples.")
        raise RowsMixSamples(
            f"{name}: {err} (output of shape {tuple(call.grad.shape)}, batch of {batch}): per-sample "
            "clipping cannot split such rows. Typical causes: an operation over the batch axis after this layer "
            "(a mixup or CutMix of hidden features, h.roll(1, 0)), a table broadcast over the batch (position "
            "embeddings looked up on [T] ids), per-class or pooled vectors, an input of the model concatenated "
            "with itself. Freeze this layer; for a table, give it ids with a batch axis of size 1 "
            "(torch.arange(T)[None]: its [1, T, d] output then broadcasts over the batch, exactly) or per-sample "
            f"ids (ids.expand(B, -1)); or register a rule for the module that mixes the samples.{recomputed}"
        ) from None
