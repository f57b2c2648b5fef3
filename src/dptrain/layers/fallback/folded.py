"""Calls whose rows are not the samples in order (windows or tokens folded into the batch, as window attention
calls its modules on ``[B * windows, N, d]``; rows reordered or routed): regrouped by ``regroup_call`` with the
sample of each row (read by ``dptrain.rows``), each sample's rows replayed alone, as the sample's own forward
calls the module."""
from __future__ import annotations

import dataclasses

import torch

from .independence import SampleMixingError
from .parts import _FallbackParts
from .records import FallbackOperands, FoldedRows
from .replay_context import autograd_vjp


class _FoldedRowReplays(_FallbackParts):
    """``FallbackRule``'s per-sample gradients of calls with rows folded into the batch (mixed into it)."""

    def regroup_call(self, module, activation, grad, samples, batch):
        """A call whose rows are the samples in another order or layout (``LayerRule.regroup_call``): windows or
        tokens folded into the batch (``[B * windows, N, d]``), rows reordered or routed.

        Its per-sample gradients replay, for each sample, that sample's rows alone (in the call's order) as the
        call's batch, with the other arguments as recorded, and take the vjp of the module's own parameters with
        the rows' output gradients: a vmap over the samples where each has as many rows, one replay per sample
        otherwise. That is the module call a one-sample forward makes, row for row: a mask over the windows given
        once for all images (Swin's shifted windows) pairs with each sample's windows as it does there. The rows'
        independence is checked when the call is recorded (perturbing one row moves no other), and at every call
        that each sample's replay reproduces its rows of the call and that the per-sample gradients sum to the
        call's gradient. The two-pass modes' second pass replays the whole call once, each row's output
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
        replayed alone, checked at every call (whether they reproduce the call depends on the data: an expert's
        capacity that some batches overflow).

        An argument that leads with as many entries as there are samples, while the outputs' rows are their tokens,
        may be per sample (a router given [B, T, d] that returns [B * T, experts]: each sample's replay then takes
        its own row of it) or shared (a mask over B windows that happen to be as many as the samples). Which one
        is read, not assumed, at every call: the replay by sample first, kept if it reproduces the call (where the
        samples' rows are alike, FiLM conditioned on one class for every sample, both readings do, and by sample
        gives no sample another's row); else every such argument whole."""
        call = rows.call
        candidates = [k for k, t in enumerate(call.leaves)
                      if k not in call.batched and rows.batch != call.batch and isinstance(t, torch.Tensor)
                      and t.dim() > 0 and t.shape[0] == rows.batch]
        if not candidates:
            return self._replay_rows(module, rows, primals, [])
        try:
            return self._replay_rows(module, rows, primals, candidates)
        except (SampleMixingError, RuntimeError, ValueError, TypeError) as by_sample:
            try:
                return self._replay_rows(module, rows, primals, [])
            except (SampleMixingError, RuntimeError, ValueError, TypeError) as whole:
                raise whole from by_sample

    def _replay_rows(self, module, rows: FoldedRows, primals, by_sample: list[int]):
        """``_per_sample_of_rows`` with the arguments at ``by_sample`` taken one row per sample: the replays must
        reproduce the call's rows and sum to its gradient (``SampleMixingError`` otherwise)."""
        call, g = rows.call, rows.grad
        order, counts = rows.chunks()
        positions = [*call.batched, *by_sample]

        def one_sample(sample_leaves, g_s, vjp=torch.func.vjp):
            args, kwargs = call.arguments(dict(zip(positions, sample_leaves)))
            out, pullback = vjp(lambda p: self._replay_out(module, call, args, kwargs, p), primals)
            # the outputs for the check (vmap returns tensors only)
            return pullback(self._cotangent(call, out, g_s))[0], self._joined(call, out)

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
                    grads, outs = vmapped[0], vmapped[1].flatten(0, 1)
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
                        sample_grads, out = one_sample(leaves, g[idx.to(g.device)], autograd_vjp)  # (plain autograd)
                        for n, t in sample_grads.items():
                            grads[n].append(t)
                        outs.append(out)
                    grads = {n: torch.stack(ts) if ts else p.new_zeros(0, *p.shape)
                             for (n, ts), p in zip(grads.items(), primals.values())}
                    outs = torch.cat(outs) if outs else None
        except SampleMixingError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            raise self._cannot_replay(module, err, " one sample's rows at a time") from err
        whole = self._whole_vjp(module, call, primals)  # one replay for both checks
        self._check_folded_outputs(module, call, order, outs, whole[0])
        known = (rows.samples >= 0).to(g.device).reshape(-1, *([1] * (g.dim() - 1)))
        self._check_gradient_sum(module, call, g * known, primals, grads, whole)
        return grads

    def _check_folded_outputs(self, module, call, order, outs, whole):
        """Each sample's rows replayed alone reproduce those rows of the call (``whole``: its replayed output): the
        module pairs no row with another input by its position in the whole call (a mask laid out for another order
        of the rows), and drops or routes no row by the others (an expert's capacity)."""
        if outs is None:
            return
        if not self._rows_reproduced(call, outs, whole, order):
            raise SampleMixingError(
                f"{self._name(module)}: its rows are samples folded into the batch (windows, tokens), and replaying "
                "each sample's rows alone does not reproduce them: the module treats a row by its place in the whole "
                "call (an argument such as a mask laid out for another order of the rows, or rows that depend on the "
                "number of rows), so the per-sample fallback cannot split it. Give the layer the batch as its first "
                f"dimension, register a rule for {type(module).__name__} with dptrain.register_layer, or freeze its "
                "parameters"
            )
