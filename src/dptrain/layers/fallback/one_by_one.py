"""The one-sample-at-a-time replay: per-sample gradients of a batch-first call that ``vmap`` cannot run (data-
dependent control flow, ``.item()``, a custom ``autograd.Function`` without ``setup_context``), each sample's rows
replayed alone and differentiated by plain autograd, checked as the ``vmap`` is."""
from __future__ import annotations

import functools
import warnings

import torch

from ..._checks import first_line
from .independence import SampleMixingError
from .parts import _FallbackParts
from .replay_context import autograd_vjp


class _OneSampleAtATime(_FallbackParts):
    """``FallbackRule``'s replay of one sample at a time (mixed into it)."""

    # its state, which FallbackRule.__init__ sets and describes
    _one_by_one: set[tuple]
    _warned_one_by_one: bool

    def _per_sample_one_by_one(self, module, call, g, primals, vmap_error: BaseException | None = None):
        """Per-sample gradients of a batch-first call that vmap cannot run: each sample's rows replayed alone (a
        batch of one), differentiated by plain autograd, B replays in a loop. As exact as the vmap (the same
        replay, sample by sample) and as checked, at every call: each sample's replay must reproduce its rows of the
        call's output, and the per-sample gradients must sum to the whole call's gradient. Slower (B
        forwards and backwards of the module instead of one vectorised), never larger: one sample's gradient graph
        at a time."""
        device, enabled, dtype = call.autocast
        grads: dict[str, list[torch.Tensor]] = {n: [] for n in primals}
        outs = []
        try:
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                for i in range(call.batch):
                    args, kwargs = call.arguments({k: call.leaves[k][i:i + 1] for k in call.batched})
                    out, pullback = autograd_vjp(functools.partial(self._replay_out, module, call, args, kwargs), primals)
                    for n, t in pullback(self._cotangent(call, out, g[i:i + 1]))[0].items():
                        grads[n].append(t)
                    outs.append(self._joined(call, out))
        except SampleMixingError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            how = " one sample at a time" + (f" (vmap: {first_line(vmap_error)}), nor in a loop"
                                             if vmap_error is not None else "")
            raise self._cannot_replay(module, err, how) from err
        stacked = {n: torch.stack(ts) if ts else primals[n].new_zeros(0, *primals[n].shape)
                   for n, ts in grads.items()}
        # checked at every call, as the vmap is: whether a sample alone computes as in the batch depends on the data
        whole = self._whole_vjp(module, call, primals)
        if outs and not self._rows_reproduced(call, torch.cat(outs), whole[0]):
            raise self._split_refusal(module, one_by_one=True)
        self._check_gradient_sum(module, call, g, primals, stacked, whole)
        if vmap_error is not None and not self._warned_one_by_one:
            self._warned_one_by_one = True
            warnings.warn(
                f"{self._name(module)}: vmap cannot run this module ({first_line(vmap_error)}), so the per-sample "
                f"fallback replays it one sample at a time: {call.batch} forwards and backwards of the module per call "
                "instead of one vectorised (the memory plan() shows is unchanged). Register a rule for "
                f"{type(module).__name__} with dptrain.register_layer for speed, or freeze its parameters",
                stacklevel=2)
        # Which replay runs a signature is a choice of method, not a verdict: each call is checked whichever runs it.
        if len(self._one_by_one) >= 256:
            self._one_by_one.clear()
        self._one_by_one.add(call.signature)
        return stacked

    def _split_refusal(self, module, one_by_one: bool) -> SampleMixingError:
        """Each sample replayed alone does not reproduce its rows of the call's output: the module computes a sample
        differently by the batch it is in (no branch on the batch's size or content, no randomness may do so)."""
        how = (" (vmap cannot run this module, so the per-sample fallback replays one sample at a time)"
               if one_by_one else "")
        return SampleMixingError(
            f"{self._name(module)}: replaying each sample alone{how} does not reproduce that sample's output in the "
            "batch: the module computes a sample differently by the batch it is in (a branch on the batch's size or "
            "values, a capacity or a selection across the batch, random operations), so the per-sample fallback "
            f"cannot split it. Register a rule for {type(module).__name__} with dptrain.register_layer, or freeze "
            "its parameters"
        )
