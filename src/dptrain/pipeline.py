"""The work of one backward pass, and the clipped sums of one logical step.

The engine's recipe for every clipping mode runs here, per backward, in four stages:

1. operands   a layer's calls that received their output gradient become one set of operands
              (several calls of one module are joined along the token axis);
2. norm stage per parameter, its per-sample squared norm: ghost norm (module 3) or instantiation
              (module 4), as ``planning.decide_parameter`` chooses; what the gradient stage needs
              is kept (the instantiated gradients for module 5, the operands for 2b(C));
3. factors    per clipping group, the clipping factors from the summed squared norms
              (``clipping_factors_by_group``, plain arithmetic, testable without a model);
4. gradient   the clipped sum into ``StepSums``: module 5 or 2b(C) in the single-backward modes;
              in the two-pass modes ``a^T g`` of the re-weighted second pass's output gradients.

Everything here belongs to one backward: ``abort`` drops it whole, and ``StepSums`` never keeps
part of a micro-batch.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .algorithms import Grad, Norm, Recipe
from .capture import Call, LayerState, outside_model_call
from .clipping import clipping_factors
from .layers.numerics import float32_at_least, shared_sq_norm
from .layers.protocol import LayerDims
from .planning import LayerDecision, decide_parameter, join_dims
from .rows import NonFiniteRows, RowReader


class Overflow(Exception):
    """Per-sample norms of a GradScaler-scaled backward are inf/NaN: run it again smaller, or skip the step."""


def clipping_factors_by_group(sq_norms: list[torch.Tensor | None], batch: int, scale: float, threshold: float,
                              fn: str, gamma: float) -> tuple[list[torch.Tensor], bool]:
    """(clipping factors per group, all norms finite) from each group's summed squared norms [B].

    ``scale`` multiplies the norms (it removes a loss scale, or the 1/B of a mean loss); a group that no
    layer reached this backward has norm 0. One host-device synchronisation for the finiteness check.
    """
    like = next((sq for sq in sq_norms if sq is not None), None)
    filled = [sq if sq is not None else (like.new_zeros(batch) if like is not None else torch.zeros(batch))
              for sq in sq_norms]
    norms = [torch.sqrt(sq) * scale for sq in filled]
    finite = not batch or not norms or bool(torch.stack([torch.isfinite(n).all() for n in norms]).all())
    factors = [clipping_factors(n, threshold, fn, gamma) for n in norms] or [torch.ones(batch)]
    return factors, finite


class StepSums:
    """The clipped sums of the logical step so far, one tensor per parameter.

    A backward adds into them between ``begin`` and ``commit``; ``rollback`` undoes a backward that
    failed on the way: the tensors it created are dropped, and if it had already added into sums of
    earlier micro-batches (in place, which cannot be undone exactly) the whole step's sums are dropped.
    """

    def __init__(self):
        self.sums: dict[nn.Parameter, torch.Tensor] = {}
        self._created: list[nn.Parameter] = []
        self._added = False

    def begin(self) -> None:
        self._created, self._added = [], False

    def commit(self) -> None:
        """The backward completed: what it added stays, whatever happens to a later one."""
        self._created, self._added = [], False

    def add(self, p: nn.Parameter, g: torch.Tensor) -> None:
        g = g.to(p.dtype)
        summed = self.sums.get(p)
        if summed is None:
            self.sums[p] = g  # always a fresh tensor from the rules or autograd.grad
            self._created.append(p)
        else:
            self._added = True
            summed.add_(g)

    def rollback(self) -> None:
        if self._added:
            self.sums.clear()
            warnings.warn("a backward failed while its clipped gradients were being added to the step's sums: the "
                          "sums of this logical step were dropped as a whole (the step still adds noise)",
                          stacklevel=4)
        else:
            for p in self._created:
                self.sums.pop(p, None)
        self.begin()

    def pop(self, p: nn.Parameter) -> torch.Tensor | None:
        return self.sums.pop(p, None)

    def clear(self) -> None:
        self.sums.clear()
        self.begin()


@dataclass
class _ReadyLayer:
    """A layer's operands for this backward, all its calls concatenated along the token axis."""

    state: LayerState
    ops: tuple
    dims: LayerDims
    batch_size: int


@dataclass
class _ParamWork:
    """The norm stage of one parameter in one backward, and what its gradient stage needs."""

    group: int
    batch_size: int
    sq_norm: torch.Tensor
    per_sample: torch.Tensor | None                     # kept for module 5
    book: list[tuple[LayerState, str, tuple]]            # kept (layer, name, operands) for module 2b(C)


class BackwardPipeline:
    """Operands, norm stage, factors and gradient stage of one backward (see the module docstring)."""

    def __init__(self, recipe: Recipe, decision_rule: str, clipping_fn: str, clipping_gamma: float,
                 sums: StepSums, rows: RowReader):
        self.recipe = recipe
        #: which sample each row of a call belongs to (read, or cached per pattern)
        self.rows = rows
        #: the number of samples of the running backward (engine.backward's losses), or None: each call's model call
        self.decision_rule = decision_rule
        self.clipping_fn = clipping_fn
        self.clipping_gamma = clipping_gamma
        self.sums = sums
        self.samples: int | None = None
        #: a GradScaler is in use: non-finite gradients are an overflow to retry or skip, not an error
        self.overflow_skippable = False
        self.layers: list[LayerState] = []
        self.users: dict[nn.Parameter, list[tuple[LayerState, str]]] = {}
        self.group_of: dict[nn.Parameter, int] = {}
        self.num_groups = 0
        self.threshold = 1.0
        self._ready: dict[int, _ReadyLayer] = {}
        self._works: dict[nn.Parameter, _ParamWork] = {}
        self._decisions: dict[int, LayerDecision] = {}
        self.last_decisions: list[LayerDecision] = []
        #: calls whose gradients a retry at a smaller loss scale needs again (None: no retry possible)
        self.consumed: list[tuple[LayerState, Call]] | None = None
        #: calls that received an output gradient in the current second (re-weighted) pass
        self.reweighted: list[tuple[LayerState, Call]] = []
        #: the model calls (forward ids) whose layers this backward reduced
        self.forwards: set[int] = set()

    def set_layers(self, layers, users, group_of, num_groups: int, threshold: float) -> None:
        self.layers, self.users, self.group_of = layers, users, group_of
        self.num_groups, self.threshold = num_groups, threshold

    # ------------------------------------------------------------------ stage 1: operands
    def can_reduce_now(self, state: LayerState) -> bool:
        """A layer called once, whose parameters no other layer shares, is reduced as soon as its gradient
        arrives, freeing its activation and output gradient during the backward pass."""
        if len(state.calls) != 1 or state.calls[0].recomputed:
            # A recomputation (reentrant checkpointing) records its calls during the backward, one checkpoint
            # at a time: more calls of this layer may still come, so it waits for the end of the backward.
            return False
        return not any(len(self.users[p]) > 1 for p in state.params.values())

    def reduce_layer(self, state: LayerState) -> None:
        self.prepare_layer(state)
        for p in state.params.values():
            self.norm_stage(p)
        if all(p in self._works for p in state.params.values()):  # book-keeping keeps its own operands
            self._ready.pop(id(state), None)

    def prepare_layer(self, state: LayerState) -> None:
        """Operands of all of a layer's calls that received an output gradient, as one call.

        Calls still waiting for their gradient (a later forward whose backward has not run
        yet) stay recorded.
        """
        calls = [c for c in state.calls if c.grad is not None]
        state.calls = [c for c in state.calls if c.grad is None]
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
        ops, dims, batch = self.operands_and_dims(state, calls)
        self._ready[id(state)] = _ReadyLayer(state, ops, dims, batch)
        for c in calls:  # the operands hold what is needed; a second pass sets new gradients
            c.grad = None
            if not self.recipe.two_pass and self.consumed is None:
                # The graph keeps each call (through its output's hook) until the graph is freed: without a
                # second pass or a retry that needs it again, the call's copy of the input goes now.
                c.activation = None

    def operands(self, state: LayerState, calls: list[Call]) -> tuple:
        return self.operands_and_dims(state, calls)[0]

    def operands_and_dims(self, state: LayerState, calls: list[Call]) -> tuple[tuple, LayerDims, int]:
        """(operands, sizes, samples) of a layer's calls as one call, each call's rows regrouped by sample."""
        sizes = {self.samples if self.samples is not None else c.batch_size for c in calls}
        if len(sizes) > 1:
            raise ValueError(f"module {state.name!r} was called with different batch sizes {sorted(sizes)} in one forward")
        batch = sizes.pop()
        if batch is None:
            raise outside_model_call(state)
        # With ghost differentiation autograd does not save a layer's input, so its own check
        # for inputs modified in place cannot fire: this one does.
        if any(c.version is not None and c.activation._version != c.version for c in calls):
            raise RuntimeError(
                f"the input of {state.name!r} ({type(state.module).__name__}) was modified in place after the "
                "layer used it (e.g. `h += layer(h)`), so its per-sample gradients cannot be computed: "
                "use an out-of-place operation (`h = h + layer(h)`)"
            )
        rule, module = state.rule, state.module
        parts, dims = [], []
        for c in calls:
            try:
                rowmap = self.rows.resolve(state, c, batch)
            except NonFiniteRows:
                raise self._non_finite() from None
            if rowmap.identity:
                parts.append(rule.operands(module, c.activation, c.grad))
                dims.append(c.dims)
            else:
                ops, call_dims = rowmap.regroup(rule, module, c.activation, c.grad)
                parts.append(ops)
                dims.extend(call_dims)
        ops = parts[0] if len(parts) == 1 else rule.concat_calls(parts)
        return ops, join_dims(dims), batch

    def drop_recomputed(self) -> None:
        """Recomputed calls (checkpointing) are used in the backward that made them, or never."""
        for state in self.layers:
            if any(c.recomputed for c in state.calls):
                state.calls = [c for c in state.calls if not c.recomputed]

    # ------------------------------------------------------------------ stage 2: norms
    def norm_stage(self, p: nn.Parameter) -> None:
        """Per-sample squared norms of one parameter (modules 3/4), keeping what its gradient stage needs.

        A parameter used by several layers (tied weights) sums their per-sample gradients, so
        its norm includes the cross terms: instantiated, or as a ghost norm from the Grams of
        the layers' weight factors.
        """
        if p in self._works:
            return
        parts = [(self._ready[id(s)], name) for s, name in self.users[p] if id(s) in self._ready]
        if not parts:
            return
        sizes = {ready.batch_size for ready, _ in parts}
        if len(sizes) > 1:
            raise ValueError(f"layers sharing a parameter saw different batch sizes {sorted(sizes)}")
        first, name = parts[0]
        described = [(n, r.dims, r.state.rule.factorable(r.state.module)) for r, n in parts]
        _, norm_via, grad_via = decide_parameter(self.recipe, self.decision_rule, described, tuple(p.shape))

        per_sample = None
        if norm_via is Norm.GHOST:
            if len(parts) == 1:
                sq_norm = first.state.rule.ghost_sq_norm(first.state.module, first.ops)
            else:
                sq_norm = shared_sq_norm([r.state.rule.weight_factors(r.state.module, r.ops) for r, _ in parts])
        else:
            for ready, n in parts:
                g = ready.state.rule.per_sample_grads(ready.state.module, ready.ops, {n})[n]
                per_sample = g if per_sample is None else per_sample + g
            sq_norm = float32_at_least(per_sample).flatten(1).square().sum(1)
        self._works[p] = _ParamWork(
            group=self.group_of[p],
            batch_size=first.batch_size,
            sq_norm=sq_norm,
            per_sample=per_sample if grad_via is Grad.WEIGHTED_SUM else None,
            book=[(r.state, n, r.ops) for r, n in parts] if grad_via is Grad.BOOK_KEEPING else [],
        )
        for ready, n in parts:  # a layer is described by its weight's decision (or its first parameter's)
            if n == "weight" or ("weight" not in ready.state.params and id(ready.state) not in self._decisions):
                d = ready.dims
                self._decisions[id(ready.state)] = LayerDecision(
                    ready.state.name, type(ready.state.module).__name__, d.T, d.p, d.d * d.blocks,
                    d.ghost_cost, d.instantiate_cost, norm_via, grad_via,
                )

    def reduce_all(self, expected: int | None) -> int:
        """Stages 1-2 for every layer still waiting; the batch size every layer (and the losses) agree on."""
        for state in self.layers:
            if state.calls:
                self.prepare_layer(state)
        for p in self.users:
            self.norm_stage(p)
        self._ready.clear()
        self.drop_recomputed()
        sizes = {}
        for p, work in self._works.items():
            sizes.setdefault(self.users[p][0][0].name, work.batch_size)
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

    # ------------------------------------------------------------------ stages 3-4: factors, clipped sum
    def _non_finite(self) -> Exception:
        """Inf or NaN in a backward: an ``Overflow`` a GradScaler acts on, or an error."""
        if self.overflow_skippable:
            return Overflow()
        return FloatingPointError(
            "a per-sample gradient norm is inf or NaN (overflow or a NaN in the model): nothing was "
            "accumulated for this batch; check the inputs, the learning rate, or use float32"
        )

    def finish(self, expected_batch: int | None, scale: float) -> list[torch.Tensor]:
        """Clipping factors per group; the single-backward modes then add the clipped sum to the step's sums.

        Non-finite norms raise ``Overflow`` where a GradScaler can act on it, else ``FloatingPointError``.
        """
        try:
            batch = self.reduce_all(expected_batch)
            group_sq: list[torch.Tensor | None] = [None] * self.num_groups
            for work in self._works.values():
                k = work.group
                group_sq[k] = work.sq_norm if group_sq[k] is None else group_sq[k] + work.sq_norm
            factors, finite = clipping_factors_by_group(group_sq, batch, scale, self.threshold, self.clipping_fn,
                                                        self.clipping_gamma)
            if not finite:
                raise self._non_finite()
            self.last_decisions = [self._decisions[id(s)] for s in self.layers if id(s) in self._decisions]
            if not self.recipe.two_pass:
                self.sums.begin()
                for p, work in self._works.items():
                    self._gradient_stage(p, work, factors[work.group] * scale)
                self.sums.commit()
            return factors
        finally:
            self._works.clear()
            self._decisions.clear()
            self._ready.clear()

    def _gradient_stage(self, p: nn.Parameter, work: _ParamWork, factor: torch.Tensor) -> None:
        """Module 5 (weighted sum of kept per-sample gradients) or 2b(C) (book-keeping) for one parameter."""
        if work.per_sample is not None:  # factors stay float32: rounding them to bf16 would exceed R by 2^-8
            per_sample = float32_at_least(work.per_sample)
            self.sums.add(p, torch.tensordot(factor.to(per_sample.dtype), per_sample, dims=1))
        for state, name, ops in work.book:
            self.sums.add(p, state.rule.clipped_grads(state.module, ops, {name: factor})[name])

    def second_pass_gradients(self, params: list[nn.Parameter], ones: torch.Tensor) -> None:
        """Module 2b of the re-weighted pass: ``a^T g`` of the calls that received its output gradients."""
        by_layer: dict[int, tuple[LayerState, list[Call]]] = {}
        for state, call in self.reweighted:
            by_layer.setdefault(id(state), (state, []))[1].append(call)
        wanted = set(params)
        for state, calls in by_layer.values():  # operands once per layer, every parameter of the group at once
            names = {name: p for name, p in state.params.items() if p in wanted}
            if names:
                ops = self.operands(state, calls)
                grads = state.rule.clipped_grads(state.module, ops, {name: ones for name in names})
                for name, p in names.items():
                    self.sums.add(p, grads[name])
        for _, call in self.reweighted:
            call.grad = None
        self.reweighted = []
        self.drop_recomputed()

    # ------------------------------------------------------------------ every other exit
    def reset_for_retry(self) -> None:
        """Give the calls of an overflowed attempt back (their graph is kept) and drop its partial work."""
        for state, call in self.consumed or ():
            if not call.recomputed:
                call.grad = None
                state.calls.append(call)
        self.drop_recomputed()
        self.clear()

    def abort(self) -> None:
        """Drop everything of a failed (or abandoned) forward/backward; the step's earlier sums stay whole.

        A failed graph may outlive the engine's references (the user's tensors, a traceback): the
        activations and gradients are dropped from the calls themselves, so nothing large stays
        reachable from it.
        """
        self.sums.rollback()
        for _, call in (*(self.consumed or ()), *self.reweighted):
            call.activation, call.grad = None, None
        for state in self.layers:
            for call in state.calls:
                call.activation, call.grad = None, None
        self.consumed = None
        self.forget_calls()

    def forget_calls(self) -> None:
        for s in self.layers:
            s.calls.clear()
        self.clear()

    def clear(self) -> None:
        self._ready.clear()
        self._works.clear()
        self._decisions.clear()
        self.reweighted = []
        self.forwards = set()
