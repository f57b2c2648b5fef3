"""The checks that a module keeps the samples of a batch apart, at every call: the replay reproduces the call,
changing one sample's (or row's) input moves no other's output, each sample replayed alone reproduces its rows, and
the per-sample gradients sum to the whole call's; their tolerances and perturbations, and the refusal they raise
(``SampleMixingError``).

Every one of them reads values, so none is kept for the next call: a module may mix samples only on some data (an
expert with a capacity that overflows on some batches, a mixing weight that is 0 at first, a mask that keeps every
row apart on some batches, a batch of one sample, which nothing can mix), and a verdict read on one call says
nothing about the next of the same shapes."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..numerics import close
from .parts import _FallbackParts
from .replay_context import autograd_vjp


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


class SampleMixingError(RuntimeError):
    """A module given to the fallback does not treat the samples of a batch independently."""


class _SampleChecks(_FallbackParts):
    """``FallbackRule``'s checks that samples stay apart (mixed into it)."""

    def _whole_vjp(self, module, call, primals):
        """(output, pullback) of the call replayed whole under its autocast state (``autograd_vjp``): one replay that
        serves the backward's checks, the per-sample replays' outputs against it and the gradient sum."""
        device, enabled, dtype = call.autocast
        args, kwargs = call.arguments()
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return autograd_vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)

    def _check_independence(self, module, call, output, every_row: bool = False, again=None):
        """Forward check: the replay reproduces the output, and perturbing sample 0 moves no other sample.

        ``again``: the leaves of a replay of the call already made (``_depending``'s), used instead of another.

        ``every_row``: where the leading rows may not be the samples (the batch also sits at another axis, or the rows
        are not as many as the samples), also no row moves another: row 0 alone may be apart by the data (a token
        every sample masks, XLNet's left padding) while the others mix. Perturbing, for each bit of a row's number,
        the rows with that bit set, then those without it, moves each row apart from each other at least once:
        2 log2(rows) more replays."""
        device, enabled, dtype = call.autocast
        picked = call.outputs
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            if again is None:
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
        shifts = {k: _row_shift(call.leaves[k]) for k in call.batched}  # (the same change at every bit)
        same = [4 * torch.finfo(min_dtype(a.dtype, torch.float32)).eps for a in again]
        for bit in range(max(1, (rows - 1).bit_length())):
            has_bit = (number >> bit) & 1 == 1
            for changed in (has_bit, ~has_bit):
                if not changed.any() or changed.all():
                    continue
                perturbed = {k: _perturb_rows(call.leaves[k], changed, shifts[k]) for k in call.batched}
                try:
                    moved = self._replay(module, *call.arguments(perturbed))
                    moved = [moved] if picked is None else list(picked.pick(moved))
                except (RuntimeError, ValueError, TypeError) as err:
                    raise self._cannot_replay(module, err, " with some rows changed") from err
                for m, a, tol in zip(moved, again, same):
                    if m.shape != a.shape:
                        return False
                    rest = a[~changed.to(a.device)]
                    if rest.numel() and not _close(m[~changed.to(m.device)], rest, rest.abs().max(), tol):
                        return False
        return True

    def _check_gradient_sum(self, module, call, g, primals, per_sample, whole=None):
        """Backward check: the per-sample gradients sum to the whole batch's gradient. ``whole``: the call's
        ``_whole_vjp`` where the caller has made it already."""
        device, enabled, dtype = call.autocast
        out, pullback = self._whole_vjp(module, call, primals) if whole is None else whole
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            whole = pullback(self._cotangent(call, out, g))[0]
        computed_in = min_dtype(g.dtype, *(t.dtype for t in whole.values()), *([dtype] if enabled else []))
        tol = _tolerance(computed_in)
        # One scale for the whole module, absolute rather than relative to each entry: the largest of its
        # per-sample gradient magnitudes and of the terms its gradients sum. A parameter whose true gradient is 0
        # (`scale * x + bias` before a norm that removes each channel's mean and scale) has per-sample gradients
        # of rounding noise, which no tolerance relative to themselves can tell from mixing; relative to the
        # terms that cancelled they are a few roundings, as any error left in the per-sample norms. Mixing
        # samples moves the sums by as much as the terms themselves.
        sizes = [t.detach().abs().sum(0).max() for t in per_sample.values() if t.numel()]
        scale = max((float(s) for s in sizes), default=0.0)
        summed = {name: per_sample[name].sum(0) for name in whole}
        if all(_close(summed[name], batch_grad, scale, tol) for name, batch_grad in whole.items()):
            return  # within the smaller scale: the terms' size, which only widens it, need not be read
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            # the same sums with a random sign on each term: their size is that of the terms each gradient entry
            # adds up (an RMS estimate), the scale its rounding errors are relative to when the terms cancel
            gen = torch.Generator(device=g.device).manual_seed(12345)  # never the user's random stream
            signs = torch.randint(0, 2, g.shape, generator=gen, device=g.device).to(g.dtype) * 2 - 1
            terms = pullback(self._cotangent(call, out, g * signs))[0]
        scale = max([scale] + [float(t.detach().abs().max()) for t in terms.values() if t.numel()])
        for name, batch_grad in whole.items():
            if not _close(summed[name], batch_grad, scale, tol):
                raise SampleMixingError(
                    f"{self._name(module)} mixes the samples of a batch: its per-sample gradients of {name!r} do not "
                    "sum to the gradient of the whole batch (batch statistics, or a backward that couples samples), "
                    "so per-sample clipping would be wrong. Use a per-sample normalisation (nn.GroupNorm, "
                    "nn.LayerNorm), register a rule for it with dptrain.register_layer, or freeze its parameters"
                )

    def _rows_reproduced(self, call, outs, whole, order=None) -> bool:
        """Whether the per-sample replays' outputs ``outs`` (joined, rows in ``order`` of the call's rows) are those
        rows of the whole call's replayed output ``whole`` (``_whole_vjp``'s)."""
        joined = self._joined(call, whole)
        if order is not None:
            joined = joined[order.to(joined.device)]
        return _close(outs, joined)

    def _not_reproduced(self, module) -> SampleMixingError:
        return SampleMixingError(
            f"{self._name(module)}: replaying this call does not reproduce its output (random operations "
            "such as dropout in training mode, state that changes from call to call, or inputs whose batch "
            "is not their first dimension), so the per-sample "
            f"fallback cannot compute its per-sample gradients. Register a rule for {type(module).__name__} "
            "with dptrain.register_layer, or freeze its parameters"
        )


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


def _row_shift(t: torch.Tensor) -> torch.Tensor:
    """What ``_perturb_rows`` puts in a changed row of ``t``: ``t`` shifted by noise of the data's scale (floats), or
    the next row's values (ids)."""
    if t.is_floating_point() or t.is_complex():
        gen = torch.Generator(device=t.device).manual_seed(12345)  # never the user's random stream
        noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype)
        return t + noise * (t.abs().max() + 1)
    return t.roll(-1, 0)


def _perturb_rows(t: torch.Tensor, changed: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows where ``changed`` is set taken from ``shifted`` (``_row_shift``'s)."""
    return torch.where(changed.to(t.device).reshape(-1, *([1] * (t.dim() - 1))), shifted, t)


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
