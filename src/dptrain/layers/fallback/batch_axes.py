"""The batch at another axis: a module run sequence-first inside a batch-first model (XLNet's relative attention
takes h [T, B, d], a mask [T, T, B, 1], positions [2T, B, d] and returns [T, B, d]). The batch axis of each argument
and output leaf is found among the axes of size B (several where B equals T) and verified, never taken from a
shape."""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ..protocol import OutputLeaves
from .independence import SampleMixingError, _close, _perturb_first, _rows_kept
from .parts import _FallbackParts
from .records import FallbackCall

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


class _BatchAxes(_FallbackParts):
    """``FallbackRule``'s search for the batch axes of a call (mixed into it; see the module's docstring).

    A call is searched only where its leading axis is not verified as the batch: the batch-first reading's check
    failed, or no output leaf that depends on the parameters leads with the batch while one has it at another axis.
    Each candidate is verified: the whole replay reproduces the call; perturbing one sample along the chosen axes of
    the arguments moves that sample's outputs along the chosen output axes and no other sample's; replaying each
    sample alone (its slice along each chosen axis, the other arguments whole) reproduces its outputs. Where two
    assignments verify, their per-sample gradients (for a random output gradient) must agree, or the call is
    refused. The assignment found is kept per call pattern (``_axes_found``), as the one to try first: each later
    call verifies it again on its own values (a few replays, not a search) and searches again where it fails. (An
    assignment that failed on some call is no reading of the module; the one kept verifies on every call.)"""

    # its state, which FallbackRule.__init__ sets and describes
    _axes_found: dict[tuple, _AxisAssignment | None]
    _apart: set[tuple]
    _verified_now: tuple | None

    def _axes_after_refusal(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...],
                            paths: tuple[str, ...], batch: int | None, err: SampleMixingError) -> _AxisAssignment:
        """The batch-first reading was refused (perturbing row 0 moved other rows): the verified assignment of batch
        axes, or that refusal, naming the module."""
        found = None
        if not self.swapped and batch is not None and batch > 1:
            found = self._axes_of_call(module, call, leaves, depends, paths, batch)
        if found is None:
            raise SampleMixingError(
                f"{err} (No assignment of the batch to other axes of size {batch} of its arguments and outputs "
                "verified either: replaying each sample alone did not reproduce the call, or changing one sample "
                "moved the others.)") from None
        return found

    def _axes_of_call(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...],
                      paths: tuple[str, ...], batch: int) -> _AxisAssignment | None:
        """The assignment of batch axes verified on this call: the one verified last for this call pattern where it
        verifies again (each call's values decide: a search runs once per pattern, its verification at every call),
        else the one a search verifies (kept for the next calls), else None."""
        key = (call.signature, depends)
        known = self._axes_found.get(key)
        if known is not None:
            if self._assignment_holds(module, call, leaves, depends, known):
                return known
            del self._axes_found[key]
        found = self._search_axes(module, call, leaves, depends, paths, batch)
        if found is not None:
            self._keep_axes(key, found)
        return found

    def _assignment_holds(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...],
                          found: _AxisAssignment) -> bool:
        """The checks ``_search_axes`` verified ``found`` with, on this call's values: the whole replay reproduces the
        call, one sample changed along its axes moves that sample's outputs alone, each sample alone gives its own."""
        axes, per_sample, outs = dict(found.args), found.picked.per_sample, found.picked.axes
        assert outs is not None  # (an assignment's output leaves have their batch axes)
        device, enabled, dtype = call.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            whole = self._whole_leaves(module, call, leaves, depends)
            expected = [whole[k].movedim(o, 0) for k, o in zip(per_sample, outs)]
            return (self._moves_one_sample(module, call, axes, per_sample, outs, expected) is True
                    and self._samples_reproduce(module, call, axes, per_sample, outs, expected))

    def _check_rows(self, module, call: FallbackCall, output, again=None) -> None:
        """``_check_independence`` of a call whose leading rows may not be the samples, every row apart on the first
        call of its pattern (2 log2(rows) replays) and while they are seen so, row 0 alone after (``_apart``)."""
        every_row = call.signature not in self._apart
        try:
            self._check_independence(module, call, output, every_row=every_row, again=again)
        except SampleMixingError:
            self._apart.discard(call.signature)
            raise
        if every_row:
            if len(self._apart) >= 256:
                self._apart.clear()
            self._apart.add(call.signature)

    def _keep_axes(self, key, found) -> None:
        if len(self._axes_found) >= 256:  # shapes that change at every step: verifying again is always safe
            self._axes_found.clear()
        self._axes_found[key] = found

    def batch_not_leading(self, module, args, kwargs, output: torch.Tensor, batch: int | None) -> bool:
        """For the capture: whether a call with a tensor output has its batch at another axis than the first
        (verified on this call); such a call is then taken through its leaves (``capture_leaves``), whose gradient
        the engine hands over with the batch first. Looks only at a call whose output has an axis of size ``batch``
        after the first."""
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
        err = None
        # The reading by leading rows first (the batch first, or rows folded into the batch, which the row reader
        # then maps to samples: windows [B * W, N, d] with N = B), checked as capture_call would, every row apart:
        # where changing one leading row of the arguments moves only that row of the output, the call is left to it
        # (and capture_call does not check it again). Where the leading rows are not the batch and mix, an
        # assignment of batch axes decides, and a call none verifies is left to the row reader too (rows of one
        # sample that interact are replayed together: regroup_call). Checked at every call: the values decide.
        self._set_rows(module, args, kwargs, call, output.shape[0])
        if call.batched:
            try:
                self._check_rows(module, call, output)
            except SampleMixingError as e:
                err = e if output.shape[0] == batch else None
            else:
                self._verified_now = (weakref.ref(output), "rows", call.signature)
                return False
        call.batched, call.batch = [], 0
        found: _AxisAssignment | None
        if err is not None:
            found = self._axes_after_refusal(module, call, [output], (0,), ("",), batch, err)
        elif key in self._axes_found and self._axes_found[key] is None:
            # no assignment verified on this pattern before: a route, not a verdict, since the row reader and the
            # checks of the rows' replays read this call's values (a search costs tens of replays)
            return False
        else:
            found = self._axes_of_call(module, call, [output], (0,), ("",), batch)
            if found is None:
                self._keep_axes(key, None)
        if found is None:
            return False
        self._verified_now = (weakref.ref(output), "axes", found)
        return True

    def _whole_leaves(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...]) -> list:
        """The leaves of the call replayed whole, each that depends on the parameters as recorded (else refused);
        under the caller's no_grad and autocast."""
        try:
            whole = pytree.tree_leaves(self._replay(module, *call.arguments()))
        except (RuntimeError, ValueError, TypeError) as err:
            raise self._cannot_replay(module, err) from err
        if len(whole) != len(leaves) or not all(
                isinstance(whole[k], torch.Tensor) and whole[k].shape == leaves[k].shape
                and _close(whole[k], leaves[k]) for k in depends):
            raise self._not_reproduced(module)
        return whole

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
            whole = self._whole_leaves(module, call, leaves, depends)
            out_options = itertools.product(*[[a for a, n in enumerate(leaves[k].shape) if n == batch]
                                              for k in per_sample])
            tried = 0
            for outs in out_options:
                expected = [whole[k].movedim(o, 0) for k, o in zip(per_sample, outs)]
                # each argument alone: the axes along which one sample's change moves that sample only; where it
                # moves nothing (the sample's data makes it so: a mask over tokens all alike), the axes, or shared
                options: dict[int, list[int | None]] = {}
                for k, sized in candidates.items():
                    moves = {a: self._moves_one_sample(module, call, {k: a}, per_sample, outs, expected) for a in sized}
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
        assert axes is not None  # (a call whose batch axes were found: apply set them)

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
        self._check_gradient_sum(module, call, g, primals, grads)  # at every call: it reads values
        return grads


def _perturb_along(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` with sample 0 along ``axis`` changed (``_perturb_first`` on that axis)."""
    return _perturb_first(t.movedim(axis, 0)).movedim(0, axis) if axis else _perturb_first(t)
