"""One backward pass and everything it owns.

A ``Backward`` is made by ``engine.backward(losses)``, or when the gradient of a plain
``loss.backward()`` first reaches the model (its output, or a covered layer), and lives until that
backward ends. It owns what one backward captures and derives: its phase, the calls it received
output gradients for, the row-to-sample maps it reads (``rows.BackwardRows``, with the tag passes),
the operands and norms reduced so far, the clipping factors, and one transaction on the step's
clipped sums (``StepSums``). Every exit goes through ``finish`` or ``abort``: an exception anywhere
drops the backward whole, and nothing of it reaches the next.

The stages themselves are ``pipeline``'s (operands → norm stage → clipping factors → gradient
stage); the recipe says which primitive each uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from ..layers.numerics import outside_autocast
from ..layers.protocol import LayerDims
from ..rows import BackwardRows, NonFiniteRows, RowMap, RowReader, describe_layouts, tag_passes
from ..rows.layout import check_source_rows
from ..rows.reading import even_scales
from .algorithms import Grad, Norm, Recipe
from .calls import Call, LayerState, outside_model_call
from .capture import Capture
from .pipeline import (
    Overflow,
    ParamWork,
    ReadyLayer,
    SmallGradients,
    StepSums,
    add_clipped_sums,
    add_second_pass_gradients,
    group_factors,
    layer_decision,
    layer_norms,
    layer_operands,
    parameter_norm,
)
from .planning import LayerDecision
from .precision import LossScaling
from .trainable import TrainableSet


class Phase(Enum):
    """Which backward runs, as the output-gradient hooks need to know."""

    PLAIN = "plain"              # a plain loss.backward(): it ends in the callback queued on the autograd engine
    SINGLE = "single"            # engine.backward, single-backward modes
    FIRST_PASS = "first-pass"    # two-pass modes: the norms
    SECOND_PASS = "second-pass"  # two-pass modes: the re-weighted losses
    DISCARD = "discard"          # an empty batch's backward (FSDP2 ranks keep in step): nothing to record


@dataclass(frozen=True)
class BackwardSetup:
    """What every backward of an engine works with: the recipe's settings and the engine's long-lived parts."""

    recipe: Recipe
    decision_rule: str
    clipping_fn: str
    clipping_gamma: float
    sums: StepSums
    rows: RowReader
    capture: Capture
    #: a GradScaler is in use: non-finite gradients are an overflow to retry or skip, not an error
    overflow_skippable: bool
    loss_divisor: int = 1  # a GradScaler's scaled losses are divided by it (the expected batch size: ``run``)


def needs_tags(trainable: TrainableSet, rows: RowReader) -> bool:
    """Whether a call waiting for its gradient has rows not proven yet (or calls will be recomputed)."""
    return rows.recomputes or any(call.rowmap is None for state in trainable.layers for call in state.calls)


class Backward:
    """One backward (both passes, the tag passes and fp16 retries included); see the module docstring."""

    def __init__(self, setup: BackwardSetup, trainable: TrainableSet, phase: Phase, samples: int | None = None,
                 units: torch.Tensor | None = None, tag_losses: torch.Tensor | None = None,
                 padded: torch.Tensor | None = None):
        self.setup = setup
        self.recipe = setup.recipe
        self.trainable = trainable
        self.phase = phase
        #: engine.backward's number of samples (rows); None on a plain backward (each call's model call says)
        self.samples = samples
        #: privacy_unit="user": each sample's unit (its user, 0..U-1, on the CPU); the clipped unit is the sum of
        #: a unit's samples, whose rows are regrouped like the rows of one sample (rows.RowMap.for_units)
        self.units = units
        self.unit_count = int(units.max()) + 1 if units is not None and units.numel() else 0
        #: the samples this backward brought to the step, on either path (set by ``finish``)
        self.batch = 0
        self.rows = BackwardRows(setup.rows)
        self.rows.per_user = units is not None
        self._ready: dict[int, ReadyLayer] = {}
        self._works: dict[nn.Parameter, ParamWork] = {}
        self._decisions: dict[int, LayerDecision] = {}
        self.decisions: list[LayerDecision] = []  # what each layer did, once the factors are known
        #: calls whose gradients a retry at a smaller loss scale needs again (None: no retry possible)
        self.consumed: list[tuple[LayerState, Call]] | None = None
        #: calls that received an output gradient in the current second (re-weighted) pass
        self.reweighted: list[tuple[LayerState, Call]] = []
        #: the model calls (forward ids) whose layers this backward reduced
        self.forwards: set[int] = set()
        #: a plain backward's graph task (its end-of-backward callback is queued on it)
        self.task = -1
        #: what the tag passes weight instead of the losses (a fixed-shape batch's unmasked losses: its padded rows
        #: then show their layout too)
        self.tag_losses = tag_losses
        #: the padded samples of a fixed-shape batch ([B] bool, on the CPU; None: none): their rows count for nothing,
        #: whatever they hold (a mask sentinel, NaN, inf)
        self.padded = padded
        self.rows.padded = padded
        setup.sums.begin()

    # ------------------------------------------------------------------ engine.backward
    def run(self, losses: torch.Tensor, scaling: LossScaling | None, can_retry: bool, passes: int | None) -> bool:
        """Back-propagate per-sample losses (both passes in the two-pass modes); True if it overflowed and the
        step is skipped.

        Without a GradScaler the objective is ``sum_i L_i``. With one, ``losses`` carry its scale S and the objective
        is their sum over the expected batch size, a constant (a sum alone could overflow). Not their mean: its 1/B
        would be rounded into each sample's fp16 gradient, so every sample's clipped gradient changed with the batch
        size (one of 512 aligned samples moved the sum by over R). Where a scale above the last one that worked
        overflows, the same batch is
        back-propagated again at the scaler's back-off (``can_retry``): finding the scale costs a
        backward, never a skipped step or privacy budget. The graph is kept for that only then.
        """
        divisor = self.setup.loss_divisor
        if scaling is None:
            self._one_backward(losses, 1.0, 1.0, retain=False, passes=passes)
            return False
        scale = scaling.scale()
        attempt = 1.0
        while True:
            try:
                self.consumed = [] if can_retry else None
                self._one_backward(losses, attempt / divisor, scale * attempt / divisor, retain=can_retry,
                                   passes=passes)
                break
            except Overflow:
                if not can_retry or scale * attempt <= 1.0:  # below scale 1 a smaller scale no longer helps
                    return True
                self._reset_for_retry()
                attempt *= scaling.backoff()
            finally:
                self.consumed = None
        scaling.worked(scale, attempt)
        return False

    def _one_backward(self, losses: torch.Tensor, factor: float, kappa: float, retain: bool,
                      passes: int | None) -> None:
        """Back-propagate ``factor * sum_i losses_i``; ``kappa`` is that objective's factor on the true losses.

        First the tag passes that read new patterns' rows: ``passes`` (agreed by every rank), or, in one
        process (None), as many as the batch needs if a call waits with an unread pattern."""
        capture = self.setup.capture
        objective = losses.sum() if factor == 1.0 else (losses * factor).sum()
        if passes is None:
            passes = tag_passes(losses.shape[0]) if needs_tags(self.trainable, self.setup.rows) else 0
        if passes:
            self._tag_pass(losses if self.tag_losses is None else self.tag_losses, factor, passes)
        capture.new_pass()
        if self.recipe.two_pass:
            self._two_pass_backward(losses, objective, factor, kappa)
        else:
            self.phase = Phase.SINGLE
            torch.autograd.backward(objective, retain_graph=retain)
            self.finish(self._clipped_units(losses), 1.0 / kappa)

    def _two_pass_backward(self, losses: torch.Tensor, objective: torch.Tensor, factor: float, kappa: float) -> None:
        """Lee & Kifer: norms from a first backward of sum_i L_i, then back-propagate sum_i C_i L_i.

        Both passes only produce output gradients (ghost differentiation); the second pass's
        parameter gradients (module 2b) are a^T g of its re-weighted output gradients, one
        pass per clipping group. The output gradients of the second pass are those that reach
        a layer call during it: the forward's calls, or their recomputations under activation
        checkpointing.
        """
        capture = self.setup.capture
        self.phase = Phase.FIRST_PASS
        torch.autograd.backward(objective, retain_graph=True)
        factors = self.finish(self._clipped_units(losses), 1.0 / kappa)
        ones = torch.full_like(factors[0], 1.0 / kappa)  # (one per clipped unit: the operands are regrouped so)
        if self.units is not None:  # each sample re-weighted by its user's factor
            factors = [f[self.units.to(f.device)] for f in factors]
        self.phase = Phase.SECOND_PASS
        groups = self.trainable.groups
        for k, params in enumerate(groups):
            capture.new_pass()
            weights = factors[k] if factor == 1.0 else factors[k] * factor
            reweighted = (losses * weights.to(losses.dtype)).sum()
            self.reweighted = []
            torch.autograd.backward(reweighted, retain_graph=k < len(groups) - 1)
            outside_autocast(add_second_pass_gradients, self.setup.sums, self.reweighted, set(params), ones,
                             self._operands, self.trainable.threshold)
            for _, call in self.reweighted:
                call.grad = None
            self.reweighted = []
            self._drop_recomputed()

    def _tag_pass(self, losses: torch.Tensor, factor: float, passes: int) -> None:
        """Back-propagate ``factor * sum_i v_i s_i L_i`` per set of per-sample tags ``v`` (``rows.make_tags``; ``s``:
        ``rows.reading.even_scales``): each call's tagged output gradients show its rows' samples; nothing reduced."""
        dtype, tags = torch.promote_types(losses.dtype, torch.float32), self.setup.rows.new_tags(len(losses), passes)
        scales = even_scales(losses, self.setup.capture.forward_precision)
        if self.tag_losses is not None or scales is not None:  # a reference pass weighted alike (padded rows' layout)
            tags, self.rows.reference_pass = [*tags, torch.ones_like(tags[0])], True
        self.rows.begin_tags(tags)
        assert self.rows.tags is not None  # (begun just above)
        for k, pass_tags in enumerate(self.rows.tags):
            self.rows.tagging, self.rows.tag_pass = True, k
            self.setup.capture.new_pass()
            seeds = pass_tags.to(losses.device) * factor * (1.0 if scales is None else scales)
            try:
                torch.autograd.backward((losses * seeds.to(dtype)).sum(), retain_graph=True)
            finally:
                self.rows.tagging = False

    def tag_plain(self, raw: torch.Tensor, grad: torch.Tensor, axis: int, all_tags: list[torch.Tensor]) -> None:
        """A plain backward's tag passes: the model's output gradient with per-sample tags on its rows
        (``rows.tag_rows``), back-propagated once per set of tags before the real backward goes on."""
        shape = [1] * grad.dim()
        shape[axis] = -1
        if self.rows.tags is not all_tags:
            self.rows.begin_tags(all_tags)
        capture = self.setup.capture
        for k, tags in enumerate(all_tags):
            self.rows.tagging, self.rows.tag_pass = True, k
            capture.new_pass()
            try:
                torch.autograd.backward(raw, grad * tags.to(grad.device, grad.dtype).reshape(shape), retain_graph=True)
            finally:
                self.rows.tagging = False
                capture.new_pass()

    # ------------------------------------------------------------------ output gradients
    def on_output_grad(self, state: LayerState, call: Call, grad: torch.Tensor, done_forwards: set[int]) -> None:
        """A covered layer call received its output gradient."""
        if self.phase is Phase.DISCARD:
            return
        if call.forward_id is not None and call.forward_id in done_forwards:  # (a tag pass too: it comes first)
            raise RuntimeError(
                f"{state.path}: this model call was already back-propagated in this step (one forward, "
                "two backward passes, e.g. two heads' losses back-propagated one after the other, or a backward split "
                "at a detached activation, layers called outside model(...) included): each would be clipped on its "
                "own, so a sample could contribute more than max_grad_norm. Add the losses and back-propagate them "
                "once"
            )
        if self.rows.tagging:
            self.rows.record_tagged(state, call, grad)
            return
        if self.phase is Phase.SECOND_PASS:
            call.grad = grad.detach()
            self.reweighted.append((state, call))
            return
        if self.phase is Phase.PLAIN and call.batch_size is None and not call.recomputed:
            raise outside_model_call(state)
        if not state.calls.holds(call):
            raise RuntimeError(
                f"{state.path}: a layer call received a second output gradient (the same forward was "
                "back-propagated twice, e.g. with retain_graph=True): each sample may enter a step once. Run a new "
                "forward for each backward"
            )
        call.grad = grad.detach()
        state.calls.hold(call)
        if self._can_reduce_now(state):
            self._reduce_layer(state)

    # ------------------------------------------------------------------ stages 1-2
    def _can_reduce_now(self, state: LayerState) -> bool:
        """A layer called once, whose parameters no other layer shares, is reduced as soon as its gradient
        arrives, freeing its activation and output gradient during the backward pass."""
        only = state.calls.only()
        if only is None or only.recomputed:
            # A recomputation (reentrant checkpointing) records its calls during the backward, one checkpoint
            # at a time: more calls of this layer may still come, so it waits for the end of the backward.
            return False
        return id(state) in self.trainable.sole

    def _reduce_layer(self, state: LayerState) -> None:
        """Stages 1-2 of a layer whose parameters no other layer uses (``_can_reduce_now``)."""
        self._prepare_layer(state)  # (it refuses a layer some of whose parameters were reduced already)
        ready = self._ready.pop(id(state), None)  # (book-keeping keeps the operands it needs in its works)
        if ready is None:
            return
        named = [(self.trainable.users[p][0][1], p) for p in state.params.values()]
        works = layer_norms(ready, named, self.recipe, self.setup.decision_rule, self.trainable.group_of)
        for (name, _), (p, work, norm, grad) in zip(named, works):
            self._works[p] = work
            self._decide(ready, name, norm, grad)

    def _row_map(self, state: LayerState, call: Call, batch: int) -> RowMap:
        try:
            rowmap = self.rows.resolve(state, call, batch if self.units is None else self.samples)  # type: ignore[arg-type]  # (units come with engine.backward's samples)
        except NonFiniteRows:
            raise self._non_finite() from None
        if call.source is not None:
            check_source_rows(rowmap, call.grad, f"{state.path} ({type(state.module).__name__})", self.units, call.source)
        if self.padded is not None:  # rows of padding belong to no sample: zeroed before any norm
            rows = call.shape[0] if rowmap.axes == 1 else call.shape[0] * call.shape[1]
            rowmap = rowmap.without(self.padded, rows)
        if self.units is not None:
            rowmap = rowmap.for_units(self.units, self.unit_count, state, call)
        return rowmap

    def _clipped_units(self, losses: torch.Tensor) -> int:
        """How many clipped units the losses hold: samples, or users."""
        return self.unit_count if self.units is not None else losses.shape[0]

    def _batch_of(self, state: LayerState, calls: list[Call]) -> int:
        if self.units is not None:
            return self.unit_count
        sizes = {self.samples if self.samples is not None else c.batch_size for c in calls}
        if len(sizes) > 1:
            raise ValueError(f"module {state.name!r} was called with different batch sizes "
                             f"{sorted(sizes, key=lambda n: -1 if n is None else n)} in one forward")
        batch = sizes.pop()
        if batch is None:
            raise outside_model_call(state)
        return batch

    def _operands(self, state: LayerState, calls: list[Call]) -> tuple[tuple, LayerDims]:
        return layer_operands(state, calls, self._batch_of(state, calls), self._row_map)

    def _prepare_layer(self, state: LayerState) -> None:
        """Operands of all of a layer's calls that received an output gradient, as one call.

        Calls still waiting for their gradient (a later forward whose backward has not run
        yet) stay recorded.
        """
        live = list(state.calls)
        calls = [c for c in live if c.grad is not None]
        state.calls = [c for c in live if c.grad is None]
        if not calls:
            return
        if id(state) in self._ready or any(p in self._works for p in state.params.values()):
            raise RuntimeError(
                f"internal error: calls of {state.name!r} arrived after its per-sample norm was taken in this "
                "backward; nothing was accumulated. Please report this with the model"
            )
        self.forwards.update(c.forward_id for c in calls if c.forward_id is not None)
        if self.consumed is not None:
            self.consumed.extend((state, c) for c in calls)
        batch = self._batch_of(state, calls)
        ops, dims = layer_operands(state, calls, batch, self._row_map)
        layout = describe_layouts(c.rowmap for c in calls)
        if any(c.broadcast for c in calls):
            layout += " (one row broadcast over the batch)"
        if self.units is not None:
            layout = f"per user ({layout} per example)"
        self._ready[id(state)] = ReadyLayer(state, ops, dims, batch, layout)
        for c in calls:  # the operands hold what is needed; a second pass sets new gradients
            c.grad = None
            if not self.recipe.two_pass and self.consumed is None:
                # The graph keeps each call (through its output's hook) until the graph is freed: without a
                # second pass or a retry that needs it again, the call's copy of the input goes now.
                c.activation = None

    def _norm_stage(self, p: nn.Parameter) -> None:
        if p in self._works:
            return
        parts = [(self._ready[id(s)], name) for s, name in self.trainable.users[p] if id(s) in self._ready]
        if not parts:
            return
        work, norm, grad = parameter_norm(p, parts, self.recipe, self.setup.decision_rule,
                                          self.trainable.group_of[p])
        self._works[p] = work
        for ready, n in parts:
            self._decide(ready, n, norm, grad)

    def _decide(self, ready: ReadyLayer, name: str, norm: Norm, grad: Grad) -> None:
        """A layer is described by its weight's decision (or its first parameter's)."""
        if name == "weight" or ("weight" not in ready.state.params and id(ready.state) not in self._decisions):
            self._decisions[id(ready.state)] = layer_decision(ready, norm, grad)

    def _drop_recomputed(self) -> None:
        """Recomputed calls (checkpointing) are used in the backward that made them, or never."""
        for state in self.trainable.layers:
            if any(c.recomputed for c in state.calls):
                state.calls = [c for c in state.calls if not c.recomputed]

    def reduce_all(self, expected: int | None) -> int:
        """Stages 1-2 for every layer still waiting; the batch size every layer (and the losses) agree on."""
        for state in self.trainable.layers:
            if state.calls:
                self._prepare_layer(state)
        for p in self.trainable.users:
            self._norm_stage(p)
        self._ready.clear()
        self._drop_recomputed()
        sizes: dict[str, int] = {}
        for p, work in self._works.items():
            sizes.setdefault(self.trainable.users[p][0][0].name, work.batch_size)
        distinct = set(sizes.values())
        if expected is not None:
            distinct.add(expected)
        if len(distinct) > 1:
            detail = ", ".join(f"{n}: {b}" for n, b in sizes.items())
            raise ValueError(
                f"layers saw different batch sizes ({detail}"
                + (f"; losses: {expected}" if expected is not None else "")
                + "). Every trainable layer must get the batch as its first dimension: an input broadcast over "
                "the batch must be expanded to the batch first (x.expand(B, ...))"
            )
        return distinct.pop() if distinct else 0

    # ------------------------------------------------------------------ stages 3-4
    def _non_finite(self) -> Exception:
        """Inf or NaN in a backward: an ``Overflow`` a GradScaler acts on, or an error."""
        if self.setup.overflow_skippable:
            return Overflow()
        return FloatingPointError(
            "a per-sample gradient norm is inf or NaN (overflow or a NaN in the model): nothing was "
            "accumulated for this batch; check the inputs, the learning rate, or use float32"
        )

    def finish(self, expected_batch: int | None, scale: float) -> list[torch.Tensor]:
        """Clipping factors per group; the single-backward modes then add the clipped sum to the step's sums.

        Non-finite norms raise ``Overflow`` where a GradScaler can act on it, else ``FloatingPointError``. (With autocast
        off, as every piece of the engine's arithmetic: ``numerics.without_autocast``.)
        """
        return outside_autocast(self._finish, expected_batch, scale)

    def _finish(self, expected_batch: int | None, scale: float) -> list[torch.Tensor]:
        try:
            batch = self.batch = self.reduce_all(expected_batch)
            self.rows.check_inputs(", ".join(f"{s.path} ({type(s.module).__name__})" for s in self.trainable.layers[:3])
                                   + (", ..." if len(self.trainable.layers) > 3 else ""))
            small = SmallGradients(self._works)
            factors, finite = group_factors(self._works, small, self.trainable.num_groups, batch, scale,
                                            self.trainable.threshold, self.setup.clipping_fn, self.setup.clipping_gamma)
            # Reading the finiteness waits for the device: where this backward's additions can be undone exactly (the
            # step's first backward, a single one), it is read after they are queued, so that the host stays ahead of
            # the device through them; else (the second pass needs the factors, or sums of an earlier micro-batch
            # would be added to in place) before.
            sums = self.setup.sums
            read_late = not self.recipe.two_pass and not sums.sums
            if not read_late and not finite:
                raise self._non_finite()
            self.decisions = [self._decisions[id(s)] for s in self.trainable.layers if id(s) in self._decisions]
            if not self.recipe.two_pass:
                add_clipped_sums(sums, self._works, small, factors, scale)
            if read_late and not finite:
                assert sums.undoable  # (nothing of an earlier backward was there to add to)
                sums.rollback()  # (nothing of this batch is accumulated)
                raise self._non_finite()
            return factors
        finally:
            self._clear()

    def finish_plain(self, loss_reduction: str, loss_scale: float) -> None:
        """The end of a plain ``loss.backward()`` (its queued callback): factors from the batch it saw."""
        batch = self.reduce_all(expected=None)
        scale = float(batch) if loss_reduction == "mean" else 1.0
        self.finish(batch, scale / loss_scale)

    def commit(self) -> None:
        """The backward completed: what it added to the step's sums stays, whatever happens to a later one."""
        self.setup.sums.commit()

    # ------------------------------------------------------------------ every other exit
    def _reset_for_retry(self) -> None:
        """Give the calls of an overflowed attempt back (their graph is kept) and drop its partial work."""
        for state, call in self.consumed or ():
            if not call.recomputed:
                call.grad = None
                state.calls.append(call)
        self._drop_recomputed()
        self._clear()

    def abort(self) -> None:
        """Drop everything of a failed (or abandoned) backward; the step's earlier sums stay whole.

        A failed graph may outlive the engine's references (the user's tensors, a traceback): the
        activations and gradients are dropped from the calls themselves, so nothing large stays
        reachable from it.
        """
        self.setup.sums.rollback()
        for _, call in (*(self.consumed or ()), *self.reweighted):
            call.activation, call.grad = None, None
        for state in self.trainable.layers:
            for call in state.calls:
                call.activation, call.grad = None, None
            state.calls.clear()
        self.consumed = None
        self.rows.tagging = False
        self._clear()

    def _clear(self) -> None:
        self._ready.clear()
        self._works.clear()
        self._decisions.clear()
        self.reweighted = []
