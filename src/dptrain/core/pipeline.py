"""The stages of one backward pass, stateless, and the clipped sums of one logical step.

Every clipping mode's recipe is four stages, which ``backward.Backward`` runs for each backward:

1. operands   a layer's calls that received their output gradient become one set of operands
              (several calls of one module are joined along the token axis);
2. norm stage per parameter, its per-sample squared norm: ghost norm (module 3) or instantiation
              (module 4), as ``planning.decide_parameter`` chooses; what the gradient stage needs
              is kept (the instantiated gradients for module 5, the operands for 2b(C));
3. factors    per clipping group, the clipping factors from the summed squared norms
              (``clipping_factors_by_group``, plain arithmetic, testable without a model);
4. gradient   the clipped sum into ``StepSums``: module 5 or 2b(C) in the single-backward modes;
              in the two-pass modes ``a^T g`` of the re-weighted second pass's output gradients.

The stages keep nothing: what one backward has reduced so far belongs to its ``Backward``, which
drops it whole on any exit, and ``StepSums`` never keeps part of a micro-batch.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.numerics import accumulation_dtype, float32_at_least, shared_sq_norm
from ..layers.protocol import LayerDims
from ..rows import RowMap
from ..rows.layout import zero_rows
from .algorithms import Grad, GradVia, Norm, NormVia, Recipe
from .calls import Call, LayerState
from .clipping import clipping_factors
from .planning import LayerDecision, decide_parameter, join_dims


class Overflow(Exception):
    """Per-sample norms of a GradScaler-scaled backward are inf/NaN: run it again smaller, or skip the step."""


def clipping_factors_by_group(sq_norms: list[torch.Tensor | None], batch: int, scale: float, threshold: float,
                              fn: str, gamma: float) -> tuple[list[torch.Tensor], torch.Tensor | bool]:
    """(clipping factors per group, whether all norms are finite) from each group's summed squared norms [B].

    ``scale`` multiplies the norms (it removes a loss scale, or the 1/B of a mean loss); a group that no
    layer reached this backward has norm 0. The finiteness is a boolean tensor on the norms' device (True for an
    empty batch): reading it waits for the device, which the caller does as late as it can (``Backward._finish``).
    """
    like = next((sq for sq in sq_norms if sq is not None), None)
    filled = [sq if sq is not None else (like.new_zeros(batch) if like is not None else torch.zeros(batch))
              for sq in sq_norms]
    norms = [torch.sqrt(sq) * scale for sq in filled]
    finite = True if not batch or not norms else torch.stack([torch.isfinite(n).all() for n in norms]).all()
    factors = [clipping_factors(n, threshold, fn, gamma) for n in norms] or [torch.ones(batch)]
    return factors, finite


def summed(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The sum of same-shaped tensors (a group's per-sample squared norms, one per parameter): one stacked sum where
    they share a dtype and device (two kernels, not one per tensor), else added in turn; None for none."""
    if len(tensors) <= 1:
        return tensors[0] if tensors else None
    first = tensors[0]
    if all(t.dtype == first.dtype and t.device == first.device for t in tensors):
        return torch.stack(tensors).sum(0)
    total = first
    for t in tensors[1:]:
        total = total + t
    return total


def sum_dtype(p: nn.Parameter) -> torch.dtype:
    """The dtype of a parameter's clipped sum and its noise: float32, or the parameter's if wider."""
    return accumulation_dtype(p.dtype)


class StepSums:
    """The clipped sums of the logical step so far, one tensor per parameter, in ``sum_dtype(p)``.

    A backward adds into them between ``begin`` and ``commit``; ``rollback`` undoes a backward that
    failed on the way: the tensors it created are dropped, and if it had already added into sums of
    earlier micro-batches (in place, which cannot be undone exactly) the whole step's sums are dropped.
    """

    def __init__(self) -> None:
        self.sums: dict[nn.Parameter, torch.Tensor] = {}
        self._created: set[nn.Parameter] = set()
        self._added = False

    def begin(self) -> None:
        self._created, self._added = set(), False

    def commit(self) -> None:
        """The backward completed: what it added stays, whatever happens to a later one."""
        self._created, self._added = set(), False

    def add(self, p: nn.Parameter, g: torch.Tensor) -> None:
        # Kept in float32 or wider whatever the parameter's dtype: a bf16 sum would round one sample's
        # clipped contribution (norm <= R in float32) to up to 2^-8 above R before the noise is added.
        # The price: a bf16 model's sums take twice the memory of its gradients.
        dtype = sum_dtype(p)
        if g.dtype != dtype:
            g = g.to(dtype)
        summed = self.sums.get(p)
        if summed is None:
            self.sums[p] = g  # always a fresh tensor from the rules or autograd.grad
            self._created.add(p)
        else:
            if p not in self._created:  # (a sum of an earlier backward, changed in place: not undone exactly)
                self._added = True
            summed.add_(g)

    @property
    def undoable(self) -> bool:
        """Whether ``rollback`` would undo this backward's additions exactly (it added to no earlier backward's
        sum)."""
        return not self._added

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
class ReadyLayer:
    """A layer's operands for this backward, all its calls concatenated along the token axis."""

    state: LayerState
    ops: tuple
    dims: LayerDims
    batch_size: int
    layout: str = "identity"  # how its calls' rows map to samples (rows.describe_layouts)


@dataclass
class ParamWork:
    """The norm stage of one parameter in one backward, and what its gradient stage needs."""

    group: int
    batch_size: int
    sq_norm: torch.Tensor | None                        # None: formed with its group's small ones (``SmallGradients``)
    per_sample: torch.Tensor | None                     # kept for module 5
    book: list[tuple[LayerState, str, tuple]]            # kept (layer, name, operands) for module 2b(C)


# ---------------------------------------------------------------------- stage 1: operands
def layer_operands(state: LayerState, calls: list[Call], batch: int,
                   row_map: Callable[[LayerState, Call, int], RowMap]) -> tuple[tuple, LayerDims]:
    """(operands, sizes) of a layer's calls as one call, each call's rows regrouped by sample (``row_map``)."""
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
        rowmap = row_map(state, c, batch)
        assert c.grad is not None  # (a call whose output gradient arrived)
        if rowmap.identity:
            activation, grad = c.activation, c.grad
            if rowmap.dropped is not None:  # a fixed-shape batch's padded rows: nothing of them, whatever they hold
                activation, grad = zero_rows(activation, rowmap.dropped), zero_rows(grad, rowmap.dropped)
            parts.append(rule.operands(module, activation, grad))
            dims.append(c.dims)
        else:
            ops, call_dims = rowmap.regroup(rule, module, c.activation, c.grad)
            parts.append(ops)
            dims.extend(call_dims)
    ops = parts[0] if len(parts) == 1 else rule.concat_calls(parts)
    return ops, join_dims(dims)


# ---------------------------------------------------------------------- stage 2: norms
def parameter_norm(p: nn.Parameter, parts: list[tuple[ReadyLayer, str]], recipe: Recipe, decision_rule: str,
                   group: int, decided: tuple[Norm, Grad] | None = None,
                   instantiated: torch.Tensor | None = None) -> tuple[ParamWork, Norm, Grad]:
    """Per-sample squared norms of one parameter (modules 3/4), keeping what its gradient stage needs.

    A parameter used by several layers (tied weights) sums their per-sample gradients, so its norm
    includes the cross terms: instantiated, or as a ghost norm from the Grams of the layers' weight
    factors. (``decided``, ``instantiated``: the decision and the per-sample gradient ``layer_norms`` already
    made for a parameter of one layer.)
    """
    sizes = {ready.batch_size for ready, _ in parts}
    if len(sizes) > 1:
        raise ValueError(f"layers sharing a parameter saw different batch sizes {sorted(sizes)}")
    first, _ = parts[0]
    if decided is None:
        described = [(n, r.dims, r.state.rule.factorable(r.state.module)) for r, n in parts]
        _, norm_via, grad_via = decide_parameter(recipe, decision_rule, described, tuple(p.shape))
    else:
        norm_via, grad_via = decided
    per_sample = None
    if norm_via is Norm.GHOST:
        if len(parts) == 1:
            sq_norm = first.state.rule.ghost_sq_norm(first.state.module, first.ops)
        else:
            sq_norm = shared_sq_norm([r.state.rule.weight_factors(r.state.module, r.ops) for r, _ in parts])  # type: ignore[misc]  # (ghost: every layer has its factors)
    else:
        per_sample = instantiated
        if per_sample is None:
            for ready, n in parts:
                g = ready.state.rule.per_sample_grads(ready.state.module, ready.ops, {n})[n]
                per_sample = g if per_sample is None else per_sample + g
        assert per_sample is not None  # (one layer at least)
        if grad_via is Grad.BOOK_KEEPING and per_sample.dtype in (torch.float16, torch.bfloat16):
            # The norm is that of the rounded bf16/fp16 per-sample gradients; 2b(C) would form the sum in
            # float32 from the operands, whose exact product may be 2^-8 larger: the kept gradients are the
            # ones the norm measured (as bk-mixopt keeps them, and only where instantiation won on space).
            grad_via = Grad.WEIGHTED_SUM
        if grad_via is Grad.WEIGHTED_SUM and math.prod(per_sample.shape[1:]) <= SMALL_NUMEL:
            sq_norm = None  # (with its group's other small ones, at the end of the backward: SmallGradients)
        else:
            sq_norm = float32_at_least(per_sample).flatten(1).square().sum(1)
    work = ParamWork(
        group=group,
        batch_size=first.batch_size,
        sq_norm=sq_norm,
        per_sample=per_sample if grad_via is Grad.WEIGHTED_SUM else None,
        book=[(r.state, n, r.ops) for r, n in parts] if grad_via is Grad.BOOK_KEEPING else [],
    )
    return work, norm_via, grad_via


def layer_norms(ready: ReadyLayer, named: list[tuple[str, nn.Parameter]], recipe: Recipe, decision_rule: str,
                groups: Mapping[nn.Parameter, int]) -> list[tuple[nn.Parameter, ParamWork, Norm, Grad]]:
    """``parameter_norm`` of each parameter of one layer that no other layer uses (``named``: its name in the layer,
    the parameter), with the per-sample gradients of all those it instantiates from one ``per_sample_grads`` call
    (a norm layer's scale and shift share their normalised input)."""
    rule, module = ready.state.rule, ready.state.module
    factorable = rule.factorable(module)
    decided = {n: decide_parameter(recipe, decision_rule, [(n, ready.dims, factorable)], tuple(p.shape))[1:]
               for n, p in named}
    wanted = {n for n, (norm, _) in decided.items() if norm is not Norm.GHOST}
    grads = rule.per_sample_grads(module, ready.ops, wanted) if len(wanted) > 1 else {}
    return [(p, *parameter_norm(p, [(ready, n)], recipe, decision_rule, groups[p], decided[n], grads.get(n)))
            for n, p in named]


def sq_norm_of(work: ParamWork) -> torch.Tensor:
    """A parameter's per-sample squared norms, also where they were left for ``SmallGradients``."""
    if work.sq_norm is not None:
        return work.sq_norm
    assert work.per_sample is not None  # (left only where it is kept)
    return float32_at_least(work.per_sample).flatten(1).square().sum(1)


def layer_decision(ready: ReadyLayer, norm: Norm, grad: Grad) -> LayerDecision:
    d = ready.dims
    return LayerDecision(ready.state.name, type(ready.state.module).__name__, d.T, d.p, d.d * d.blocks,
                         d.ghost_cost, d.instantiate_cost, norm, grad, ready.layout)


#: a kept per-sample gradient of at most this many numbers per sample (a bias, a norm's scale) has its norm and its
#: clipped sum formed with the other small ones of its group (``SmallGradients``): a model's biases and norms are
#: most of its parameters and little of its size, and one operation for them all replaces a few for each
SMALL_NUMEL = 1 << 16


class SmallGradients:
    """The kept per-sample gradients whose norm was left for the end of the backward (``ParamWork.sq_norm`` None),
    joined per clipping group, device and accumulation dtype into one ``[B, n]`` matrix: one operation gives their
    per-sample squared norms, one their clipped sum (module 5), which is then split back into the parameters. The
    matrix is as large as the gradients it joins, all small by ``SMALL_NUMEL``."""

    def __init__(self, works: dict[nn.Parameter, ParamWork]):
        joined: dict[tuple, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for p, work in works.items():
            if work.sq_norm is None:
                g = work.per_sample
                assert g is not None  # (left for here only where it is kept)
                dtype = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
                joined.setdefault((work.group, g.device, dtype), []).append((p, g))
        self.joined = [(key[0], items, torch.cat([g.flatten(1) for _, g in items], 1).to(key[2]))
                       for key, items in joined.items()]

    def sq_norms(self) -> list[tuple[int, torch.Tensor]]:
        """(group, the per-sample squared norms of its small gradients) for each joined matrix."""
        return [(group, flat.square().sum(1)) for group, _, flat in self.joined]

    def add_clipped(self, sums: StepSums, factors: list[torch.Tensor]) -> None:
        """Module 5 for every small gradient: ``sum_i C_i g_i`` of each matrix, split into its parameters."""
        for group, items, flat in self.joined:
            total = factors[group].to(flat.dtype) @ flat
            for (p, g), part in zip(items, total.split([math.prod(g.shape[1:]) for _, g in items])):
                sums.add(p, part.view(g.shape[1:]))


# ---------------------------------------------------------------------- stage 3: the factors
def group_factors(works: dict[nn.Parameter, ParamWork], small: SmallGradients, groups: int, batch: int, scale: float,
                  threshold: float, fn: str, gamma: float) -> tuple[list[torch.Tensor], torch.Tensor | bool]:
    """``clipping_factors_by_group`` of a backward's parameters' per-sample squared norms, summed per group (the small
    gradients' with them)."""
    parts: list[list[torch.Tensor]] = [[] for _ in range(groups)]
    for work in works.values():
        if work.sq_norm is not None:
            parts[work.group].append(work.sq_norm)
    for group, sq_norm in small.sq_norms():
        parts[group].append(sq_norm)
    return clipping_factors_by_group([summed(sq) for sq in parts], batch, scale, threshold, fn, gamma)


# ---------------------------------------------------------------------- stage 4: the clipped sum
def add_clipped_sums(sums: StepSums, works: dict[nn.Parameter, ParamWork], small: SmallGradients,
                     factors: list[torch.Tensor], scale: float) -> None:
    """Module 5 or 2b(C) for every parameter of a backward of a single-backward mode."""
    scaled = [f * scale if scale != 1.0 else f for f in factors]  # (once per group, not per parameter)
    for p, work in works.items():
        add_clipped_gradient(sums, p, work, scaled[work.group])
    small.add_clipped(sums, scaled)


def add_clipped_gradient(sums: StepSums, p: nn.Parameter, work: ParamWork, factor: torch.Tensor) -> None:
    """Module 5 (weighted sum of kept per-sample gradients) or 2b(C) (book-keeping) for one parameter; not for the
    small ones left to ``SmallGradients``."""
    if work.sq_norm is None:
        return
    if work.per_sample is not None:  # factors stay float32: rounding them to bf16 would exceed R by 2^-8
        per_sample = float32_at_least(work.per_sample)
        sums.add(p, torch.tensordot(factor.to(per_sample.dtype), per_sample, dims=1))
    for state, name, ops in work.book:
        sums.add(p, state.rule.clipped_grads(state.module, ops, {name: factor})[name])


def add_second_pass_gradients(sums: StepSums, reweighted: list[tuple[LayerState, Call]], params: set[nn.Parameter],
                              ones: torch.Tensor, operands: Callable[[LayerState, list[Call]], tuple[tuple, LayerDims]],
                              threshold: float | None = None) -> None:
    """Module 2b of the re-weighted pass: ``a^T g`` of the calls that received its output gradients.

    ``ones`` (1 / the objective's loss scale, per sample) weights each sample. With ``threshold`` (the group's),
    a low-precision second pass is clipped once more (``second_pass_caps``).
    """
    by_layer: dict[int, tuple[LayerState, list[Call]]] = {}
    for state, call in reweighted:
        by_layer.setdefault(id(state), (state, []))[1].append(call)
    layers = []
    for state, calls in by_layer.values():
        names = {name: p for name, p in state.params.items() if p in params}
        if names:
            layers.append((state, calls, names))
    factor = ones
    low = any(c.grad is not None and c.grad.dtype in (torch.float16, torch.bfloat16) for _, calls, _ in layers
              for c in calls)
    if threshold is not None and low:
        factor = ones * second_pass_caps(layers, ones, threshold, operands)
    for state, calls, names in layers:  # operands once per layer, every parameter of the group at once
        grads = state.rule.clipped_grads(state.module, operands(state, calls)[0], {name: factor for name in names})
        for name, p in names.items():
            sums.add(p, grads[name])


def second_pass_caps(layers: list[tuple[LayerState, list[Call], dict[str, nn.Parameter]]], ones: torch.Tensor,
                     threshold: float, operands: Callable[[LayerState, list[Call]], tuple[tuple, LayerDims]]
                     ) -> torch.Tensor:
    """Per sample, ``min(1, threshold / ||h_i||)`` for ``h_i`` the sample's re-weighted gradient in this group.

    The second backward re-derives each output gradient from ``C_i L_i``: in bf16/fp16 it is not exactly
    ``C_i`` times the first pass's, and one sample's contribution came out up to ~2^-8 above the threshold.
    Its norm, taken from the very operands the gradient is formed from (the ghost norm where the rule has one:
    both are float32 products of the same low-precision operands), bounds it again; a sample within the
    threshold keeps factor 1 exactly. The cost, only in low precision: a second norm stage per group, one
    layer's operands at a time (a tied weight's layers together), formed again for the gradient stage.
    """
    users: dict[nn.Parameter, int] = {}
    for _, _, names in layers:
        for p in names.values():
            users[p] = users.get(p, 0) + 1
    shared: dict[nn.Parameter, list[tuple[ReadyLayer, str]]] = {}
    sq = torch.zeros_like(ones, dtype=accumulation_dtype(ones.dtype))
    for state, calls, names in layers:
        ops, dims = operands(state, calls)
        ready = ReadyLayer(state, ops, dims, ones.shape[0])
        for name, p in names.items():
            if users[p] > 1:  # a weight tied between layers: one norm with its cross terms, below
                shared.setdefault(p, []).append((ready, name))
            else:
                sq = sq + sq_norm_of(parameter_norm(p, [(ready, name)], _CONSISTENT_NORM, "space", 0)[0])
    for p, parts in shared.items():
        sq = sq + sq_norm_of(parameter_norm(p, parts, _CONSISTENT_NORM, "space", 0)[0])
    return clipping_factors(torch.sqrt(sq) * ones.to(sq.dtype), threshold, "abadi", 0.0)


# The norm of the second-pass recheck: the ghost norm wherever the rule has one (see second_pass_caps).
_CONSISTENT_NORM = Recipe(NormVia.GHOST, GradVia.SECOND_PASS)
