"""The per-sample fallback: exact per-sample gradients for any module that has no rule.

A module with trainable parameters of its own and no registered rule (a subclass that
overrides ``forward``, a module that uses a parameter directly, ``x * self.scale``, a layer
from a library released after this one) keeps each call whole: its arguments (the batched
tensors detached) and, in the backward, its output gradient ``g``. The per-sample gradients
of the module's *own* parameters then come from ``torch.func``: a ``vmap`` over the batch of
the ``vjp`` of the replayed call with respect to those parameters, with cotangent ``g_i``.
Children take part in the replay as they are (their parameters used, not differentiated:
their own rules handle them).

An output that is a container (tuple, list, dict, Hugging Face ``ModelOutput``: anything
``torch.utils._pytree`` flattens) is differentiated through its floating-point leaves that depend
on those parameters (``capture_leaves``; the engine hands the call their gradients joined per row,
zeros for a leaf the loss does not use): ``g_i`` is cut into the leaves' cotangents.

This is instantiation only (modules 4 + 5 of the book-keeping paper): it costs one more
forward of the module per call, vectorised over the batch, and a per-sample gradient of
each of its own parameters (``B x`` their size), never a ghost norm.

A replay is only exact when the module treats samples independently. On the first call per
module, input shapes and mode the rule checks this twice and refuses otherwise: it perturbs
one sample's input and checks that no other sample's output moves (and that the replay
reproduces the recorded output at all, which random operations such as dropout break), and
it checks that the per-sample gradients sum to the gradient of the whole batch.

A call whose rows are not the samples in order (windows or tokens folded into the batch, as window attention
calls its modules on ``[B * windows, N, d]``) is regrouped by ``FallbackRule.regroup_call`` with the sample of
each row (read by ``dptrain.rows``): each sample's rows are replayed alone, as the sample's own forward calls the
module. The check above then perturbs one row of the call.
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import enum
import functools
import inspect
import itertools
import math
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..checks import first_line
from .numerics import autocast_state, close, scale_samples, swap01, weighted_sum
from .protocol import LayerDims, LayerRule, OutputLeaves
from .registry import container_params, reads_child_params

_state = threading.local()


@contextmanager
def replaying():
    """Marks a replay of a recorded call: capture hooks must neither switch parameters nor record calls."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_replay() -> bool:
    """True while the fallback (or a recognised norm's check) replays a module call."""
    return getattr(_state, "depth", 0) > 0


class _Bypass(nn.Module):
    """Calls ``target.forward`` directly, so the target's own hooks (the engine's) do not run on a replay."""

    def __init__(self, target: nn.Module):
        super().__init__()
        self.target = target

    def forward(self, args, kwargs):
        return self.target.forward(*args, **kwargs)


def replay(module: nn.Module, args: tuple, kwargs: dict, params: dict[str, torch.Tensor] | None = None):
    """``module(*args, **kwargs)`` with its own parameters replaced by ``params`` (name -> tensor).

    Every other parameter of the subtree enters detached (the replay differentiates only
    ``params``); buffers enter as copies, so a forward that updates them in place (running
    statistics) leaves the module as it was. It runs in an empty ``contextvars`` context, so that
    state a library keeps per model call in context variables does not record it.

    Each tensor *slot* (a module object and the attribute name it keeps the tensor under) is
    swapped once, whatever the number of names it answers to: a submodule registered under two
    names (timm's CoaT keeps one conv at the root and inside a block) has one slot per tensor, and
    swapping it under both names would restore it wrong (the second swap saves the first one's
    stand-in as the "original", which then stays in the module in place of the user's parameter).
    A parameter of ``params`` is substituted in its own slot only; where the same parameter is also
    registered on a descendant, that descendant's slot enters detached (its own rule handles it).
    """
    params = params or {}
    own: dict[tuple[int, str], torch.Tensor] = {}  # (id of the owning module, local name) -> replacement
    for name, tensor in params.items():
        path, _, leaf = name.rpartition(".")
        own[(id(module.get_submodule(path)), leaf)] = tensor
    swapped: dict[str, torch.Tensor] = {}
    for prefix, owner in module.named_modules(remove_duplicate=True):  # each module object once
        dotted = f"target.{prefix}." if prefix else "target."
        for leaf, p in owner._parameters.items():
            if p is not None:
                swapped[dotted + leaf] = own.get((id(owner), leaf), p.detach())
        for leaf, b in owner._buffers.items():
            if b is not None:
                swapped[dotted + leaf] = b.clone()
    # In an empty context: what a library keeps per model call in context variables (Hugging Face's collector of
    # hidden states, which its layers' hooks append to) does not see the replay's calls of the children.
    with replaying():
        return contextvars.Context().run(torch.func.functional_call, _Bypass(module), swapped, (args, kwargs),
                                         tie_weights=False)


def autograd_vjp(fn, primals: dict[str, torch.Tensor]):
    """``torch.func.vjp(fn, primals)`` through plain autograd: (output, pullback), the pullback giving
    ``({name: gradient},)`` (zeros for a parameter the output does not depend on) and callable more than once.

    For the replays that run outside a ``vmap`` (one sample at a time, the checks, the second pass): plain autograd
    runs what functorch's transforms cannot (a custom ``autograd.Function`` without ``setup_context``, as routers
    written for torch < 2.0 are), and nothing else differs (the other parameters enter the replay detached)."""
    leaves = {n: p.detach().requires_grad_(True) for n, p in primals.items()}
    with torch.enable_grad():
        out = fn(leaves)

    def pullback(cotangent):
        outs, cots = [], []
        for o, c in zip(pytree.tree_leaves(out), pytree.tree_leaves(cotangent)):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                outs.append(o)
                cots.append(c)
        got = torch.autograd.grad(outs, list(leaves.values()), cots, retain_graph=True, allow_unused=True) \
            if outs else [None] * len(leaves)
        return ({n: torch.zeros_like(p) if t is None else t for (n, p), t in zip(leaves.items(), got)},)

    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), pullback


@dataclass
class FallbackCall:
    """One recorded call: its arguments as a flat list of leaves (``spec`` rebuilds args and kwargs)."""

    leaves: list
    spec: Any
    batched: list[int]            # positions of the leaves that carry the batch in dim 0
    batch: int
    versions: list[tuple[int, int]]  # (leaf position, version counter) of the tensor leaves
    autocast: tuple[str, bool, torch.dtype]
    signature: tuple
    #: the samples are segments of a flat input, not a dimension of the arguments (an EmbeddingBag's bags
    #: given as 1-D ids with offsets): each sample's arguments are cut out of the call (``bag_arguments``)
    bags: bool = False
    #: a container output (tuple, dict, ModelOutput): the leaves replayed and differentiated; None: a tensor output
    outputs: OutputLeaves | None = None
    #: the batch axis of each leaf in ``batched`` where the call's batch is not its arguments' first axis (a module
    #: run sequence-first in a batch-first model), found and verified by ``FallbackRule._batch_axes``; None: axis 0
    axes: list[int] | None = None
    #: one row broadcast over the batch (``expand_batch``): each sample's rows are that row
    broadcast: bool = False
    #: positions of the leaves that are objects the call may change (``FallbackRule.before_call``), copied per replay
    objects: list[int] = field(default_factory=list)
    #: positions of the tensor leaves that required grad in the call (activations, not tables or masks)
    differentiable: frozenset[int] = frozenset()

    def arguments(self, replaced: dict[int, torch.Tensor] | None = None) -> tuple[tuple, dict]:
        """The call's arguments for a replay: ``replaced`` put in, and each object the call may change (a cache of
        keys and values the module adds its own to, kept as it was before the call) copied, its tensors detached,
        so that a replay changes neither the user's object nor the one kept for the next replay."""
        leaves = list(self.leaves)
        for k in self.objects:
            leaves[k] = _snapshot(leaves[k])
        for k, t in (replaced or {}).items():
            leaves[k] = t
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass
class FoldedRows:
    """A recorded call whose rows are not the samples in order (windows or tokens folded into the batch, rows
    reordered or routed), with its output gradient and the sample of each row (``dptrain.rows``)."""

    call: FallbackCall
    grad: torch.Tensor
    samples: torch.Tensor  # long, on the CPU: the sample of each row, -1 for a row with no gradient
    batch: int

    def chunks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, counts): the rows that have a sample, sample by sample and in the call's order within each
        sample, and how many rows each sample has."""
        known = self.samples >= 0
        key = torch.where(known, self.samples, torch.full_like(self.samples, self.batch))
        rows = torch.sort(key, stable=True).indices[: int(known.sum())]
        return rows, torch.bincount(self.samples[known], minlength=self.batch)[: self.batch]

    def row_factors(self, factor: torch.Tensor) -> torch.Tensor:
        """Each row's sample's factor (``factor[samples[r]]``; 0 for a row with no sample)."""
        samples = self.samples.to(factor.device)
        known = samples >= 0
        return torch.where(known, factor[samples.clamp(min=0)], torch.zeros((), dtype=factor.dtype,
                                                                             device=factor.device))


@dataclass
class FallbackOperands:
    """The calls of one module in one backward with their output gradients; per-sample gradients once formed."""

    calls: list[tuple[FallbackCall, torch.Tensor]]
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)
    #: calls whose rows were regrouped by sample (``FallbackRule.regroup_call``)
    folded: list[FoldedRows] = field(default_factory=list)


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the checks: a few roundings of the computation dtype, float32 at least
    (summation orders differ between a batch and its samples; a float64 model may compute in float32
    inside, as most RMS and layer norms do; bf16/fp16 have few bits to spare). Mixing samples moves
    results by far more."""
    if dtype in (torch.float32, torch.float64):
        return 64 * torch.finfo(torch.float32).eps
    return 8 * torch.finfo(dtype).eps


def _close(a: torch.Tensor, b: torch.Tensor, scale=None, tol: float | None = None) -> bool:
    """``a`` equals ``b`` up to ``tol`` (default: a few roundings of the less precise dtype), relative
    to ``scale`` (default: the largest entry of ``b``); non-finite entries must sit at the same places."""
    return close(a, b, _tolerance(min_dtype(a.dtype, b.dtype)) if tol is None else tol, scale)


def min_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The least precise of the dtypes given (integer ones count as float32)."""
    floats = [d if d.is_floating_point else torch.float32 for d in dtypes]
    return max(floats, key=lambda d: torch.finfo(d).eps)


class SideChannel:
    """Where a library keeps tensors computed inside a module's call other than in its output (Hugging Face's collector
    of hidden states and attentions, which hooks on its layers fill): ``snapshot()`` before a call of a module the
    fallback replays, ``escaped(state)`` after it, the (tensor, setter) pairs the call added (``setter`` puts another
    tensor in its place). ``layers/hf.py`` registers one in ``SIDE_CHANNELS``."""

    def snapshot(self):
        raise NotImplementedError

    def escaped(self, state) -> list:
        raise NotImplementedError


SIDE_CHANNELS: list[SideChannel] = []


class SampleMixingError(RuntimeError):
    """A module given to the fallback does not treat the samples of a batch independently."""


# ---------------------------------------------------------------------------------------------------------------------
# The batch at another axis: a module run sequence-first inside a batch-first model (XLNet's relative attention takes
# h [T, B, d], a mask [T, T, B, 1], positions [2T, B, d] and returns [T, B, d]). The batch axis of each argument and
# output leaf is found among the axes of size B (several where B equals T) and verified, never taken from a shape.

_UNKNOWN = object()
#: the most assignments of batch axes verified for one call pattern (each costs a few replays of the module)
_MAX_ASSIGNMENTS = 16


@dataclass(frozen=True)
class _AxisAssignment:
    """A verified assignment of batch axes for one call pattern: (leaf position, batch axis) of each argument that
    carries the batch (the others are shared by every sample), and the output leaves with their batch axes."""

    args: tuple[tuple[int, int], ...]
    picked: OutputLeaves

    def apply(self, call: FallbackCall, batch: int) -> FallbackCall:
        call.batched = [k for k, _ in self.args]
        call.axes = [a for _, a in self.args]
        call.batch = batch
        call.outputs = self.picked
        call.signature = (*call.signature, ("axes", self.args, self.picked.per_sample, self.picked.axes,
                                            self.picked.shared))
        return call


class _BatchAxes:
    """``FallbackRule``'s search for the batch axes of a call (mixed into it; see the section's comment above).

    A call is searched only where its leading axis is not verified as the batch: the batch-first reading's check
    failed, or no output leaf that depends on the parameters leads with the batch while one has it at another axis.
    Each candidate is verified: the whole replay reproduces the call; perturbing one sample along the chosen axes of
    the arguments moves that sample's outputs along the chosen output axes and no other sample's; replaying each
    sample alone (its slice along each chosen axis, the other arguments whole) reproduces its outputs. Where two
    assignments verify, their per-sample gradients (for a random output gradient) must agree, or the call is
    refused. The result is kept per call pattern (``_axes_found``)."""

    def _batch_axes(self, module, call: FallbackCall, output, leaves: list, depends: tuple[int, ...],
                    paths: tuple[str, ...], batch: int) -> _AxisAssignment | None:
        """The assignment found for a call of this pattern with a container output, or None: the reading by leading
        rows applies (the batch first, or rows folded into the batch that the row reader maps to samples). Its own
        check searches other axes only if it fails (``_axes_after_refusal``): a module that works token by token
        verifies the tokens as the batch where T = B, so a search before it would take them for the samples."""
        known = self._axes_found.get((call.signature, depends), _UNKNOWN)
        return None if known is _UNKNOWN else known

    def _axes_after_refusal(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...],
                            paths: tuple[str, ...], batch: int | None, err: SampleMixingError) -> _AxisAssignment:
        """The batch-first reading was refused (perturbing row 0 moved other rows): the verified assignment of batch
        axes, or that refusal, naming the module."""
        found = None
        if not self.swapped and batch is not None and batch > 1:
            found = self._search_axes(module, call, leaves, depends, paths, batch)
        if found is None:
            raise SampleMixingError(
                f"{err} (No assignment of the batch to other axes of size {batch} of its arguments and outputs "
                "verified either: replaying each sample alone did not reproduce the call, or changing one sample "
                "moved the others.)") from None
        self._keep_axes((call.signature, depends), found)
        return found

    def _keep_axes(self, key, found) -> None:
        if len(self._axes_found) >= 256:  # shapes that change at every step: verifying again is always safe
            self._axes_found.clear()
        self._axes_found[key] = found

    def batch_not_leading(self, module, args, kwargs, output: torch.Tensor, batch: int | None) -> bool:
        """For the capture: whether a call with a tensor output has its batch at another axis than the first
        (verified); such a call is then taken through its leaves (``capture_leaves``), whose gradient the engine
        hands over with the batch first. Looks only at a call whose output has an axis of size ``batch`` after the
        first; once per call pattern."""
        if (self.swapped or output.is_meta or batch is None or batch <= 1 or output.dim() < 2
                or batch not in tuple(output.shape[1:]) or not output.is_floating_point()):
            return False
        if output.shape[0] == 1:
            # [1, T, ...] with T = B: a table broadcast over the batch (BART's positions looked up on [T] ids), which
            # the capture expands, rather than one token of a module run sequence-first: positions computed
            # independently verify as "samples" as well as samples do, and only the rows' reading could tell
            return False
        call = self._keep_call(module, args, kwargs, output.device)
        key = (call.signature, (0,))
        known = self._axes_found.get(key, _UNKNOWN)
        if known is not _UNKNOWN:
            return known is not None
        err = None
        # The reading by leading rows first (the batch first, or rows folded into the batch, which the row reader
        # then maps to samples: windows [B * W, N, d] with N = B), checked as capture_call would: where changing one
        # leading row of the arguments moves only that row of the output, the call is left to it.
        # Where the leading rows are not the batch and mix, the search below decides, and a call none verifies is
        # left to the row reader too (rows of one sample that interact are replayed together: regroup_call).
        self._set_rows(module, args, kwargs, call, output.shape[0])
        if call.batched:
            try:
                self._check_independence(module, call, output, every_row=True)
            except SampleMixingError as e:
                err = e if output.shape[0] == batch else None
            else:
                self._forward_checked.add(call.signature)
                self._keep_axes(key, None)
                return False
        call.batched, call.batch = [], 0
        if err is not None:
            found = self._axes_after_refusal(module, call, [output], (0,), ("",), batch, err)
        else:
            found = self._search_axes(module, call, [output], (0,), ("",), batch)
            self._keep_axes(key, found)
        return found is not None

    def _search_axes(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...],
                     paths: tuple[str, ...], batch: int) -> _AxisAssignment | None:
        """The assignment of batch axes that verifies (see the class), None if none does; refuses the call if two
        verify and give different per-sample gradients."""
        per_sample = tuple(k for k in depends if leaves[k].dim() > 0 and batch in tuple(leaves[k].shape))
        candidates = {k: [a for a, n in enumerate(t.shape) if n == batch] for k, t in enumerate(call.leaves)
                      if isinstance(t, torch.Tensor) and t.dim() > 0}
        candidates = {k: axes for k, axes in candidates.items() if axes}
        if not per_sample or not candidates:
            return None
        device, enabled, dtype = call.autocast
        verified = []
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            try:
                whole = pytree.tree_leaves(self._replay(module, *call.arguments()))
            except (RuntimeError, ValueError, TypeError) as err:
                raise self._cannot_replay(module, err) from err
            if len(whole) != len(leaves) or not all(
                    isinstance(whole[k], torch.Tensor) and whole[k].shape == leaves[k].shape
                    and _close(whole[k], leaves[k]) for k in depends):
                raise self._not_reproduced(module)
            out_options = itertools.product(*[[a for a, n in enumerate(leaves[k].shape) if n == batch]
                                              for k in per_sample])
            tried = 0
            for outs in out_options:
                expected = [whole[k].movedim(o, 0) for k, o in zip(per_sample, outs)]
                # each argument alone: the axes along which one sample's change moves that sample only; where it
                # moves nothing (the sample's data makes it so: a mask over tokens all alike), the axes, or shared
                options = {}
                for k, axes in candidates.items():
                    moves = {a: self._moves_one_sample(module, call, {k: a}, per_sample, outs, expected) for a in axes}
                    if any(m is True for m in moves.values()):
                        options[k] = [a for a, m in moves.items() if m is True]
                    elif any(m is None for m in moves.values()):
                        options[k] = [a for a, m in moves.items() if m is None] + [None]
                if not options:
                    continue
                for combo in itertools.product(*options.values()):
                    if tried >= _MAX_ASSIGNMENTS:
                        break
                    axes = {k: a for k, a in zip(options, combo) if a is not None}
                    if not axes:
                        continue
                    tried += 1
                    if (self._moves_one_sample(module, call, axes, per_sample, outs, expected) is True
                            and self._samples_reproduce(module, call, axes, per_sample, outs, expected)):
                        verified.append((axes, outs))
        if not verified:
            return None
        assignments = [self._assignment(leaves, depends, per_sample, paths, batch, axes, outs)
                       for axes, outs in verified]
        if len(assignments) > 1:
            self._same_gradients(module, call, leaves, assignments, batch)
        return assignments[0]

    @staticmethod
    def _assignment(leaves, depends, per_sample, paths, batch, axes: dict[int, int], outs) -> _AxisAssignment:
        shapes = tuple(tuple(n for a, n in enumerate(leaves[k].shape) if a != o) for k, o in zip(per_sample, outs))
        picked = OutputLeaves(
            count=len(leaves), rows=batch, per_sample=per_sample, shapes=shapes,
            dtypes=tuple(leaves[k].dtype for k in per_sample),
            shared=tuple(k for k in depends if k not in per_sample), paths=paths, axes=tuple(outs),
        )
        return _AxisAssignment(tuple(sorted(axes.items())), picked)

    def _moves_one_sample(self, module, call, axes: dict[int, int], per_sample, outs, expected) -> bool | None:
        """Sample 0 changed along ``axes`` (argument position -> axis): True where only sample 0's outputs move along
        ``outs``, None where nothing moves, False where another sample's do (or the replay fails)."""
        perturbed = {k: _perturb_along(call.leaves[k], a) for k, a in axes.items()}
        try:
            moved = pytree.tree_leaves(self._replay(module, *call.arguments(perturbed)))
            moved = [moved[k].movedim(o, 0) for k, o in zip(per_sample, outs)]
        except (RuntimeError, ValueError, TypeError, IndexError):
            return False
        if not all(_rows_kept(m, e) for m, e in zip(moved, expected)):
            return False
        if all(_close(m[:1], e[:1]) for m, e in zip(moved, expected)):
            return None
        return True

    def _samples_reproduce(self, module, call, axes: dict[int, int], per_sample, outs, expected) -> bool:
        """Each sample replayed alone (its slice along ``axes``, the other arguments whole) gives its outputs."""
        positions = list(axes)

        def one(sample_leaves):
            args, kwargs = call.arguments({k: t.unsqueeze(axes[k]) for k, t in zip(positions, sample_leaves)})
            out = pytree.tree_leaves(self._replay(module, args, kwargs))
            picked = []
            for k, o in zip(per_sample, outs):
                if out[k].dim() <= o or out[k].shape[o] != 1:
                    raise ValueError("a sample's replay does not keep one row along the output's batch axis")
                picked.append(out[k].squeeze(o))
            return tuple(picked)

        try:
            got = torch.func.vmap(one, randomness="error")([call.leaves[k].movedim(axes[k], 0) for k in positions])
        except (RuntimeError, ValueError, TypeError, IndexError):
            return False
        return all(g.shape == e.shape and _close(g, e) for g, e in zip(got, expected))

    def _same_gradients(self, module, call, leaves, assignments: list[_AxisAssignment], batch: int) -> None:
        """Several assignments verify: their per-sample gradients for one random output gradient must agree."""
        names = [n for n in self.param_names if module.get_parameter(n).requires_grad]
        if not names:
            return
        primals = {n: module.get_parameter(n).detach() for n in names}
        gen = torch.Generator(device=leaves[0].device).manual_seed(12345)  # never the user's random stream
        results = []
        for found in assignments:
            grads = [torch.randn(leaves[k].shape, generator=gen, device=leaves[k].device, dtype=leaves[k].dtype)
                     for k in found.picked.per_sample]
            gen.manual_seed(12345)  # the same output gradient for each assignment
            trial = found.apply(dataclasses.replace(call, batched=[], axes=None, outputs=None), batch)
            with torch.enable_grad():
                results.append(self._per_sample_of_axes(module, trial, found.picked.join(grads), primals))
        first = results[0]
        for other, found in zip(results[1:], assignments[1:]):
            if not all(_close(other[n], first[n]) for n in names):
                raise SampleMixingError(
                    f"{self._name(module)}: its batch could sit at more than one axis of size {batch} (arguments "
                    f"{dict(assignments[0].args)} or {dict(found.args)}, outputs at {assignments[0].picked.axes} or "
                    f"{found.picked.axes}): both reproduce the call sample by sample but give different per-sample "
                    "gradients, so the per-sample fallback cannot tell which is right. Use another batch size for "
                    f"this step, register a rule for {type(module).__name__} with dptrain.register_layer, or freeze "
                    "its parameters"
                )

    def _per_sample_of_axes(self, module, call: FallbackCall, g, primals) -> dict[str, torch.Tensor]:
        """[B, *param] per-sample gradients of a call whose arguments carry the batch at ``call.axes``: a vmap over
        each argument's batch axis; the output gradient ``g`` has the batch first (``OutputLeaves.axes``)."""
        positions, axes = call.batched, call.axes

        def one_sample(sample_leaves, g_i):
            args, kwargs = call.arguments({k: t.unsqueeze(a) for k, a, t in zip(positions, axes, sample_leaves)})
            out, pullback = torch.func.vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)
            return pullback(self._cotangent(call, out, g_i.unsqueeze(0)))[0]

        device, enabled, dtype = call.autocast
        try:
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                grads = torch.func.vmap(one_sample, randomness="error")(
                    [call.leaves[k].movedim(a, 0) for k, a in zip(positions, axes)], g)
        except SampleMixingError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            raise self._cannot_replay(module, err, " one sample at a time") from err
        if call.signature not in self._backward_checked:
            self._check_gradient_sum(module, call, g, primals, grads)
            self._backward_checked.add(call.signature)
        return grads


def _perturb_along(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` with sample 0 along ``axis`` changed (``_perturb_first`` on that axis)."""
    return _perturb_first(t.movedim(axis, 0)).movedim(0, axis) if axis else _perturb_first(t)


class FallbackRule(_BatchAxes, LayerRule):
    """Per-sample gradients of a module's own trainable parameters by replaying its calls (``torch.func``).

    One instance per module (``dptrain.layers.resolve_rule`` builds it); it is never registered.
    """

    fallback = True
    takes_output_leaves = True

    def __init__(self, module: nn.Module, name: str | None = None, batch_first: bool = True):
        # its own parameters, and those it reads from its parameter containers (by dotted name)
        self.param_names = tuple(n for n, _ in module.named_parameters(recurse=False)) + container_params(module)
        # its path in the model ("" is the root), which every refusal names; its class where no path was given
        self.label = (name or "<root>") if name is not None else type(module).__name__
        # batch_first=False: the engine hands rules every tensor of 2 or more dims with dims 0 and 1
        # swapped (the batch first), the output and its gradient too; a replay swaps them back
        self.swapped = not batch_first
        self._forward_checked: set[tuple] = set()   # call signatures whose outputs were checked
        self._backward_checked: set[tuple] = set()  # ... whose per-sample gradients were checked
        #: ... with rows folded into the batch, by their samples: whether the replay takes arguments by sample
        self._folded_checked: dict[tuple, bool] = {}
        #: container outputs: which leaves depend on the trainable parameters (and which tensors hidden in objects),
        #: per call signature and trainable set
        self._depends: dict[tuple, tuple[tuple[int, ...], tuple]] = {}
        #: call signatures that vmap cannot replay: one replay per sample (``_per_sample_one_by_one``)
        self._one_by_one: set[tuple] = set()
        self._warned_one_by_one = False
        #: calls whose batch is not the leading axis of every argument and output: per call signature and output
        #: leaves, the verified assignment of batch axes (``_AxisAssignment``), or None for the batch-first reading
        self._axes_found: dict[tuple, _AxisAssignment | None] = {}
        #: the objects among the arguments of the call running now, as they were before it (``before_call``)
        self._before: dict[int, tuple[Any, Any]] = {}
        #: per call signature, the arguments as long as the batch that every sample shares (``_shared_arguments``)
        self._shared_found: dict[tuple, tuple[int, ...]] = {}
        #: the side channels' state before the call running now (``before_call``)
        self._channels: list = []

    # ------------------------------------------------------------------ forward: keep the call
    def capture_call(self, module, args, kwargs, output):
        if not isinstance(output, torch.Tensor) or output.dim() == 0:
            raise ValueError(
                f"{self._name(module)}: the per-sample fallback needs an output with the batch as its first "
                f"dimension, got {_describe(output)}; register a rule for it with dptrain.register_layer, or freeze it"
            )
        self._refuse_output_hooks(module, output)
        call = self._keep_call(module, args, kwargs, output.device)
        self._set_rows(module, args, kwargs, call, output.shape[0])
        shared = self._shared_found.get(call.signature)
        if shared:
            self._share(call, shared)
        if call.signature not in self._forward_checked and call.batch > 1 and not output.is_meta:  # meta: plan
            try:
                self._check_independence(module, call, output)
            except SampleMixingError:
                # an argument as long as the batch may be shared by every sample (timm EVA's rotary table [N, d]
                # with N = B, a mask [T, T] with T = B): those whose first row, changed alone, moves the others
                shared = self._shared_arguments(module, call, output)
                if not shared:
                    raise
                base = call.signature
                self._share(call, shared)
                self._check_independence(module, call, output)
                if len(self._shared_found) >= 256:
                    self._shared_found.clear()
                self._shared_found[base] = shared
            self._forward_checked.add(call.signature)
        return call

    def capture_leaves(self, module, args, kwargs, output, batch):
        """A call whose output is a container (tuple, list, dict, ModelOutput): the leaves its per-sample gradients
        come from are the floating-point ones that depend on its trainable parameters (read from a replay that
        differentiates them, once per call signature); those that lead with the call's rows (the model's batch
        size where one of them does, else the first one's leading size) are per-sample, the others shared
        (``OutputLeaves``). ``None``: no leaf depends on them."""
        if self.swapped:
            raise ValueError(
                f"{self._name(module)} returns {type(output).__name__} in a sequence-first model (batch_first=False): "
                "the per-sample fallback takes a container output only from a batch-first model. Register a rule for "
                f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
            )
        flat, _ = pytree.tree_flatten_with_path(output)
        paths, leaves = tuple(pytree.keystr(path) for path, _ in flat), [leaf for _, leaf in flat]
        floats = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            return None
        for k in floats:
            self._refuse_output_hooks(module, leaves[k])
        call = self._keep_call(module, args, kwargs, leaves[floats[0]].device)
        base_signature = call.signature
        meta = any(leaves[k].is_meta for k in floats)  # (plan on the meta device: shapes only, every leaf counts)
        depends = floats if meta else self._depending(module, call, leaves, floats, paths)
        if not depends:
            return None
        if not meta and batch is not None and batch > 1:
            found = self._batch_axes(module, call, output, leaves, tuple(depends), paths, batch)
            if found is not None:
                return found.apply(call, batch), found.picked
        leading = [leaves[k].shape[0] for k in depends if leaves[k].dim() > 0]
        rows = batch if batch in leading else leading[0] if leading else None
        per_sample = tuple(k for k in depends if leaves[k].dim() > 0 and leaves[k].shape[0] == rows)
        picked = OutputLeaves(
            count=len(leaves), rows=rows, per_sample=per_sample,
            shapes=tuple(tuple(leaves[k].shape[1:]) for k in per_sample),
            dtypes=tuple(leaves[k].dtype for k in per_sample),
            shared=tuple(k for k in depends if k not in per_sample), paths=paths,
        )
        call.outputs = picked
        call.signature = (*call.signature, ("rows", rows, per_sample, picked.shared))
        self._set_rows(module, args, kwargs, call, rows or 0)
        # (one sample in the model call: its rows may interact, nothing can mix)
        if call.signature not in self._forward_checked and call.batch > 1 and per_sample and not meta and batch != 1:
            # the leading rows may be tokens or windows rather than the samples: every row is checked apart
            ambiguous = rows != batch or any(batch in tuple(leaves[k].shape[1:]) for k in depends)
            try:
                self._check_independence(module, call, output, every_row=ambiguous)
            except SampleMixingError as err:  # the batch may sit at another axis (a module run sequence-first)
                leading = call.signature
                call.signature, call.outputs = base_signature, None
                if rows != batch and batch is not None and batch > 1 and not self.swapped:
                    # rows that are not the samples (tokens, windows): the batch at another axis, where one verifies;
                    # else the rows are left to the row reader, as far as perturbing row 0 alone allows
                    found = self._search_axes(module, call, leaves, tuple(depends), paths, batch)
                    if found is not None:
                        self._keep_axes((base_signature, tuple(depends)), found)
                        return found.apply(call, batch), found.picked
                    call.signature, call.outputs = leading, picked
                    self._check_independence(module, call, output)
                else:
                    found = self._axes_after_refusal(module, call, leaves, tuple(depends), paths, batch, err)
                    return found.apply(call, batch), found.picked
            self._forward_checked.add(call.signature)
        return call, picked

    @staticmethod
    def _share(call: FallbackCall, shared: tuple[int, ...]) -> None:
        call.batched = [k for k in call.batched if k not in shared]
        call.signature = (*call.signature, ("shared", shared))

    def _shared_arguments(self, module, call: FallbackCall, output) -> tuple[int, ...]:
        """The batched arguments whose first row, changed alone, moves other rows of the output: shared by every
        sample, though as long as the batch. Only tables, masks and ids: empty where an argument that required grad
        (an activation, the batch's own) moves other rows, where no argument's first row moves the output's first
        row alone (the call mixes its samples: the refusal stands), or where the replay fails."""
        if len(call.batched) < 2:
            return ()
        shared, own = [], False
        device, enabled, dtype = call.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            try:
                again = self._replay(module, *call.arguments())
                for k in call.batched:
                    moved = self._replay(module, *call.arguments({k: _perturb_first(call.leaves[k])}))
                    if not (isinstance(moved, torch.Tensor) and _rows_kept(moved, again)):
                        if k in call.differentiable:
                            return ()
                        shared.append(k)
                    elif not _close(moved[:1], again[:1]):
                        own = True  # its first row moves the output's first row, and that row alone
            except (RuntimeError, ValueError, TypeError):
                return ()
        return tuple(shared) if own else ()

    def _refuse_output_hooks(self, module, output: torch.Tensor) -> None:
        if output._backward_hooks:
            # The engine reads the output gradient after these hooks, and the replay's vjp would run them again.
            raise ValueError(
                f"{self._name(module)}: its forward registers a hook on its output's gradient (register_hook), which "
                "the per-sample fallback, replaying the forward, would apply twice. Register that hook on the output "
                "outside the module's forward, or register a rule for it with dptrain.register_layer"
            )

    def before_call(self, module, args, kwargs) -> None:
        """The objects among the call's arguments that hold tensors, as they are before it runs (copies, their tensors
        detached): a call may change them (a cache of keys and values it adds its own to), and its replays must
        see them as the call did (``_keep_call``). And the side channels' state (``SIDE_CHANNELS``)."""
        held = [leaf for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))) if _may_change(leaf)]
        self._before = {id(leaf): (leaf, _snapshot(leaf)) for leaf in held}
        self._channels = [(channel, channel.snapshot()) for channel in SIDE_CHANNELS]

    def _guard_escaped(self, module) -> None:
        """Tensors the call put where a side channel keeps them (Hugging Face's collector of hidden states) rather
        than in its output: their gradient would reach the module's parameters around the replay, which
        differentiates the output only. Replaced there by copies that refuse a gradient (``_UnusedOutput``)."""
        channels, self._channels = self._channels, []
        escaped = [(t, setter) for channel, state in channels for t, setter in channel.escaped(state)
                   if isinstance(t, torch.Tensor) and t.requires_grad
                   and type(t.grad_fn).__name__ != "_UnusedOutputBackward"]
        if not escaped:
            return
        message = (
            f"{self._name(module)}: the loss depends on a tensor computed inside its call that left it other than "
            "through its output (hidden states or attentions that Hugging Face collects for output_hidden_states or "
            "output_attentions, a weighted sum of the layers' hidden states), which the per-sample fallback, "
            "differentiating the module's output only, would miss. Compute the loss without them "
            "(output_hidden_states=False, use_weighted_layer_sum=False), register a rule for "
            f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
        )
        for (_, setter), copy in zip(escaped, _UnusedOutput.apply(message, *(t for t, _ in escaped))):
            setter(copy)

    def _keep_call(self, module, args, kwargs, device: torch.device) -> FallbackCall:
        """The call's arguments, the tensors detached (``batched`` and ``batch`` are set by ``_set_rows``); an object
        the call may change, as it was before the call (``before_call``; a copy of it as it is now for a call whose
        start the capture did not see)."""
        if self._channels:
            self._guard_escaped(module)
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        kept, versions, objects, differentiable = [], [], [], []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                versions.append((k, leaf._version))
                if leaf.requires_grad:
                    differentiable.append(k)
                leaf = leaf.detach()
            elif _may_change(leaf):
                objects.append(k)
                before = self._before.get(id(leaf))
                leaf = before[1] if before is not None and before[0] is leaf else _snapshot(leaf)
            kept.append(leaf)
        autocast = autocast_state(device.type)
        signature = (
            module.training, autocast,
            tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in kept),
        )
        return FallbackCall(kept, spec, [], 0, versions, autocast, signature, objects=objects,
                            differentiable=frozenset(differentiable))

    @staticmethod
    def _set_rows(module, args, kwargs, call: FallbackCall, batch: int) -> None:
        """The call's rows: its argument tensors that lead with ``batch`` rows are replayed one row at a time."""
        call.batch = batch
        call.bags = _flat_bag_arguments(module, args, kwargs) is not None
        # A flat input's samples are not a dimension: no argument is "batched" (the offsets only look like it).
        call.batched = [] if call.bags else [
            k for k, t in enumerate(call.leaves) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
        ]

    def _depending(self, module, call: FallbackCall, leaves: list, floats: list[int],
                   paths: tuple[str, ...]) -> tuple[int, ...]:
        """The positions among ``floats`` of the output leaves that depend on the module's trainable parameters: a
        replay with those parameters requiring grad (and nothing else) says which leaves require grad. Read once per
        call signature, trainable set and output structure (its leaves' kinds and shapes, which grad they need).

        A tensor that depends on them inside an object the output holds but torch's pytree does not flatten (a
        class of its own: a cache of keys and values) is not differentiated: the loss must not use it. At every call
        it is replaced in that object by a copy that refuses any gradient (``_guard_hidden``); where it cannot be
        replaced (inside a tuple of such an object), or where a leaf that depends on them is not floating point, the
        call is refused."""
        names = tuple(n for n in self.param_names if module.get_parameter(n).requires_grad)
        structure = tuple((tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else type(t)
                          for t in leaves)
        key = (call.signature, names, structure)
        known = self._depends.get(key)
        if known is None:
            known = self._read_depending(module, call, leaves, floats)
            self._depends[key] = known
        depends, hidden = known
        for k in hidden:
            self._guard_hidden(module, leaves[k], paths[k])
        return depends

    def _read_depending(self, module, call: FallbackCall, leaves: list, floats: list[int]):
        """(the float leaves that depend on the trainable parameters, and the other leaves that hold tensors that
        do), from one replay."""
        names = tuple(n for n in self.param_names if module.get_parameter(n).requires_grad)
        primals = {n: module.get_parameter(n).detach().requires_grad_(True) for n in names}
        device, enabled, dtype = call.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            try:
                out = self._replay(module, *call.arguments(), primals)
            except (RuntimeError, ValueError, TypeError) as err:
                raise self._cannot_replay(module, err) from err
        replayed = pytree.tree_leaves(out)
        if len(replayed) != len(leaves):
            raise self._not_reproduced(module)
        hidden = []
        for k, leaf in enumerate(replayed):
            if k not in floats and any(t.requires_grad for t in _tensors_within(leaf)):
                if isinstance(leaf, torch.Tensor):  # (an integer tensor that depends on them)
                    raise self._hidden_refusal(module, leaf, k, None)
                hidden.append(k)
        return tuple(k for k in floats if replayed[k].requires_grad), tuple(hidden)

    def _guard_hidden(self, module, leaf, path: str) -> None:
        """Replace the tensors inside ``leaf`` (an object of the call's output that holds some that depend on the
        parameters) that require grad by copies whose gradient is refused (``_UnusedOutput``): the module used them
        inside its call, where their gradient is part of the replay's; a loss that used them after the call would
        reach the parameters around the fallback. (Those of an object passed in and held on, a cache that several
        layers fill, are guarded alike: a loss on a cache is refused.)"""
        slots = [(t, setter) for t, setter in _tensor_slots(leaf)
                 if t.requires_grad and type(t.grad_fn).__name__ != "_UnusedOutputBackward"]
        if not slots:
            return
        if any(setter is None for _, setter in slots):
            raise self._hidden_refusal(module, leaf, None, path)
        message = self._hidden_refusal(module, leaf, None, path, used=True)
        copies = _UnusedOutput.apply(str(message), *(t for t, _ in slots))
        for (_, setter), copy in zip(slots, copies):
            setter(copy)

    def _hidden_refusal(self, module, leaf, k, path, used: bool = False) -> ValueError:
        what = (f"a {leaf.dtype} tensor that depends" if isinstance(leaf, torch.Tensor)
                else f"a {type(leaf).__name__} holding tensors that depend")
        cache = ("Cache" in type(leaf).__name__ and " (a cache of keys and values, which training does not "
                 "need: call the model with use_cache=False, or set model.config.use_cache = False)" or "")
        where = path if path is not None else "" if k is None else None
        if used:
            return ValueError(
                f"{self._name(module)}: the loss depends on its output {where or '(the whole output)'}, {what} on its "
                "trainable parameters, which the per-sample fallback does not differentiate (it takes "
                "floating-point tensors in tuples, lists, dicts, Hugging Face ModelOutputs and other containers "
                f"registered with torch.utils._pytree){cache}. Compute the loss without it, register a rule for "
                f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
            )
        return ValueError(
            f"{self._name(module)}: its output {where or '(the whole output)'} is {what} on its "
            "trainable parameters, which the per-sample fallback cannot differentiate: it takes "
            "floating-point tensors in tuples, lists, dicts, Hugging Face ModelOutputs and other containers "
            f"registered with torch.utils._pytree{cache}. Return such tensors, register a rule for "
            f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
        )

    def capture(self, module, inputs, output):  # everything goes through capture_call
        raise NotImplementedError("FallbackRule keeps whole calls: use capture_call")

    def expand_batch(self, module, activation, output, batch):
        """A call with batch size 1 whose output broadcasts over the batch: every input is shared.

        A call with no tensor argument at all (a table computed from parameters alone: BEiT's relative position
        bias) is expanded too: how the model broadcasts it is checked where it meets the batch (``broadcast.py``),
        and where it meets something else (Swin's bias, added to B x windows rows) its one row, shared by every
        sample, is refused by the rows' reading, naming the module."""
        activation.batched = []
        activation.batch = batch
        activation.broadcast = True
        return activation, output.expand(batch, *output.shape[1:])

    def dims(self, module, activation, output):
        size = sum(module.get_parameter(n).numel() for n in self.param_names)
        T = math.prod(output.shape[1:-1]) if output.dim() > 2 else 1
        picked = getattr(activation, "outputs", None)
        if picked is not None and picked.axes is not None and picked.shapes:  # the batch axis is not the first
            T = math.prod(picked.shapes[0][:-1]) if len(picked.shapes[0]) > 1 else 1
        return LayerDims(T=T, p=size, d=1, ghost_supported=False, fallback=True)

    # ------------------------------------------------------------------ backward
    def operands(self, module, activation, grad_output):
        call = activation
        for k, version in call.versions:
            if call.leaves[k]._version != version:
                raise RuntimeError(
                    f"an input of {self._name(module)} was modified in place after the call (e.g. `h += layer(h)`), "
                    "so the per-sample fallback cannot replay it: use an out-of-place operation (`h = h + layer(h)`)"
                )
        return (FallbackOperands([(call, grad_output.detach())]),)

    def concat_calls(self, calls):
        # Several calls of one module: the per-sample gradient is the sum over its calls.
        return (FallbackOperands([c for ops in calls for c in ops[0].calls],
                                 folded=[f for ops in calls for f in ops[0].folded]),)

    def per_sample_grads(self, module, ops, names):
        store = ops[0]
        missing = set(names) - set(store.per_sample)
        if missing:
            wanted = sorted(missing | {n for n in self.param_names if module.get_parameter(n).requires_grad})
            grads = self._per_sample(module, store.calls, wanted)
            for name, grad in self._per_sample_folded(module, store.folded, wanted).items():
                grads[name] = grad if name not in grads else grads[name] + grad
            for name, grad in grads.items():
                store.per_sample.setdefault(name, grad)
        return {n: store.per_sample[n] for n in names}

    def clipped_grads(self, module, ops, factors):
        """Module 5 on per-sample gradients the norm stage formed; otherwise (the two-pass modes' second
        pass) one replay of the whole batch with each sample's output gradient scaled by its factor,
        sum_i C_i vjp_i(g_i) = vjp(C g) for a module that keeps samples apart (checked), with no
        per-sample gradient formed."""
        store = ops[0]
        if all(n in store.per_sample for n in factors):
            return {n: weighted_sum(factors[n], store.per_sample[n]) for n in factors}
        by_factor: dict[int, list[str]] = {}  # parameters of one clipping group share their factors
        for name, factor in factors.items():
            by_factor.setdefault(id(factor), []).append(name)
        out: dict[str, torch.Tensor] = {}
        for names in by_factor.values():
            factor = factors[names[0]]
            primals = {n: module.get_parameter(n).detach() for n in names}
            for call, g in store.calls:
                for n, t in self._scaled_batch_grads(module, call, g, factor, primals).items():
                    out[n] = t if n not in out else out[n] + t
            for rows in store.folded:  # each row scaled by its sample's factor, in one replay of the call
                for n, t in self._scaled_batch_grads(module, rows.call, rows.grad, rows.row_factors(factor),
                                                     primals).items():
                    out[n] = t if n not in out else out[n] + t
        return out

    def _scaled_batch_grads(self, module, call, g, factor, primals) -> dict[str, torch.Tensor]:
        device, enabled, dtype = call.autocast
        args, kwargs = call.arguments()
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            out, pullback = autograd_vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)
            return pullback(self._cotangent(call, out, scale_samples(g, factor)))[0]

    # ------------------------------------------------------------------ the replay
    def _replay_out(self, module, call: FallbackCall, args, kwargs, params=None):
        """What the call's vjp differentiates: its output tensor, or the per-sample leaves of a container output."""
        out = self._replay(module, args, kwargs, params)
        if call.outputs is None:
            return out
        try:
            return call.outputs.pick(out)
        except ValueError:
            raise self._not_reproduced(module) from None

    @staticmethod
    def _cotangent(call: FallbackCall, out, g: torch.Tensor):
        """The cotangent of ``out`` (``_replay_out``'s) from the call's output gradient ``g`` (rows first): for a
        container output, the joined gradient cut into its leaves."""
        if call.outputs is not None:
            return tuple(c.to(o.dtype) for c, o in zip(call.outputs.split(g), out))
        if out.shape[0] != g.shape[0]:  # an output broadcast over the batch: its gradient sums over it
            g = g.sum(0, keepdim=True)
        return g.to(out.dtype)

    @staticmethod
    def _joined(call: FallbackCall, out) -> torch.Tensor:
        """``_replay_out``'s output as one tensor with its rows first (a container's leaves flattened per row)."""
        if call.outputs is None:
            return out
        dtype = functools.reduce(torch.promote_types, [o.dtype for o in out])
        return torch.cat([o.reshape(o.shape[0], -1).to(dtype) for o in out], 1)

    def _replay(self, module, args, kwargs, params=None):
        """``replay`` of a call kept as the engine handed it: batch first, as its output and gradient."""
        if not self.swapped:
            return replay(module, args, kwargs, params)
        args, kwargs = pytree.tree_map(swap01, (args, kwargs))
        out = replay(module, args, kwargs, params)
        return swap01(out)

    def _per_sample(self, module, calls, names) -> dict[str, torch.Tensor]:
        primals = {n: module.get_parameter(n).detach() for n in names}
        total: dict[str, torch.Tensor] = {}
        for call, g in calls:
            grads = self._per_sample_of_call(module, call, g, primals)
            for n, t in grads.items():
                total[n] = t if n not in total else total[n] + t
        return total

    def _per_sample_of_call(self, module, call, g, primals) -> dict[str, torch.Tensor]:
        """[batch, *param] per-sample gradients of a batch-first call: a vmap over the samples of the vjp of the
        replayed call; where vmap cannot run the module, one replay per sample (``_per_sample_one_by_one``)."""
        if call.bags:
            return self._per_sample_of_bags(module, call, g, primals)
        if call.axes is not None:
            return self._per_sample_of_axes(module, call, g, primals)
        if call.signature in self._one_by_one:
            return self._per_sample_one_by_one(module, call, g, primals)
        batched = call.batched

        def one_sample(batched_leaves, g_i):
            args, kwargs = call.arguments({k: t.unsqueeze(0) for k, t in zip(batched, batched_leaves)})

            def forward(p):
                return self._replay_out(module, call, args, kwargs, p)

            out, pullback = torch.func.vjp(forward, primals)
            return pullback(self._cotangent(call, out, g_i.unsqueeze(0)))[0]

        device, enabled, dtype = call.autocast
        try:
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                grads = torch.func.vmap(one_sample, randomness="error")([call.leaves[k] for k in batched], g)
        except SampleMixingError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            # vmap cannot run the module (data-dependent control flow, .item(), a boolean mask, a custom
            # autograd.Function without setup_context): one replay per sample, checked the same way
            return self._per_sample_one_by_one(module, call, g, primals, err)
        if call.signature not in self._backward_checked:
            self._check_gradient_sum(module, call, g, primals, grads)
            self._backward_checked.add(call.signature)
        return grads

    def _per_sample_one_by_one(self, module, call, g, primals, vmap_error: BaseException | None = None):
        """Per-sample gradients of a batch-first call that vmap cannot run: each sample's rows replayed alone (a
        batch of one), differentiated by plain autograd, B replays in a loop. As exact as the vmap (the same
        replay, sample by sample) and as checked: once per call signature, each sample's replay must reproduce its
        rows of the call's output, and the per-sample gradients must sum to the whole call's gradient. Slower (B
        forwards and backwards of the module instead of one vectorised), never larger: one sample's gradient graph
        at a time."""
        device, enabled, dtype = call.autocast
        check = call.signature not in self._backward_checked
        grads: dict[str, list[torch.Tensor]] = {n: [] for n in primals}
        outs = []
        try:
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                for i in range(call.batch):
                    args, kwargs = call.arguments({k: call.leaves[k][i:i + 1] for k in call.batched})
                    out, pullback = autograd_vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)
                    for n, t in pullback(self._cotangent(call, out, g[i:i + 1]))[0].items():
                        grads[n].append(t)
                    if check:
                        outs.append(self._joined(call, out))
        except SampleMixingError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            how = " one sample at a time" + (f" (vmap: {first_line(vmap_error)}), nor in a loop"
                                             if vmap_error is not None else "")
            raise self._cannot_replay(module, err, how) from err
        stacked = {n: torch.stack(ts) if ts else primals[n].new_zeros(0, *primals[n].shape)
                   for n, ts in grads.items()}
        if check:
            self._check_split_outputs(module, call, torch.cat(outs) if outs else None)
            self._check_gradient_sum(module, call, g, primals, stacked)
            self._backward_checked.add(call.signature)
        if vmap_error is not None and not self._warned_one_by_one:
            self._warned_one_by_one = True
            warnings.warn(
                f"{self._name(module)}: vmap cannot run this module ({first_line(vmap_error)}), so the per-sample "
                f"fallback replays it one sample at a time: {call.batch} forwards and backwards of the module per call "
                "instead of one vectorised (the memory plan() shows is unchanged). Register a rule for "
                f"{type(module).__name__} with dptrain.register_layer for speed, or freeze its parameters",
                stacklevel=2)
        if len(self._one_by_one) >= 256:
            self._one_by_one.clear()
        self._one_by_one.add(call.signature)
        return stacked

    def _check_split_outputs(self, module, call, outs):
        """Each sample replayed alone reproduces its rows of the call's output: the module computes a sample's rows
        the same in a batch of one as in the batch (no branch on the batch's size or content, no randomness)."""
        if outs is None:
            return
        whole = self._whole_output(module, call)
        if not _close(outs, whole):
            raise SampleMixingError(
                f"{self._name(module)}: replaying each sample alone (vmap cannot run this module, so the per-sample "
                "fallback replays one sample at a time) does not reproduce that sample's output in the batch: the "
                "module computes a sample differently by the batch it is in (a branch on the batch's size or "
                "values, random operations), so the per-sample fallback cannot split it. Register a rule for "
                f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
            )

    def _per_sample_of_bags(self, module, call, g, primals) -> dict[str, torch.Tensor]:
        """Per-sample gradients of a call whose samples are segments of a flat input: one replay per bag, made of
        that bag's ids (and weights) alone. A loop, not a vmap: the bags have different lengths."""
        device, enabled, dtype = call.autocast
        args, kwargs = call.arguments()
        per_bag = _flat_bags(module, args, kwargs)
        if len(per_bag) != g.shape[0]:
            raise RuntimeError(f"{self._name(module)}: {len(per_bag)} bags for an output of {g.shape[0]} rows")
        grads: dict[str, list[torch.Tensor]] = {n: [] for n in primals}
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for (bag_args, bag_kwargs), g_i in zip(per_bag, g):
                out, pullback = autograd_vjp(lambda p: self._replay(module, bag_args, bag_kwargs, p), primals)
                for n, t in pullback(g_i.unsqueeze(0).to(out.dtype))[0].items():
                    grads[n].append(t)
        stacked = {n: torch.stack(ts) if ts else torch.zeros(0, *primals[n].shape, dtype=primals[n].dtype,
                                                                  device=primals[n].device)
                   for n, ts in grads.items()}
        if call.signature not in self._backward_checked:
            self._check_gradient_sum(module, call, g, primals, stacked)
            self._backward_checked.add(call.signature)
        return stacked

    # ------------------------------------------------------------------ rows folded into the batch
    def regroup_call(self, module, activation, grad, samples, batch):
        """A call whose rows are the samples in another order or layout (``LayerRule.regroup_call``): windows or
        tokens folded into the batch (``[B * windows, N, d]``), rows reordered or routed.

        Its per-sample gradients replay, for each sample, that sample's rows alone (in the call's order) as the
        call's batch, with the other arguments as recorded, and take the vjp of the module's own parameters with
        the rows' output gradients: a vmap over the samples where each has as many rows, one replay per sample
        otherwise. That is the module call a one-sample forward makes, row for row: a mask over the windows given
        once for all images (Swin's shifted windows) pairs with each sample's windows as it does there. The rows'
        independence is checked when the call is recorded (perturbing one row moves no other), and once per
        layout that each sample's replay reproduces its rows of the call and that the per-sample gradients sum
        to the call's gradient. The two-pass modes' second pass replays the whole call once, each row's output
        gradient scaled by its sample's factor.
        """
        (store,) = self.operands(module, activation, grad)  # (its inputs unchanged since the call)
        ((call, g),) = store.calls
        if call.bags:
            raise SampleMixingError(
                f"{self._name(module)}: its bags are not the samples in order, which the per-sample fallback cannot "
                "regroup; give it the batch's bags in order, or freeze its parameters")
        if samples is None or samples.numel() != g.shape[0]:
            raise ValueError(f"{self._name(module)}: {g.shape[0]} rows in the call, a sample for "
                             f"{None if samples is None else samples.numel()} of them")
        if call.broadcast:
            raise SampleMixingError(
                f"{self._name(module)}: its output, one row broadcast over the batch, reaches the samples' losses in "
                "another layout than one row each (the rows mixed by a mean over the batch, or reordered), which the "
                "per-sample fallback cannot regroup. Use the output only where it meets the batch, or freeze its "
                "parameters")
        if call.axes is not None:
            raise SampleMixingError(
                f"{self._name(module)}: its batch is not its arguments' first axis (found per argument: "
                f"{call.axes}), and the rows of its output are not the samples in order, which the per-sample "
                "fallback cannot regroup. Register a rule for it with dptrain.register_layer, or freeze its parameters")
        rows = FoldedRows(call, g, samples.to("cpu", torch.long), batch)
        counts = rows.chunks()[1]
        per_row = self.dims(module, call, g)
        dims = dataclasses.replace(per_row, T=per_row.T * max(1, int(counts.max()) if counts.numel() else 0))
        return (FallbackOperands([], folded=[rows]),), [dims]

    def _per_sample_folded(self, module, folded: list[FoldedRows], names) -> dict[str, torch.Tensor]:
        if not folded:
            return {}
        primals = {n: module.get_parameter(n).detach() for n in names}
        total: dict[str, torch.Tensor] = {}
        for rows in folded:
            for n, t in self._per_sample_of_rows(module, rows, primals).items():
                total[n] = t if n not in total else total[n] + t
        return total

    def _per_sample_of_rows(self, module, rows: FoldedRows, primals) -> dict[str, torch.Tensor]:
        """[batch, *param] per-sample gradients of a call with rows folded into its batch: each sample's rows
        replayed alone.

        An argument that leads with as many entries as there are samples, while the outputs' rows are their tokens,
        may be per sample (a router given [B, T, d] that returns [B * T, experts]: each sample's replay then takes
        its own row of it) or shared (a mask over B windows that happen to be as many as the samples). Which one
        is read, not assumed: the replay is checked first with every such argument whole, then by sample, and the
        one that reproduces the call is kept for the layout."""
        call = rows.call
        key = (call.signature, rows.batch, hash(rows.samples.numpy().tobytes()))
        candidates = [k for k, t in enumerate(call.leaves)
                      if k not in call.batched and rows.batch != call.batch and isinstance(t, torch.Tensor)
                      and t.dim() > 0 and t.shape[0] == rows.batch]
        known = self._folded_checked.get(key)
        if known is not None:
            return self._replay_rows(module, rows, primals, candidates if known else [], check=False)
        passed, first_error = {}, None
        for by_sample in ([[], candidates] if candidates else [[]]):
            try:
                passed[bool(by_sample)] = self._replay_rows(module, rows, primals, by_sample, check=True)
            except (SampleMixingError, RuntimeError, ValueError, TypeError) as err:
                first_error = first_error or err
        if not passed:
            raise first_error
        if len(passed) == 2:
            # Both readings reproduce this call (the samples' rows of the argument are alike: FiLM conditioned on one
            # class for every sample): the data cannot tell, so nothing is remembered, and this call is replayed by
            # sample, which gives no sample another's row.
            return passed[True]
        if len(self._folded_checked) >= 256:  # rows picked by the data: a new layout at most steps
            self._folded_checked.clear()      # (checking again is always safe)
        by_sample = next(iter(passed))
        self._folded_checked[key] = by_sample
        return passed[by_sample]

    def _replay_rows(self, module, rows: FoldedRows, primals, by_sample: list[int], check: bool):
        """``_per_sample_of_rows`` with the arguments at ``by_sample`` taken one row per sample; ``check``: the
        replays must reproduce the call's rows and sum to its gradient (``SampleMixingError`` otherwise)."""
        call, g = rows.call, rows.grad
        order, counts = rows.chunks()
        positions = [*call.batched, *by_sample]

        def one_sample(sample_leaves, g_s, vjp=torch.func.vjp):
            args, kwargs = call.arguments(dict(zip(positions, sample_leaves)))
            out, pullback = vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)
            grads = pullback(self._cotangent(call, out, g_s))[0]
            # the outputs only for the check (vmap returns tensors only)
            return (grads, self._joined(call, out)) if check else grads

        device, enabled, dtype = call.autocast
        try:
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                vmapped = None
                if counts.numel() and int(counts.min()) == int(counts.max()) > 0:  # as many rows each: one vmap
                    index = order.reshape(rows.batch, -1)
                    leaves = [call.leaves[k][index.to(call.leaves[k].device)] for k in call.batched]
                    leaves += [call.leaves[k].unsqueeze(1) for k in by_sample]  # [B, 1, ...]: one row per sample
                    try:
                        vmapped = torch.func.vmap(one_sample, randomness="error")(leaves, g[index.to(g.device)])
                    except RuntimeError:  # control flow on the data (experts picked by a router): replays below
                        vmapped = None
                if vmapped is not None:
                    grads, outs = (vmapped[0], vmapped[1].flatten(0, 1)) if check else (vmapped, None)
                else:  # samples with different numbers of rows (or none), or no vmap: one replay each
                    grads, outs, start = {n: [] for n in primals}, [], 0
                    for sample, count in enumerate(counts.tolist()):
                        idx = order[start:start + count]
                        start += count
                        if count == 0:
                            for n, p in primals.items():
                                grads[n].append(torch.zeros_like(p))
                            continue
                        leaves = [call.leaves[k][idx.to(call.leaves[k].device)] for k in call.batched]
                        leaves += [call.leaves[k][sample:sample + 1] for k in by_sample]
                        got = one_sample(leaves, g[idx.to(g.device)], autograd_vjp)  # (no vmap: plain autograd)
                        sample_grads = got[0] if check else got
                        for n, t in sample_grads.items():
                            grads[n].append(t)
                        if check:
                            outs.append(got[1])
                    grads = {n: torch.stack(ts) if ts else p.new_zeros(0, *p.shape)
                             for (n, ts), p in zip(grads.items(), primals.values())}
                    outs = torch.cat(outs) if check and outs else None
        except SampleMixingError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            raise self._cannot_replay(module, err, " one sample's rows at a time") from err
        if check:
            self._check_folded_outputs(module, call, order, outs)
            known = (rows.samples >= 0).to(g.device).reshape(-1, *([1] * (g.dim() - 1)))
            self._check_gradient_sum(module, call, g * known, primals, grads)
        return grads

    def _whole_output(self, module, call) -> torch.Tensor:
        """The call replayed whole, under its autocast state, its outputs joined as the per-sample replays' are."""
        device, enabled, dtype = call.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            args, kwargs = call.arguments()
            return self._joined(call, self._replay_out(module, call, args, kwargs))

    def _check_folded_outputs(self, module, call, order, outs):
        """Each sample's rows replayed alone reproduce those rows of the call: the module pairs no row with
        another input by its position in the whole call (a mask laid out for another order of the rows)."""
        if outs is None:
            return
        whole = self._whole_output(module, call)
        if not _close(outs, whole[order.to(whole.device)]):
            raise SampleMixingError(
                f"{self._name(module)}: its rows are samples folded into the batch (windows, tokens), and replaying "
                "each sample's rows alone does not reproduce them: the module treats a row by its place in the whole "
                "call (an argument such as a mask laid out for another order of the rows, or rows that depend on the "
                "number of rows), so the per-sample fallback cannot split it. Give the layer the batch as its first "
                f"dimension, register a rule for {type(module).__name__} with dptrain.register_layer, or freeze its "
                "parameters"
            )

    # ------------------------------------------------------------------ checks, once per signature
    def _check_independence(self, module, call, output, every_row: bool = False):
        """Forward check: the replay reproduces the output, and perturbing sample 0 moves no other sample.

        ``every_row``: where the leading rows may not be the samples (the batch also sits at another axis, or the rows
        are not as many as the samples), also no row moves another: row 0 alone may be apart by the data (a token
        every sample masks, XLNet's left padding) while the others mix. Perturbing, for each bit of a row's number,
        the rows with that bit set, then those without it, moves each row apart from each other at least once:
        2 log2(rows) more replays, once per call signature."""
        device, enabled, dtype = call.autocast
        picked = call.outputs
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            try:
                again = self._replay(module, *call.arguments())
            except (RuntimeError, ValueError, TypeError) as err:
                raise self._cannot_replay(module, err) from err
            if picked is None:
                if not isinstance(again, torch.Tensor) or not _close(again, output):
                    raise self._not_reproduced(module)
                again = [again]
            else:  # every leaf that depends on the parameters is reproduced; the per-sample ones are checked below
                recorded, replayed = pytree.tree_leaves(output), pytree.tree_leaves(again)
                if len(replayed) != picked.count or not all(
                        isinstance(replayed[k], torch.Tensor) and _close(replayed[k], recorded[k])
                        for k in (*picked.per_sample, *picked.shared)):
                    raise self._not_reproduced(module)
                again = [replayed[k] for k in picked.per_sample]
            perturbed = {k: _perturb_first(call.leaves[k]) for k in call.batched}
            if not perturbed:
                return
            try:
                moved = self._replay(module, *call.arguments(perturbed))
                moved = [moved] if picked is None else list(picked.pick(moved))
            except (RuntimeError, ValueError, TypeError) as err:
                raise self._cannot_replay(module, err, " with one sample changed") from err
            # the same computation on the same shapes: other samples' rows move by no more than a rounding
            kept = all(_rows_kept(m, a) for m, a in zip(moved, again))
            if kept and every_row:
                kept = self._rows_apart(module, call, again)
            if not kept:
                raise SampleMixingError(
                    f"{self._name(module)} mixes the samples of a batch: changing one sample's input changed the "
                    "outputs of the others (batch statistics, as BatchNorm in training mode computes), so per-sample "
                    "gradients do not exist. Use a per-sample normalisation (nn.GroupNorm, nn.LayerNorm), call "
                    ".eval() on it, or freeze its parameters"
                )

    def _rows_apart(self, module, call, again: list[torch.Tensor]) -> bool:
        """Whether perturbing the rows of each bit set (and then of its complement) moves no other row of the
        per-sample outputs (``_check_independence``'s ``every_row``); under its no_grad and autocast."""
        rows = call.batch
        picked = call.outputs
        number = torch.arange(rows)
        for bit in range(max(1, (rows - 1).bit_length())):
            has_bit = (number >> bit) & 1 == 1
            for changed in (has_bit, ~has_bit):
                if not changed.any() or changed.all():
                    continue
                perturbed = {k: _perturb_rows(call.leaves[k], changed) for k in call.batched}
                try:
                    moved = self._replay(module, *call.arguments(perturbed))
                    moved = [moved] if picked is None else list(picked.pick(moved))
                except (RuntimeError, ValueError, TypeError) as err:
                    raise self._cannot_replay(module, err, " with some rows changed") from err
                for m, a in zip(moved, again):
                    if m.shape != a.shape:
                        return False
                    rest = a[~changed.to(a.device)]
                    same = 4 * torch.finfo(min_dtype(a.dtype, torch.float32)).eps
                    if rest.numel() and not _close(m[~changed.to(m.device)], rest, rest.abs().max(), same):
                        return False
        return True

    def _check_gradient_sum(self, module, call, g, primals, per_sample):
        """Backward check: the per-sample gradients sum to the whole batch's gradient."""
        device, enabled, dtype = call.autocast
        args, kwargs = call.arguments()
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            out, pullback = autograd_vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)
            whole = pullback(self._cotangent(call, out, g))[0]
            # the same sums with a random sign on each term: their size is that of the terms each gradient entry
            # adds up (an RMS estimate), the scale its rounding errors are relative to when the terms cancel
            gen = torch.Generator(device=g.device).manual_seed(12345)  # never the user's random stream
            signs = torch.randint(0, 2, g.shape, generator=gen, device=g.device).to(g.dtype) * 2 - 1
            terms = pullback(self._cotangent(call, out, g * signs))[0]
        computed_in = min_dtype(g.dtype, *(t.dtype for t in whole.values()), *([dtype] if enabled else []))
        # One scale for the whole module, absolute rather than relative to each entry: the largest of its
        # per-sample gradient magnitudes and of the terms its gradients sum. A parameter whose true gradient is 0
        # (`scale * x + bias` before a norm that removes each channel's mean and scale) has per-sample gradients
        # of rounding noise, which no tolerance relative to themselves can tell from mixing; relative to the
        # terms that cancelled they are a few roundings, as any error left in the per-sample norms. Mixing
        # samples moves the sums by as much as the terms themselves.
        sizes = [t.detach().abs().sum(0).max() for t in per_sample.values() if t.numel()]
        sizes += [t.detach().abs().max() for t in terms.values() if t.numel()]
        scale = max((float(s) for s in sizes), default=0.0)
        for name, batch_grad in whole.items():
            summed = per_sample[name].sum(0)
            if not _close(summed, batch_grad, scale, _tolerance(computed_in)):
                raise SampleMixingError(
                    f"{self._name(module)} mixes the samples of a batch: its per-sample gradients of {name!r} do not "
                    "sum to the gradient of the whole batch (batch statistics, or a backward that couples samples), "
                    "so per-sample clipping would be wrong. Use a per-sample normalisation (nn.GroupNorm, "
                    "nn.LayerNorm), register a rule for it with dptrain.register_layer, or freeze its parameters"
                )

    def _not_reproduced(self, module) -> SampleMixingError:
        return SampleMixingError(
            f"{self._name(module)}: replaying this call does not reproduce its output (random operations "
            "such as dropout in training mode, state that changes from call to call, or inputs whose batch "
            "is not their first dimension), so the per-sample "
            f"fallback cannot compute its per-sample gradients. Register a rule for {type(module).__name__} "
            "with dptrain.register_layer, or freeze its parameters"
        )

    def _cannot_replay(self, module, err: BaseException, how: str = "") -> RuntimeError:
        return RuntimeError(
            f"{self._name(module)}: the per-sample fallback could not replay this call{how} ({first_line(err)}). "
            f"Register a rule for {type(module).__name__} with dptrain.register_layer, or freeze its parameters"
        )

    def _name(self, module) -> str:
        return f"{self.label} ({type(module).__name__})" if self.label != type(module).__name__ else self.label


def _flat_bags(module: nn.Module, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]] | None:
    """An ``nn.EmbeddingBag`` called with 1-D ids and ``offsets``: the arguments of each bag alone (its ids, offsets
    ``[0]`` (``[0, n]`` with ``include_last_offset``), its ``per_sample_weights``); ``None`` for any other call.
    Each bag is one sample; the ids of all bags are not a batch dimension, so no per-sample replay can slice them.
    """
    flat = _flat_bag_arguments(module, args, kwargs)
    if flat is None:
        return None
    ids, offsets, weights = flat
    starts = offsets.tolist()  # (in the backward: the boundaries of the bags, read on the host)
    ends = starts[1:] if module.include_last_offset else starts[1:] + [ids.shape[0]]
    starts = starts[:len(ends)]
    bags = []
    for start, end in zip(starts, ends):
        bag_offsets = [0, end - start] if module.include_last_offset else [0]
        bag = {"offsets": torch.tensor(bag_offsets, dtype=offsets.dtype, device=offsets.device)}
        if weights is not None:
            bag["per_sample_weights"] = weights[start:end]
        bags.append(((ids[start:end],), bag))
    return bags


def _flat_bag_arguments(module: nn.Module, args: tuple, kwargs: dict):
    """(ids, offsets, per_sample_weights) of an ``nn.EmbeddingBag`` call with 1-D ids; ``None`` for any other call."""
    if not isinstance(module, nn.EmbeddingBag):
        return None
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    ids, offsets = bound.get("input"), bound.get("offsets")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or offsets is None:
        return None
    return ids, offsets, bound.get("per_sample_weights")


def _tensors_within(obj, depth: int = 0):
    """The tensors in ``obj``: itself, or those its containers and attributes hold (a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and not isinstance(obj, (str, bytes, type, nn.Module)):
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        else:
            items = list(getattr(obj, "__dict__", {}).values())
            items += [getattr(obj, n, None) for n in getattr(type(obj), "__slots__", ()) if isinstance(n, str)]
        for item in items:
            yield from _tensors_within(item, depth + 1)


def _may_change(obj) -> bool:
    """Whether an argument is an object a call could change (a cache of keys and values it adds its own to): not a
    tensor, a plain value, a module, a type or a function."""
    return not (obj is None or isinstance(obj, (torch.Tensor, int, float, bool, str, bytes, complex, torch.dtype,
                                                torch.device, torch.Size, slice, type, nn.Module, enum.Enum))
                or callable(obj))


def _snapshot(obj):
    """A deep copy of ``obj`` whose tensors are its own, detached (no copy of their data); ``obj`` itself where it
    cannot be copied."""
    try:
        return copy.deepcopy(obj, memo={id(t): t.detach() for t in _tensors_within(obj)})
    except Exception:  # an object that cannot be copied: the replay takes it as it is
        return obj


def _tensor_slots(obj, depth: int = 0):
    """(tensor, setter) for each tensor ``_tensors_within(obj)`` yields, in its order; the setter puts another tensor in
    its place (``None`` inside a tuple or set, which cannot be changed in place, or for ``obj`` itself)."""
    if isinstance(obj, torch.Tensor):
        yield obj, None
        return
    if depth >= 4 or isinstance(obj, (str, bytes, type, nn.Module)):
        return
    if isinstance(obj, dict):
        items = [(v, functools.partial(obj.__setitem__, key)) for key, v in obj.items()]
    elif isinstance(obj, list):
        items = [(v, functools.partial(obj.__setitem__, j)) for j, v in enumerate(obj)]
    elif isinstance(obj, (tuple, set, frozenset)):
        items = [(v, None) for v in obj]
    else:
        attrs = getattr(obj, "__dict__", {})
        items = [(v, functools.partial(attrs.__setitem__, name)) for name, v in attrs.items()]
        items += [(getattr(obj, n, None), functools.partial(setattr, obj, n))
                  for n in getattr(type(obj), "__slots__", ()) if isinstance(n, str)]
    for item, setter in items:
        if isinstance(item, torch.Tensor):
            yield item, setter
        else:
            yield from _tensor_slots(item, depth + 1)


class _UnusedOutput(torch.autograd.Function):
    """Copies of tensors that a module's output holds where the per-sample fallback does not differentiate them (a
    cache of keys and values): their gradient is refused, with ``message``, if the loss depends on them."""

    @staticmethod
    def forward(ctx, message: str, *tensors):
        ctx.message = message
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if any(g is not None for g in grads):
            raise ValueError(ctx.message)
        return (None, *grads)


def _rows_kept(moved: torch.Tensor, again: torch.Tensor) -> bool:
    """Whether rows 1.. of a replay with sample 0 changed are those of the replay as it was, to a few roundings
    (the same computation on the same shapes)."""
    if moved.shape != again.shape:
        return False
    rest = again[1:]
    if rest.numel() == 0:
        return True
    same = 4 * torch.finfo(min_dtype(again.dtype, torch.float32)).eps
    return _close(moved[1:], rest, rest.abs().max(), same)


def _perturb_rows(t: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows where ``changed`` is set changed: shifted by noise of the data's scale (floats), or set to the
    next row's values (ids)."""
    changed = changed.to(t.device)
    if t.is_floating_point() or t.is_complex():
        gen = torch.Generator(device=t.device).manual_seed(12345)  # never the user's random stream
        noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype)
        mask = changed.reshape(-1, *([1] * (t.dim() - 1))).to(t.dtype)
        return t + noise * mask * (t.abs().max() + 1)
    return torch.where(changed.reshape(-1, *([1] * (t.dim() - 1))), t.roll(-1, 0), t)


def _perturb_first(t: torch.Tensor) -> torch.Tensor:
    """``t`` with sample 0 changed: shifted by noise of the data's scale (floats), or set to sample 1 (ids)."""
    out = t.clone()
    if t.is_floating_point() or t.is_complex():
        gen = torch.Generator(device=t.device).manual_seed(12345)  # never the user's random stream
        noise = torch.randn(t[0].shape, generator=gen, device=t.device, dtype=t.dtype)
        out[0] += noise * (t.abs().max() + 1)
    else:
        out[0] = t[1]
    return out


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def fallback_refusal(module: nn.Module) -> str | None:
    """Why the fallback does not take ``module`` (``None``: it does).

    torch's recurrent layers, and ``nn.MultiheadAttention`` without ``batch_first=True``, run sequence-first and
    return states without the batch first (``h_n``) or outputs in two layouts (the attention ``[L, B, E]``, its
    weights ``[B, L, S]``), which the fallback cannot take; ``dptrain.fix`` swaps them for versions built from layers
    with exact rules. (``nn.MultiheadAttention(batch_first=True)`` it takes: ``_multihead_attention_reads``.) A
    parameter container (``nn.ParameterDict``, as PEFT's embedding adapters use) is never called.
    """
    if isinstance(module, nn.RNNBase) or (isinstance(module, nn.MultiheadAttention) and not module.batch_first):
        also = " (or build it with batch_first=True)" if isinstance(module, nn.MultiheadAttention) else ""
        return (
            f"the per-sample fallback does not take it (sequence-first, outputs without the batch first); "
            f"dptrain.fix(model) swaps {type(module).__name__} for a version with exact rules (dptrain.nn){also}"
        )
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "it normalises with statistics of the whole batch in training, which mixes samples"
    if isinstance(module, (nn.ParameterDict, nn.ParameterList)):
        return "its parameters are read by the module that holds it, never in a call of its own"
    return None


def fallback_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose trainable parameters the engine would give to the fallback."""
    from . import resolve_rule  # the single place that chooses a module's rule
    from .registry import layer_params

    covered = layer_params(model)
    return [
        name or "<root>" for name, module in model.named_modules()
        if module in covered and isinstance(resolve_rule(module, True), FallbackRule)
    ]


def fallback_warning(names: list[str]) -> str | None:
    """The engine's one-time warning for the layers that use the fallback (``None`` if none do)."""
    if not names:
        return None
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{len(names)} layer(s) have no rule and use the per-sample fallback: {shown}. It is exact but replays "
        "each call with torch.func (one more forward of the layer and a per-sample gradient of its parameters, "
        "B times their size); register a rule with dptrain.register_layer for speed, or pass "
        "allow_fallback=False to refuse such layers"
    )


def _multihead_attention_reads(module: nn.MultiheadAttention) -> tuple[str, ...]:
    """``nn.MultiheadAttention`` runs ``F.multi_head_attention_forward`` on its own projections and on its
    ``out_proj``'s weight and bias, never calling ``out_proj``: it claims them, and the fallback replays the attention
    (an attention-pooling head's: SigLIP's). Only with ``batch_first=True`` (``fallback_refusal``); ``dptrain.fix``
    swaps it for ``dptrain.nn.DPMultiheadAttention``, whose layers have rules (ghost norms), either way."""
    return tuple(f"out_proj.{name}" for name, _ in module.out_proj.named_parameters())


reads_child_params(lambda m: isinstance(m, nn.MultiheadAttention), _multihead_attention_reads)
