"""The hooks on each covered layer's call: ghost differentiation's switch (a layer's parameters do not require
grad during its own call), the call's record (its activation, its pattern, its ordinal) and the reading of its
output gradient (a node pre-hook on the node that made the output, after every tensor hook)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.utils import _pytree as pytree

from ..layers.fallback import in_replay
from ..layers.numerics import swap01
from ..layers.protocol import LayerDims, OutputLeaves
from ..rows.outputs import FROM_INPUT
from ..rows.proof import call_edge
from .broadcast import BroadcastRows, broadcast_rows, rows_of, shared_use_marker
from .call_inputs import batch_to_front, broadcast_rows_of, of_own_parameter, requires_grad_in
from .calls import Call, LayerState, in_backward
from .distributed import is_dtensor
from .graph_nodes import _GradientPenalty, _Origin, _OutputLeaves


class LayerHooks:
    """The hooks on each covered layer (a mixin of ``capture.Capture``, whose state they share): the parameters
    switched off during the layer's own call, the call recorded with its activation, its output gradient read where
    the node that made the output receives it, container outputs and capture sites."""

    if TYPE_CHECKING:  # what they use of ``capture.Capture``'s state and methods (set and described there)
        dry: bool
        paused: bool
        batch_first: bool
        called: list[LayerState]
        on_grad: Callable[[LayerState, Call, torch.Tensor], None]
        forward_batch: int | None
        forward_precision: torch.dtype | None
        _open_forward: int | None
        _ordinals: dict[int, int]
        _recomputed_ordinals: dict[int, int]
        _from_input: set[int]
        _input_storages: dict[int, tuple | None]
        _own_handles: int
        _own_ids: set[int]
        _pre_ids: dict[int, int]
        _post_ids: dict[int, int]
        _anchors: dict[torch.device, torch.Tensor]
        _switched: dict[int, list[list[nn.Parameter]]]
        _view_outputs: list
        _broadcasting: bool

        def _forward_of_outside_call(self) -> int: ...

    def _tracking(self) -> bool:
        return self.dry or torch.is_grad_enabled()

    def _anchor(self, device: torch.device) -> torch.Tensor:
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = torch.zeros((), device=device, requires_grad=True)
            self._anchors[device] = anchor
        return anchor

    def _check_hook_order(self, module: nn.Module, state: LayerState) -> None:
        """The engine's pre-hook must run last and its forward hook first: a user hook between them and the
        forward could change the output the engine differentiates, or use the weight while autograd does not
        track it (both would make the per-sample gradients silently wrong)."""
        # (iter: torch.compile in torch 2.8 and earlier traces reversed() of a dict as a tuple)
        if (next(iter(reversed(module._forward_pre_hooks)), None) == self._pre_ids[id(module)]
                and next(iter(module._forward_hooks), None) == self._post_ids[id(module)]
                and not _module_globals._global_forward_hooks):
            return  # the usual case, without building lists on every call
        pre_ids = list(module._forward_pre_hooks)
        mine = self._pre_ids[id(module)]
        after = [k for k in pre_ids[pre_ids.index(mine) + 1:] if k not in self._own_ids] if mine in pre_ids else []
        post_ids = list(module._forward_hooks)
        mine = self._post_ids[id(module)]
        before = [k for k in post_ids[: post_ids.index(mine)] if k not in self._own_ids] if mine in post_ids else []
        foreign_global = [
            h for h in _module_globals._global_forward_hooks.values()
            if not getattr(h, "__module__", "").startswith("torch.")
        ]
        if after or before or foreign_global:
            where = ("a global forward hook (register_module_forward_hook)" if foreign_global else
                     "a forward pre-hook registered after engine.attach()" if after else
                     "a forward hook registered with prepend=True after engine.attach()")
            raise RuntimeError(
                f"{state.path} ({type(module).__name__}) has {where}, which runs between the engine's "
                "hooks and the layer's forward: it could change the output or use the weight where the engine "
                "cannot see it, so the per-sample gradients could be silently wrong. Register your hooks on this "
                "layer before engine.attach() (without prepend=True), or on another module"
            )

    def _make_pre_hook(self, module: nn.Module):
        capture = weakref.ref(self)

        def pre_hook(module, inputs, kwargs=None):
            if not torch.is_grad_enabled():
                return None  # (evaluation: nothing to record; the hooks cost this test alone)
            self = capture()
            state = self._state_of.get(id(module)) if self is not None else None
            # A replay by the per-sample fallback runs children as they are: nothing to switch or record.
            if state is None or self.paused or self.dry or in_replay():
                return None
            self._check_hook_order(module, state)
            if state.rule.before_call is not None:  # (the fallback keeps a cache passed in as it is before the call)
                state.rule.before_call(module, inputs, kwargs or {})
            params = self._current_params(state) if self.params_by_name else state.params.values()
            switched = [p for p in params if p.requires_grad]
            for p in switched:
                p.requires_grad_(False)
            self._switched.setdefault(id(module), []).append(switched)
            if not self._carried:
                return None
            uncarried = self._uncarried(inputs, kwargs)
            if uncarried is not None:
                self._from_input.add(id(module))
            return uncarried

        return pre_hook

    def _quietly(self, hook):
        """A layer hook of the engine's, which does nothing in evaluation (the hooks then cost this test alone)."""
        capture = weakref.ref(self)

        def quiet(*args, **kwargs):
            alive = capture()
            if alive is None or not (alive.dry or torch.is_grad_enabled()):
                return None
            return hook(*args, **kwargs)

        return quiet

    @staticmethod
    def _current_params(state: LayerState) -> list[nn.Parameter]:
        """The parameter objects registered during this call (FSDP2's unsharded ones)."""
        params = [state.module.get_parameter(name) for name in state.params]
        if any(is_dtensor(p) for p in params):
            raise NotImplementedError(
                f"{state.name!r} runs its forward with DTensor parameters (tensor parallelism): the engine's "
                "rules need the full weight in every call. Shard with fully_shard (FSDP2) only"
            )
        return params

    def _restore(self, module: nn.Module) -> None:
        stack = self._switched.get(id(module))
        if stack:
            for p in stack.pop():
                p.requires_grad_(True)
            if not stack:
                del self._switched[id(module)]

    def _make_post_hook(self, module: nn.Module):
        capture = weakref.ref(self)

        def post_hook(module, args, kwargs, output):
            self = capture()
            if self is None or not (self.dry or torch.is_grad_enabled()) or in_replay():
                return None
            if self.paused:  # not recorded; a gradient penalty through this call is refused all the same
                state = self._state_of.get(id(module))
                if state is not None and torch.is_grad_enabled():
                    leaves = [output] if isinstance(output, torch.Tensor) else pytree.tree_leaves(output)
                    for leaf in leaves:
                        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                            self._on_gradient(leaf, state, lambda g: None)
                return None
            self._restore(module)
            if self._passthrough is not None and not in_backward():
                return None  # (a call whose input depends on outside parameters: not trained, not recorded)
            state = self._state_of.get(id(module))
            if state is None or state.rule.captures_input or not self._tracking() or output is None:
                return None  # (None: the forward raised, and this always-called hook runs on its way out)
            if not isinstance(output, torch.Tensor) and state.rule.takes_output_leaves:
                return self._record_leaves(state, module, args, kwargs, output)
            if self._batch_not_leading(state, module, args, kwargs, output):
                return self._record_leaves(state, module, args, kwargs, output)
            if not isinstance(output, torch.Tensor):
                state.rule.capture_call(module, args, kwargs, output)  # a rule may refuse with its own reason
                raise ValueError(
                    f"{state.path} ({type(module).__name__}) returned {type(output).__name__}, not a "
                    "tensor: the engine differentiates a layer with trainable parameters through its output tensor, "
                    "so these parameters would get no gradient. Register a rule for it with dptrain.register_layer, "
                    "or freeze its parameters"
                )
            return self._record(state, module, (args, kwargs), output)

        return post_hook

    def _batch_not_leading(self, state: LayerState, module: nn.Module, args, kwargs, output) -> bool:
        """A tensor output of a batch-first model whose batch the rule verified at another axis than the first (the
        per-sample fallback on a module run sequence-first, ``[T, B, d]``): it is taken through its leaves, whose
        gradient reaches the rule with the batch first. Only an output with an axis of the batch's size after the
        first is looked at (once per call pattern, by the rule)."""
        if not self.batch_first or not isinstance(output, torch.Tensor) or output.dim() < 2:
            return False
        check = getattr(state.rule, "batch_not_leading", None)
        if check is None:
            return False
        batch = self.forward_batch if self._open_forward is not None or in_backward() else None
        if batch is None or batch <= 1 or batch not in output.shape[1:]:
            return False
        return check(module, args, kwargs, output, batch)

    def _make_source_hook(self, module: nn.Module, site: int, from_input: bool):
        """Keeps a capture site's activation (its source's output or first input) until its target runs."""

        def keep(source, tensor):
            state = self._state_of.get(id(module))
            if state is None or in_replay() or self.paused:
                return
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{state.name}: the activation source {type(source).__name__} of capture site "
                                f"{site} gave {type(tensor).__name__}, not a tensor")
            self._sources[(id(module), site)] = tensor.detach()

        def source_pre_hook(source, inputs):
            if self._tracking():
                keep(source, inputs[0] if inputs else None)

        def source_hook(source, inputs, output):
            if self._tracking():
                keep(source, output)

        return self._quietly(source_pre_hook if from_input else source_hook)

    def _make_input_hook(self, module: nn.Module, site: int = 0, has_source: bool = False):
        """For rules that read the gradient of a tensor entering a submodule (``capture_sites``)."""

        def input_hook(target, inputs):
            state = self._state_of.get(id(module))
            if (state is None or not self._tracking() or in_replay() or self.paused or not inputs
                    or not isinstance(inputs[0], torch.Tensor)):
                return None
            captured = inputs
            if has_source:
                kept = self._sources.pop((id(module), site), None)
                if kept is None:
                    raise RuntimeError(
                        f"{state.name}: {type(target).__name__} ran before the activation source of capture site "
                        f"{site}: the rule's capture_sites do not match this module's forward"
                    )
                captured = (kept,)
            return (self._record(state, state.module, captured, inputs[0], site), *inputs[1:])

        return self._quietly(input_hook)

    def _record(self, state: LayerState, module: nn.Module, inputs: tuple, tensor: torch.Tensor,
                site: int | None = None) -> torch.Tensor:
        """Keep the activation, and hook the gradient of ``tensor`` (a layer output, or a hooked input)."""
        recomputed = in_backward()
        forward_batch = self.forward_batch if self._open_forward is not None or recomputed else None
        # A table broadcast over the batch that an earlier layer handed over ([1, ...], broadcast.py) is seen by the
        # rule as its rows over the batch, the call's output too where it is one (a LayerNorm on a position table).
        if self._broadcasting:
            inputs = broadcast_rows_of(inputs)
        broadcast = type(tensor) is BroadcastRows
        if broadcast:
            tensor = rows_of(tensor)
        seen_output = tensor
        if not self.batch_first:
            # Sequence first: a tensor [T, B, ...] is given to the rules as [B, T, ...]; one that already leads with
            # the batch (a pooled [B, d]) stays; with T == B it stays as it is for a rule whose rows are read over
            # both leading axes (either layout is then found from the gradient), and is refused for the others.
            inputs = batch_to_front(inputs, forward_batch, state)
            seen_output = batch_to_front(tensor, forward_batch, state)
        if site is None:
            args, kwargs = inputs
            activation = state.rule.capture_call(module, args, kwargs, seen_output)
            source = self._given_model_input((*args, *kwargs.values()))
        else:
            activation = state.rule.capture_at(module, site, inputs, seen_output)
            source = self._given_model_input(inputs)
        output_swapped = seen_output is not tensor
        if not self.dry and tensor.grad_fn is None and tensor.requires_grad and of_own_parameter(tensor, state):
            # A parameter of the layer itself, or a view of one made while its flag was off (a class token's
            # cls.expand(B, -1, -1)): its gradient would go to the parameter without reaching the engine. The rule
            # differentiates the call itself (the fallback's replay); the model gets the values, with no history
            # (a view of them: _Origin copies a view rather than mark the parameter's storage as written).
            tensor = tensor.detach().view_as(tensor)
        if not tensor.requires_grad and not self.dry:
            tensor = _Origin.apply(self._anchor(tensor.device), tensor)
            if self._from_input and id(module) in self._from_input:  # (given the model's input as it is)
                self._from_input.discard(id(module))
                tensor.grad_fn.metadata[FROM_INPUT] = True  # type: ignore[union-attr, index]  # (_Origin's node; torch's stub: metadata a method, a dict in fact)
        seen = swap01(tensor) if output_swapped else tensor
        if seen.dim() and seen.shape[0] == 1 and forward_batch is not None and forward_batch != 1:
            if not self.batch_first:
                raise ValueError(
                    f"{state.path} ({type(module).__name__}) got an input broadcast over the batch "
                    "(batch size 1); expand it to the batch first"
                )
            expanded = state.rule.expand_batch(module, activation, tensor, forward_batch)
            if expanded is not None:
                activation, tensor = expanded
                seen = tensor
                broadcast = forward_batch > 0  # (an empty batch has no row to hand over: it gets the empty rows)
        call = self._new_call(state, activation, state.rule.dims(module, activation, seen), tuple(seen.shape),
                              forward_batch, recomputed)
        if source is not None:
            call.source = source
        if self.dry:
            return tensor
        returned: torch.Tensor
        if broadcast:  # the model gets the layer's own [1, ...] output; the engine hooks its rows over the batch
            call.broadcast = True
            self._broadcasting = True  # (from now on, layer inputs are looked into for its rows)
            returned = broadcast_rows(tensor, shared_use_marker(call), f"{state.path} ({type(module).__name__})")
        else:
            returned = tensor
        if output_swapped:
            call.edge_swapped = True
        self._on_gradient(tensor, state, None, call)
        return returned

    def _given_model_input(self, values) -> tuple | None:
        """Whether a layer's inputs are the model's input (or a view of it) as it is, no gradient required by any: its
        rows are then the samples in their order, which no gradient can show (``Call.source``). None if not; else the
        first such input's place in the model's (``rows.layout.source_samples``), () where it cannot be told."""
        storages = self._input_storages
        if not storages or requires_grad_in(values):
            return None
        for v in values:
            if isinstance(v, torch.Tensor) and v.numel():
                ptr = v.untyped_storage().data_ptr()
                if ptr in storages:
                    where = storages[ptr]
                    return () if where is None else (v.storage_offset(), v.stride(), v.shape, *where)
        return None

    def _new_call(self, state: LayerState, activation, dims: LayerDims, shape: tuple, forward_batch: int | None,
                  recomputed: bool) -> Call:
        """A layer call waiting for its output gradient, numbered in its model call (or its recomputation)."""
        # Which sample each row belongs to is read from the gradient (rows.py), never taken from the shape.
        version = activation._version if isinstance(activation, torch.Tensor) else None
        forward_id = None if recomputed else self._open_forward
        if forward_id is None and not recomputed and not self.dry:
            forward_id = self._forward_of_outside_call()
        call = Call(activation, dims, forward_batch, version, forward_id, recomputed)
        call.shape = shape
        call.precision = self.forward_precision
        if forward_batch is not None:
            ordinals = self._recomputed_ordinals if recomputed else self._ordinals
            call.ordinal = ordinal = ordinals.get(id(state.module), 0)
            ordinals[id(state.module)] = ordinal + 1
        state.calls.append(call)
        if self.dry:  # sizes are all a plan needs; nothing holds the call but this list
            call.activation = None
            state.calls.hold(call)
            if len(state.calls) == 1:
                self.called.append(state)
        return call

    def _record_leaves(self, state: LayerState, module: nn.Module, args: tuple, kwargs: dict, output):
        """A call whose output is a container of tensors (tuple, list, dict, Hugging Face ModelOutput), for a rule that
        takes it whole (the per-sample fallback): the leaves that depend on the layer's trainable parameters
        (``OutputLeaves``) pass through one ``_OutputLeaves`` node, whose backward hands the call their gradients,
        joined ``[rows, ...]``, zeros for a leaf without one. The rows of the joined gradient are read like a tensor
        output's (tag passes). A leaf that depends on the parameters without leading with the call's rows (a table
        broadcast over the batch, a scalar) is refused if a gradient reaches it; leaves that do not depend on them
        are left as they are (their gradients reach the layers that made them)."""
        recomputed = in_backward()
        forward_batch = self.forward_batch if self._open_forward is not None or recomputed else None
        taken = state.rule.capture_leaves(module, args, kwargs, output, forward_batch)
        if taken is None:
            return None  # nothing in the output depends on the layer's trainable parameters
        activation, picked = taken
        leaves, spec = pytree.tree_flatten(output)
        call = None
        if picked.per_sample:
            first = leaves[picked.per_sample[0]]
            call = self._new_call(state, activation, state.rule.dims(module, activation, first),
                                  (picked.rows, picked.width), forward_batch, recomputed)
        if self.dry:
            return None
        gathered = (*picked.per_sample, *picked.shared)
        device = leaves[gathered[0]].device
        copies = _OutputLeaves.apply(self._anchor(device), self._leaves_reader(state, call, picked),
                                     *(leaves[k] for k in gathered))
        for k, copy in zip(gathered, copies):
            leaves[k] = copy
        return pytree.tree_unflatten(leaves, spec)

    def _leaves_reader(self, state: LayerState, call: Call | None, picked: OutputLeaves):
        """What the ``_OutputLeaves`` node of a call does with its leaves' gradients (see ``_record_leaves``)."""
        count = len(picked.per_sample)
        where = f"{state.path} ({type(state.module).__name__})"
        capture = weakref.ref(self)  # (the graph holds this: not the capture)

        def read(grads: tuple) -> tuple:
            self = capture()
            if self is None:
                return grads
            if self.paused:  # as _on_gradient: nothing is read, and a gradient penalty is marked
                if not torch.is_grad_enabled():
                    return grads
                return tuple(g if g is None else _GradientPenalty.apply(g, where, capture) for g in grads)
            for k, g in zip(picked.shared, grads[count:]):
                if g is not None:
                    raise ValueError(
                        f"{where}: its output {picked.paths[k] or '(the whole output)'} depends on the layer's "
                        f"trainable parameters but does not lead with the call's {picked.rows} rows (one per sample), "
                        "and the loss depends on it: which sample its gradient comes from cannot be told, so the "
                        "per-sample fallback cannot clip it. Give that output the batch as its first dimension "
                        "(expand a table broadcast over the batch to it), compute it from the parameters outside "
                        f"this module, register a rule for {type(state.module).__name__} with "
                        "dptrain.register_layer, or freeze its parameters"
                    )
            if call is not None and any(g is not None for g in grads[:count]):
                self.on_grad(state, call, picked.join(grads[:count]))
            return grads

        return read

    def _on_gradient(self, tensor: torch.Tensor, state: LayerState, read: Callable[[torch.Tensor], None] | None,
                     call: Call | None = None) -> None:
        """Call ``read`` with the gradient of ``tensor`` as the node that made it receives it (None: hand it to the
        engine as ``call``'s, as the rule sees it: ``call.edge_swapped``).

        A node pre-hook runs after every tensor hook, so the engine reads the gradient that actually reaches the
        layer (a user's ``h.register_hook(lambda g: 3 * g)`` on the output included), whatever the order in which
        the hooks were registered. A leaf (a layer that returned its input as it is) has no node: its own tensor
        hooks are all there is.
        """
        node, index, shape = tensor.grad_fn, tensor.output_nr, None
        base = tensor._base if tensor._is_view() else None
        if (base is not None and base.grad_fn is not None and base.numel() == tensor.numel()
                and base.is_contiguous() and tensor.is_contiguous()
                and base.storage_offset() == tensor.storage_offset()):
            # A reshape of a tensor of its own (nn.Linear on [B, T, d] returns a view of a [B*T, p] product): an
            # in-place op on it (`h /= 2`) rewrites the view's history, and neither its node nor its tensor hooks
            # see a gradient any more. The base's node does, in place or not: its gradient, reshaped, is this one.
            node, index, shape = base.grad_fn, base.output_nr, tensor.shape
        elif base is not None and self._open_forward is not None and not in_backward():
            # any other view: an in-place op on it would hide its gradient (checked when the model call returns;
            # ``broadcast``: the rows of a table, which the table's own writes leave readable, broadcast.py)
            broadcast = call is not None and call.broadcast
            self._view_outputs.append((tensor, tensor._version, state, broadcast))  # (held until the call returns)
        swapped = read is None and call is not None and call.edge_swapped
        self._own_handles += 1  # (the hook registered below: not a user's, for Capture._hooked)
        if node is None:
            if read is None:
                def read(grad):
                    self.on_grad(state, call, swap01(grad) if swapped else grad)
            tensor.register_hook(read)
            return
        if call is not None:
            call.edge = call_edge(node, index)
            if shape is not None:
                assert base is not None  # (a shape is kept for a view of its base only)
                call.edge_shape, call.edge_view = tuple(base.shape), tuple(shape)

        def pre_hook(grad_outputs):
            grad = grad_outputs[index]
            if grad is None:
                return None
            if shape is not None:
                grad = grad.reshape(shape)
            if self.paused and torch.is_grad_enabled():
                # A differentiable gradient (create_graph=True) under paused(): mark it, so that a loss built on
                # it (a gradient penalty) cannot be back-propagated into the step.
                marked = list(grad_outputs)
                marked[index] = _GradientPenalty.apply(grad, f"{state.path} ({type(state.module).__name__})",
                                                       weakref.ref(self))
                return tuple(marked)
            if read is None:  # (the usual case: the engine's own reading, one closure per call)
                self.on_grad(state, call, swap01(grad) if swapped else grad)
            else:
                read(grad)
            return None

        node.register_prehook(pre_hook)
