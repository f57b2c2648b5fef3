"""The loss check: at every ``engine.backward(losses)``, each sample's loss depends on its own rows of the model's
outputs only.

What connects rows to losses - the loss function, a statistic over the batch, in-batch negatives - changes from one
step to the next without any layer noticing. So it is checked at every step, on the part of the graph between the
per-sample losses and the model's outputs, where it is cheap:

1. ``proof.prove`` walks the loss's graph down to the model's outputs (marked by the capture, ``mark_outputs``).
   Where every operation in between keeps rows apart (a cross-entropy, a mean over tokens, a view), and each output
   is reached with its batch rows as they are, the loss is separable: nothing else runs.
2. Otherwise tag passes of the loss alone (``torch.autograd.grad`` from the losses to the outputs, not through the
   model): ``ceil(log4 B)`` passes with per-sample tags and one without, each reduced at once to per-row sketches
   (``sketch.py``). A row of an output whose gradient is not its own sample's (or, with ``privacy_unit="user"``, its
   own user's) is refused, naming the loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import NonFiniteRows, RowsMixSamples
from .layout import IDENTITY
from .outputs import tensors_in
from .proof import Rows, marked_edge, prove
from .reading import even_scales, make_tags, read_sketches, tolerance
from .sketch import Projections, sketch_rows

#: the key of the model's output marks in an autograd node's ``metadata``
OUTPUT_MARK = "dptrain_output"


@dataclass(frozen=True)
class OutputMark:
    """A model output as its autograd node remembers it: where its batch sits, of how many samples, from which model
    call, and its shape (nothing that holds the graph: the mark lives in the node itself)."""

    axis: int
    batch: int
    forward_id: int | None
    shape: tuple
    precision: torch.dtype | None

    def describe(self) -> str:
        call = f" of model call {self.forward_id}" if self.forward_id is not None else ""
        others = [a for a, n in enumerate(self.shape) if n == self.batch and a != self.axis]
        also = (f"; the batch's size is also that of axis {others[0]}: if the batch is there (a time-major output), "
                f"return the output with the batch along axis {self.axis}, e.g. out.transpose({self.axis}, "
                f"{others[0]})" if others else "")
        return f"the model's output of shape {self.shape}{call} (batch along axis {self.axis}{also})"


def output_axis(t: torch.Tensor, batch: int, axis: int) -> int | None:
    """The axis of a model output that holds the batch: the model's batch axis, or the first where a sequence-first
    model's output was pooled; None where neither (or both, ambiguously) has the batch's size."""
    found = [a for a in dict.fromkeys((axis, 0)) if t.dim() > a and t.shape[a] == batch]
    return found[0] if len(found) == 1 else None


def mark_outputs(output, batch: int | None, axis: int, forward_id: int | None, precision) -> None:
    """Write an ``OutputMark`` into the autograd node of each per-sample tensor of a model call's output."""
    if batch is None:
        return
    for t in tensors_in(output):
        if not (t.requires_grad and t.is_floating_point()) or t.grad_fn is None:
            continue
        found = output_axis(t, batch, axis)
        if found is None:
            continue
        marks = t.grad_fn.metadata.setdefault(OUTPUT_MARK, {})
        marks[t.output_nr] = OutputMark(found, batch, forward_id, tuple(t.shape), precision)


def _mark(node, nr: int) -> OutputMark | None:
    marks = node.metadata.get(OUTPUT_MARK) if node is not None else None
    return marks.get(nr) if marks else None


@dataclass
class LossReading:
    """What the loss check saw: the model outputs and the layer calls the losses reach first (edge -> what it is), and
    whether their rows were proven separable without a tag pass."""

    sources: dict
    proven: bool
    stopped_at: str | None = None


@dataclass(frozen=True)
class CallSource:
    """A layer call the losses reach without passing through a model output (a layer called after the model, or a
    batch-level term computed inside it and added to every loss)."""

    name: str
    axis: int
    shape: tuple
    precision: torch.dtype | None

    def describe(self) -> str:
        return f"the output of {self.name} (shape {self.shape})"


def check_losses(losses: torch.Tensor, units: torch.Tensor | None, generator: torch.Generator, calls=(),
                 passes: int | None = None, model=None) -> LossReading:
    """Refuse losses that couple samples (see the module docstring). ``units``: each loss's privacy unit (0..U-1) with
    ``privacy_unit="user"``, else None. ``calls``: the (layer state, call) waiting for their gradient: the walk stops
    at them too. ``passes``: the tag passes every rank agrees on (data parallelism), if any. Run it with the engine's
    hooks paused: its backward passes are not training. ``model``: the attached model, whose trainable parameters
    alone may receive the losses' gradient."""
    if losses.grad_fn is None or losses.shape[0] == 0:
        return LossReading({}, True)
    batch = losses.shape[0]
    at_calls = {}
    for state, call in calls:
        if call.edge is not None and call.edge_shape is None:
            at_calls[call.edge] = CallSource(f"{state.path} ({type(state.module).__name__})",
                                             1 if call.edge_swapped else 0, call.shape, call.precision)

    def source(node, nr):
        return _mark(node, nr) or at_calls.get(marked_edge(node, nr))

    proof = prove([(losses.grad_fn, losses.output_nr, Rows(0))], batch, stop=lambda n, nr: source(n, nr) is not None)
    sources = {edge: source(*edge) for edge in proof.stops}
    if model is not None:
        _refuse_outside_parameters(proof, model)
    separable = not proof.unproven and all(_separable(proof.edges.get(edge), what) for edge, what in sources.items())
    if separable and passes in (None, 0):
        return LossReading(sources, True)
    if sources:
        try:
            _tag_check(losses, sources, units, generator, passes, proof.stopped_at)
        except RowsMixSamples:
            spread = spread_scalar(losses)  # (read only for a refusal: it names the cause, the refusal stands)
            if spread is None:
                raise
            raise RowsMixSamples(_one_scalar_message(*spread, losses.shape[0])) from None
    return LossReading(sources, False, proof.stopped_at)


# The operations that turn one value into B equal losses without computing anything per sample: right where the
# losses are made (``out.loss.expand(B)``, ``loss * torch.ones(B)``), so the walk looks a few nodes deep only.
_SPREADS = {"Expand", "Repeat", "Unsqueeze", "View", "Reshape", "UnsafeView", "Alias", "Clone", "ToCopy",
            "Contiguous", "Mul", "Div", "Neg"}
_SPREAD_DEPTH = 8
_RESHAPES = {"View", "Reshape", "UnsafeView", "Unsqueeze", "Squeeze", "Alias", "Clone", "ToCopy", "Contiguous",
             "Expand"}
_REDUCED_LOSSES = {"NllLoss", "NllLoss2D", "NllLoss2d", "MseLoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
                   "BinaryCrossEntropy", "BinaryCrossEntropyWithLogits", "KlDiv", "SoftMarginLoss"}


def _base_name(name: str) -> str:
    """A node type without its ``Backward<n>`` suffix."""
    return name[: name.find("Backward")] if "Backward" in name else name


def spread_scalar(losses: torch.Tensor) -> tuple[str, str] | None:
    """(the node that made it, the operation that spread it) where the per-sample losses are one value of a single
    element spread over the batch, reached through operations with one differentiable input each; else None."""
    node = losses.grad_fn
    for _ in range(_SPREAD_DEPTH):
        if node is None or _base_name(node.name()) not in _SPREADS:
            return None
        below = _single_input(node)
        if below is None:
            return None
        if _one_element(*below):
            made = below[0]  # past the reshapes of that one element (loss.reshape(1)), to the node that made it
            while _base_name(made.name()) in _RESHAPES and (under := _single_input(made)) and _one_element(*under):
                made = under[0]
            return made.name(), node.name()
        node = below[0]
    return None


def _single_input(node) -> tuple | None:
    inputs = [(nxt, nr) for nxt, nr in node.next_functions if nxt is not None]
    return inputs[0] if len(inputs) == 1 else None


def _one_element(node, nr: int) -> bool:
    meta = getattr(node, "_input_metadata", ())
    return nr < len(meta) and math.prod(meta[nr].shape) == 1


def _one_scalar_message(scalar: str, spread: str, batch: int) -> str:
    base = _base_name(scalar)
    if base in _REDUCED_LOSSES:
        what = ("a loss reduced over the whole batch, as reduction='mean' does (the loss a model computes from labels= "
                "is the mean over the batch's tokens)")
    elif base in ("Mean", "Sum"):
        what = f"a {base.lower()} over the whole batch"
    else:
        what = "one value computed from the whole batch"
    return (
        f"the loss couples samples: the losses are one scalar expanded to [{batch}] ({spread} of {scalar}): {what}. "
        "Each sample's loss is then the same value, which depends on every sample: no sample's gradient is its own "
        "to clip. Compute one loss per sample instead, with reduction='none': F.cross_entropy(logits, y, "
        "reduction='none'), or for a language model dptrain.losses.sequence_losses(logits, labels, shift=True) on "
        "the model's logits (call the model without labels=), and pass those to engine.backward. Nothing of this "
        "backward was accumulated"
    )


def _refuse_outside_parameters(proof, model) -> None:
    """No private gradient leaves the private model: the losses' gradient reaching trainable parameters outside it
    (a loss module, a learnable temperature, a generator through the model's input) would give them the raw,
    unclipped and un-noised gradient of the private batch."""
    leaves = [node.variable for node, _ in proof.edges if node.name() == "torch::autograd::AccumulateGrad"
              and isinstance(node.variable, torch.nn.Parameter)]
    if not leaves:
        return
    own = {id(p) for p in model.parameters()}  # (walked only where the losses reach a parameter at all)
    outside = [p for p in leaves if id(p) not in own]
    if not outside:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in outside[:4]) + (", ..." if len(outside) > 4 else "")
    raise ValueError(
        f"engine.backward(losses): the losses' gradient reaches {len(outside)} trainable parameter(s) outside the "
        f"model given to the engine (shapes {shapes}): they would get the raw, unclipped and un-noised gradient of the "
        "private batch, a non-private release of it. For a module of the loss (an ArcFace or other margin head, a "
        "learnable temperature): make it part of the model given to the engine (it is then clipped and noised with "
        "the rest), or use its parameters detached. For a GAN's generator step through the private discriminator: "
        "back-propagate the generator's loss plainly (g_loss.backward(), or inside engine.paused()): the "
        "discriminator is then a function of the generator's output, not trained. For a discriminator step: detach "
        "the generated samples (D(fake.detach())). Nothing of this backward was accumulated"
    )


def _separable(rows, what) -> bool:
    """A source reached with its rows apart: a model output with its batch rows as they are (row j is loss j's), a
    layer call with one sample per row in any structural layout."""
    if isinstance(what, OutputMark):
        return rows == Rows(what.axis)
    return isinstance(rows, Rows)


def _tag_check(losses, sources: dict, units, generator, passes, stopped_at) -> None:
    GradientEdge = getattr(torch.autograd.graph, "GradientEdge", None)
    if GradientEdge is None:  # torch < 2.3
        raise RuntimeError(
            f"the loss's graph has {stopped_at or 'operations'} between the per-sample losses and the model's outputs, "
            "which the engine checks for coupled samples by back-propagating the loss alone to the outputs: that "
            f"needs torch 2.3 or later (this is {torch.__version__}). Upgrade torch, or use a loss made of row-wise "
            "operations (cross-entropy, squared error, means over the non-batch axes)")

    edges = list(sources)
    count = int(units.max()) + 1 if units is not None and units.numel() else losses.shape[0]
    tags = make_tags(count, generator, passes)
    per_loss = (lambda v: v[units.to(v.device)]) if units is not None else (lambda v: v)
    projections = Projections(int(torch.randint(1 << 31, (1,), generator=generator)))
    dtype = torch.promote_types(losses.dtype, torch.float32)

    def sketches(weights):
        objective = (losses * weights.to(losses.device, dtype)).sum() if weights is not None else losses.sum()
        grads = torch.autograd.grad(objective, [GradientEdge(n, nr) for n, nr in edges], retain_graph=True,
                                    allow_unused=True)
        out = []
        for edge, g in zip(edges, grads):
            mark = sources[edge]
            out.append(None if g is None else (sketch_rows(g.movedim(mark.axis, 0), 1, projections), g.dtype,
                                               tuple(g.movedim(mark.axis, 0).shape)))
            del g
        return out

    # the reference and the tag passes weigh samples of small losses up to the others' scale (reading.even_scales)
    half = any(getattr(what, "precision", None) == torch.float16 for what in sources.values())
    scales = even_scales(losses, torch.float16 if half else None)
    real = sketches(scales)
    if not all(r is None or bool(torch.isfinite(r[0]).all()) for r in real):
        raise NonFiniteRows("the per-sample losses' gradient is inf or NaN where the loss check reads it")
    tagged = [sketches(per_loss(v) if scales is None else per_loss(v).to(scales.device) * scales) for v in tags]
    for k, edge in enumerate(edges):
        what = sources[edge]
        if real[k] is None:
            continue
        eps, rel = tolerance(real[k][1], what.precision, real[k][0].device)
        try:
            rowmap = read_sketches(real[k][0], [t[k][0] for t in tagged], tags, count, real[k][2], 1, eps, rel)
        except RowsMixSamples as err:
            raise _coupled(what, str(err), stopped_at, units is not None) from None
        if not isinstance(what, OutputMark):
            continue  # a layer call: one sample per row, in whatever layout
        if units is None and not (rowmap.identity or rowmap.layout == IDENTITY):
            raise _coupled(what, "its rows reach other samples' losses", stopped_at, False)
        if units is not None:
            expected = units.cpu()
            samples = rowmap.samples if rowmap.samples is not None else torch.arange(count)
            known = samples >= 0
            if samples.numel() != expected.numel() or not bool((samples[known] == expected[known]).all()):
                raise _coupled(what, "its rows reach other users' losses", stopped_at, True)


def _coupled(mark, what: str, stopped_at: str | None, users: bool) -> RowsMixSamples:
    where = f" (the loss's graph has {stopped_at}, which may mix rows)" if stopped_at else ""
    unit = "user" if users else "sample"
    return RowsMixSamples(
        f"the loss couples samples: in {mark.describe()}, {what}{where}. engine.backward(losses) needs each {unit}'s "
        f"loss to depend on that {unit}'s own outputs only; otherwise one {unit} moves the others' clipped gradients "
        "too and the update by more than max_grad_norm. Typical causes: in-batch negatives (InfoNCE, CLIP, triplet "
        "mining), a statistic over the batch inside the loss (a mean or variance of the losses, a softmax over the "
        "batch, a load-balancing loss on batch-averaged router probabilities). Make each loss depend on its own "
        "sample only; where coupled samples belong to one user or group, make that the privacy unit "
        "(privacy_unit='user', engine.backward(losses, users=...)). See docs/sharp-edges.md. Nothing of this "
        "backward was accumulated"
    )
