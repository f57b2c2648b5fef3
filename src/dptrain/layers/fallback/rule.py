"""``FallbackRule``: the layer rule that assembles the fallback's parts (the call's arguments, container and
guarded outputs, the batch-axis search, folded rows, flat bags, the one-sample-at-a-time replay, the checks that
samples stay apart) and runs the replays themselves: the ``vmap`` of the ``vjp`` of a batch-first call, and the
two-pass modes' second pass, one replay of the whole call with each sample's output gradient scaled."""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..._checks import first_line
from ..numerics import scale_samples, swap01, weighted_sum
from ..protocol import LayerDims, LayerRule
from ..registry import container_params
from .arguments import _CallArguments
from .bags import _FlatBags
from .batch_axes import _AxisAssignment, _BatchAxes
from .container_outputs import _ContainerOutputs
from .folded import _FoldedRowReplays
from .guarded_outputs import _GuardedOutputs
from .independence import SampleMixingError, _SampleChecks
from .one_by_one import _OneSampleAtATime
from .records import FallbackCall, FallbackOperands
from .replay_context import autograd_vjp, replay


class FallbackRule(_CallArguments, _ContainerOutputs, _GuardedOutputs, _BatchAxes, _FoldedRowReplays,
                   _OneSampleAtATime, _FlatBags, _SampleChecks, LayerRule):
    """Per-sample gradients of a module's own trainable parameters by replaying its calls (``torch.func``).

    One instance per module (``dptrain.layers.resolve_rule`` builds it); it is never registered.
    """

    fallback = True
    takes_output_leaves = True
    # LayerRule's optional hooks, which two of the parts implement, named here (as the bases' order resolves them):
    # the type check reads a method in one base and an optional hook in another as a conflict
    before_call = _CallArguments.before_call
    regroup_call = _FoldedRowReplays.regroup_call

    def __init__(self, module: nn.Module, name: str | None = None, batch_first: bool = True):
        # its own parameters, and those it reads from its parameter containers (by dotted name)
        self.param_names = tuple(n for n, _ in module.named_parameters(recurse=False)) + container_params(module)
        # its path in the model ("" is the root), which every refusal names; its class where no path was given
        self.label = (name or "<root>") if name is not None else type(module).__name__
        # batch_first=False: the engine hands rules every tensor of 2 or more dims with dims 0 and 1
        # swapped (the batch first), the output and its gradient too; a replay swaps them back
        self.swapped = not batch_first
        # Nothing read from a call's values is kept for another call (see independence.py): what is kept per call
        # signature chooses how a call is replayed or which reading to verify first, and each call is checked.
        #: call signatures that vmap cannot replay: one replay per sample (``_per_sample_one_by_one``)
        self._one_by_one: set[tuple] = set()
        self._warned_one_by_one = False
        #: calls whose batch is not the leading axis of every argument and output: per call signature and output
        #: leaves, the assignment of batch axes (``_AxisAssignment``) verified last, verified again at each call
        #: before it is used; None where none verified and the leading rows are left to the row reader
        self._axes_found: dict[tuple, _AxisAssignment | None] = {}
        #: call signatures whose leading rows were seen apart, every row from every other (``_rows_apart``): a route to
        #: the reading by leading rows, whose later calls check row 0 and, in the backward, each sample's replay
        #: against the call and the gradient sum (a row that moves another then refuses the call: exact or refused)
        self._apart: set[tuple] = set()
        #: what ``batch_not_leading`` verified of the call whose capture follows it: (a weak reference to its output,
        #: "rows" and the call's signature where its leading rows were checked, or "axes" and the assignment verified)
        self._verified_now: tuple | None = None
        #: the objects among the arguments of the call running now, as they were before it (``before_call``)
        self._before: dict[int, tuple[Any, Any]] = {}
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
        if call.batch > 1 and not output.is_meta and not self._checked_just_now(output, call.signature):  # meta: plan
            # at every call: a module may mix samples only on some data, and one sample cannot show it
            try:
                self._check_independence(module, call, output)
            except SampleMixingError:
                # an argument as long as the batch may be shared by every sample (timm EVA's rotary table [N, d]
                # with N = B, a mask [T, T] with T = B): those whose first row, changed alone, moves the others
                shared = self._shared_arguments(module, call, output)
                if not shared:
                    raise
                self._share(call, shared)
                self._check_independence(module, call, output)
        return call

    def _checked_just_now(self, output, signature) -> bool:
        """Whether ``batch_not_leading`` checked this very call's leading rows just before (``_check_rows``)."""
        return self._verified_for(output, "rows") == signature

    def _verified_for(self, output, kind: str):
        """What ``batch_not_leading`` verified (``kind``) of the call whose output is ``output``, once; else None."""
        seen, self._verified_now = self._verified_now, None
        if seen is None or seen[0]() is not output or seen[1] != kind:
            return None
        return seen[2]

    def _refuse_output_hooks(self, module, output: torch.Tensor) -> None:
        if output._backward_hooks:
            # The engine reads the output gradient after these hooks, and the replay's vjp would run them again.
            raise ValueError(
                f"{self._name(module)}: its forward registers a hook on its output's gradient (register_hook), which "
                "the per-sample fallback, replaying the forward, would apply twice. Register that hook on the output "
                "outside the module's forward, or register a rule for it with dptrain.register_layer"
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

    def clipped_grads(self, module, ops, factors) -> dict[str, torch.Tensor]:
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
        # each sample's replayed rows, returned by the vmap at no cost, are checked against the whole call's (one row
        # broadcast over the batch, or no argument with the batch: every sample's replay is the same call)
        rows_checked = bool(batched) and not call.broadcast

        def one_sample(batched_leaves, g_i):
            args, kwargs = call.arguments({k: t.unsqueeze(0) for k, t in zip(batched, batched_leaves)})

            def forward(p):
                return self._replay_out(module, call, args, kwargs, p)

            out, pullback = torch.func.vjp(forward, primals)
            grads = pullback(self._cotangent(call, out, g_i.unsqueeze(0)))[0]
            return (grads, self._joined(call, out)) if rows_checked else grads

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
        # Checked at every call: whether the module keeps these samples apart depends on their values.
        whole = self._whole_vjp(module, call, primals)  # one replay for both checks
        if rows_checked:
            grads, outs = grads
            if not self._rows_reproduced(call, outs.flatten(0, 1), whole[0]):
                raise self._split_refusal(module, one_by_one=False)
        self._check_gradient_sum(module, call, g, primals, grads, whole)
        return grads

    def _cannot_replay(self, module, err: BaseException, how: str = "") -> RuntimeError:
        return RuntimeError(
            f"{self._name(module)}: the per-sample fallback could not replay this call{how} ({first_line(err)}). "
            f"Register a rule for {type(module).__name__} with dptrain.register_layer, or freeze its parameters"
        )

    def _name(self, module) -> str:
        return f"{self.label} ({type(module).__name__})" if self.label != type(module).__name__ else self.label


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__
