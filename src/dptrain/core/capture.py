"""Forward/backward hooks that record, per layer call, the activation and the output gradient.

Ghost differentiation (book-keeping paper, section 2.1): a layer's parameters are switched to ``requires_grad=False``
for the duration of its own forward call only, so autograd records no parameter-gradient work (the non-private
gradient is never computed) while output gradients still flow; the engine forms every parameter gradient itself. A
layer whose input does not require grad (the first trainable layer) then gets its output attached to an engine-owned
"origin" leaf, so back-propagation still reaches it. Outside its layer's call a parameter keeps requiring grad, so any
other use of it reaches autograd and is caught by the engine instead of escaping clipping.

The model's own call is hooked too: its input gives the batch size (read, never inferred
from what a layer happens to see), a forward that raises drops what it recorded, and its
output's gradient marks the start of a plain ``loss.backward()``. An evaluation in ``eval()`` mode with gradients
enabled is deferred from its second model call on (``deferred.py``). A layer call recorded
while a backward pass runs is a recomputation (activation checkpointing) and is marked so.

A layer's output gradient is read by a pre-hook on the node that made the output, which runs after
every tensor hook (a user's hook that scales it counts). A training forward that writes a buffer or
parameter of the model is refused (``StateWrites``: version counters). The hooks the model holds are
``EngineHook``s: a deep or pickled copy of the model gets inert ones, and no engine.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

from ..layers.fallback import in_replay
from ..rows import InputRows, RowReader, computing_precision, map_tensors, refuse_uncarried, tensors_in
from ..rows.inputs import CarriedRows, _InputRowsNode
from ..rows.losses import mark_outputs
from .calls import Call, LayerState, graph_task, in_backward
from .deferred import DeferredCall, wrap_outputs
from .graph_nodes import EngineHook, guard_written_base
from .hooks_aside import HooksAside
from .layer_hooks import LayerHooks
from .state_writes import StateWrites


def batch_size_of(inputs, dim: int) -> int | None:
    """The batch size of a model call: dimension ``dim`` of its first input tensor with more dimensions than that,
    or a PackedSequence's number of sequences (``batch_sizes[0]``; its ``data`` holds the tokens of all of them).
    ``None``: no such input."""
    for item in tensors_in(inputs, whole=(PackedSequence,)):
        if isinstance(item, PackedSequence):
            return int(item.batch_sizes[0]) if item.batch_sizes.numel() else 0  # (batch_sizes lives on the CPU)
        if item.dim() > dim:
            return item.shape[dim]
    return None


class Capture(LayerHooks):
    """Installs and removes the hooks; the engine reacts to what they record.

    ``set_layers`` may be called again while installed (the trainable set changed): hooks look up each module's
    current state, so a module that is no longer covered records nothing, and newly covered modules are hooked.
    """

    def __init__(self, model: nn.Module, on_grad: Callable[[LayerState, Call, torch.Tensor], None] | None, *,
                 on_model_call: Callable[[], None], on_output_grad: Callable[[], None] | None,
                 params_by_name: bool = False, batch_first: bool = True, dry: bool = False,
                 rows: RowReader | None = None):
        self.model = model
        #: the engine's row maps: which calls of a model call still need their rows read by a tag pass
        self.rows = rows if rows is not None else RowReader()
        self._ordinals: dict[int, int] = {}  # per layer: how many calls it made in this model call / recomputation
        self._recomputed_ordinals: dict[int, int] = {}
        #: the open model call's tensors that carry its input's rows (``rows.InputRows``): id(copy) -> (copy, the
        #: tensor it copies, the copy's version when made); a covered layer given one directly gets the original
        self._carried: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._readings = 0  # how many the open model call made
        #: torch's hook counter when the open model call started, and the hooks the engine registered since
        self._handles_at, self._own_handles = 0, 0
        self._from_input: set[int] = set()  # covered layers called on the model's input as it is (``_uncarried``)
        #: the storages of the open model call's integer inputs with the batch (ids): an untrained embedding of them,
        #: or of a view of them, is carried too (``_embedding_hook``)
        self._input_ids: set[int] = set()
        self._input_storages: dict[int, tuple | None] = {}  # the call's inputs with the batch: storage -> geometry
        self._embeddings: dict[int, nn.Module] = {}  # the embeddings hooked for their output (``_embedding_hook``)
        #: the open model call's input depends on trainable parameters outside the model (a GAN's generated samples):
        #: the model is a function for it, not trained (``_outside_parameters``)
        self._passthrough: str | None = None
        #: the model call that layer calls made outside any belong to (``_forward_of_outside_call``)
        self._last_forward: int | None = None
        self._outside_groups = 0
        #: the graph task of the last backward that went through such a call's output
        self.passthrough_task = -1
        #: set by the engine: replaces a model call's outputs by tagging ones, for a plain backward (outputs, whether
        #: the input's rows can be followed through the graph)
        self.on_tag_outputs: Callable[[Any, bool], Any] | None = None
        #: set by the engine: a gradient reached a scalar output of the model (a loss computed inside it)
        self.on_scalar_output_grad: Callable[[], None] | None = None
        #: set by the engine: the gradient of a tensor carrying the model input's rows (``rows.InputRows``)
        self.on_input_grad: Callable[[Any, torch.Tensor], None] | None = None
        #: ``plan()``'s dry forward: every call recorded (sizes only, gradients on or off), nothing switched or hooked
        self.dry = dry
        self.called: list[LayerState] = []  # dry: the layers in the order of their first call
        self.params_by_name = params_by_name
        self.batch_first = batch_first
        self.on_grad = on_grad  # type: ignore[assignment]  # (None: set by the engine before any backward)
        self.on_model_call = on_model_call
        self.on_output_grad: Callable[[], None] = on_output_grad  # type: ignore[assignment]  # (likewise)
        self.layers: list[LayerState] = []
        self._model_tensors: list[torch.Tensor] = []  # every parameter and buffer, frozen ones too (their dtypes)
        self._state_of: dict[int, LayerState] = {}
        self._hooked: dict[int, nn.Module] = {}  # by id, with the module itself (an id is reused after a module dies)
        self._checked: dict[int, nn.Module] = {}
        #: while set (engine.paused()), nothing is switched or recorded
        self.paused = False
        self._handles: list[Any] = []
        self._own_ids: set[int] = set()  # ids of every hook the engine registered (for the order checks)
        #: ids of the hooks on the covered layers and their capture sites, set aside under no_grad (hooks_aside)
        self._layer_hook_ids: set[int] = set()
        self._aside = HooksAside()
        self._pre_ids: dict[int, int] = {}
        self._pre_hook_fns: dict[int, Callable] = {}
        self._post_ids: dict[int, int] = {}
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._switched: dict[int, list[list[nn.Parameter]]] = {}
        self._sources: dict[tuple[int, int], torch.Tensor] = {}  # capture-site activations awaiting their target
        self._view_outputs: list = []  # (output, its version, layer) of this model call's outputs that are views
        #: a layer output broadcast over the batch was made (broadcast.py): layer inputs are looked into for its rows
        self._broadcasting = False
        #: batch size of the model's current forward call, read from its first tensor argument
        self.forward_batch: int | None = None
        #: the lowest precision the open model call computes in (``rows.computing_precision``), for reading rows
        self.forward_precision: torch.dtype | None = None
        self._forward_count = 0
        self._open_forward: int | None = None  # id of a model call that has not returned yet
        #: the open model call, deferred (an evaluation in eval() mode with gradients enabled: deferred.py)
        self._deferred: DeferredCall | None = None
        #: set by the engine: eval() calls may be deferred (its backwards go through engine.backward, in one process)
        self.defer_evaluations = False
        #: the last model call was in eval() mode and no backward came since: a next one in eval() mode is deferred
        self._eval_run = False
        #: model calls deferred since the last backward (engine.backward looks for them only then)
        self.deferred_calls = 0
        #: set while engine.backward replays a deferred call: it is recorded
        self.replaying = False
        self._finished_forward = False
        #: the model's buffers and parameters, checked for writes by each training forward
        self.state_writes = StateWrites(model, buffers_only=params_by_name)

    # ------------------------------------------------------------------ install / remove
    def install(self, layers: list[LayerState], extra_checks: Sequence[tuple[nn.Module, Callable]] = ()) -> None:
        self._keep(self.model.register_forward_pre_hook(EngineHook(self._model_pre_hook), with_kwargs=True,
                                                          prepend=True))
        self._keep(self.model.register_forward_hook(EngineHook(self._model_post_hook), prepend=True))
        self._keep(self.model.register_forward_hook(EngineHook(self._model_failed_hook), always_call=True))
        self.add_checks(extra_checks)
        self.set_layers(layers)

    def add_checks(self, checks: Sequence[tuple[nn.Module, Callable]]) -> None:
        """Forward pre-hooks that refuse a module's call (a frozen BatchNorm in training mode), once per module."""
        for module, check in checks:
            if self._checked.get(id(module)) is not module:
                self._checked[id(module)] = module
                self._keep(module.register_forward_pre_hook(EngineHook(check)))

    def _keep(self, handle):
        self._handles.append(handle)
        self._own_ids.add(handle.id)
        return handle

    def _keep_layer_hook(self, handle):
        self._layer_hook_ids.add(handle.id)
        return self._keep(handle)

    def set_layers(self, layers: list[LayerState]) -> None:
        self.layers, self._model_tensors = layers, [*self.model.parameters(), *self.model.buffers()]
        self._state_of = {id(s.module): s for s in layers}
        for state in layers:
            if self._hooked.get(id(state.module)) is state.module:
                continue
            module = state.module
            self._hooked[id(module)] = module
            self._pre_hook_fns[id(module)] = EngineHook(self._make_pre_hook(module))
            keep = self._keep_layer_hook
            pre = keep(module.register_forward_pre_hook(self._pre_hook_fns[id(module)], with_kwargs=True))
            post = keep(module.register_forward_hook(
                EngineHook(self._make_post_hook(module)), always_call=True, with_kwargs=True, prepend=True))
            self._pre_ids[id(module)], self._post_ids[id(module)] = pre.id, post.id
            if state.rule.captures_input:
                for k, site in enumerate(state.rule.capture_sites(module)):
                    if site.source is not None and site.source_input:
                        keep(site.source.register_forward_pre_hook(EngineHook(self._make_source_hook(module, k, True))))
                    elif site.source is not None:
                        keep(site.source.register_forward_hook(EngineHook(self._make_source_hook(module, k, False))))
                    keep(site.target.register_forward_pre_hook(
                        EngineHook(self._make_input_hook(module, k, site.source is not None))))
        if not self.dry:
            for module in self.model.modules():
                if isinstance(module, nn.Embedding) and self._embeddings.get(id(module)) is not module:
                    self._embeddings[id(module)] = module
                    self._keep(module.register_forward_hook(EngineHook(self._embedding_hook)))
        self._aside.forget_modules()

    def remove(self) -> None:
        self._aside.put_back()
        self._end_carrying()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._own_ids.clear()
        self._hooked.clear()
        self._checked.clear()
        self._embeddings.clear()
        self.restore_switched()
        for state in self.layers:
            state.calls.clear()
        self._sources.clear()

    def restore_switched(self) -> None:
        """Give back ``requires_grad`` to parameters of a layer call that never returned (an interrupt)."""
        for stack in self._switched.values():
            for switched in stack:
                for p in switched:
                    p.requires_grad_(True)
        self._switched.clear()

    # ------------------------------------------------------------------ the model's own call
    @torch._dynamo.disable  # (bookkeeping by counters: traced, every model call would recompile)
    def _model_pre_hook(self, module, args, kwargs):
        if in_backward() or not self._tracking() or in_replay() or self.paused:
            if not self._tracking() and not in_backward() and not in_replay():
                self._aside.set_aside(self.model, self._layer_hook_ids)  # (evaluation: nothing to record)
            return None  # a recomputation (checkpointing), evaluation, a fallback's replay, or paused
        if self._defers(module, args, kwargs):
            return None
        if self._open_forward is not None:
            # The last model call never returned (an exception the always-called hook could not
            # see, such as KeyboardInterrupt): drop what it recorded.
            self.drop_forward(self._open_forward)
        hooked = self._hooked.get(id(module)) is module
        self.on_model_call()
        if not hooked and self._hooked.get(id(module)) is module:  # the model became a layer: its pre-hook missed
            self._pre_hook_fns[id(module)](module, args)
        self._forward_count += 1
        self._open_forward = self._forward_count
        self._finished_forward = False
        dim = 0 if self.batch_first else 1
        self.forward_batch = batch_size_of((args, kwargs), dim)
        self._ordinals.clear()
        self._view_outputs = []
        self._end_carrying()
        self._handles_at, self._own_handles = RemovableHandle.next_id, 0
        device = next((t.device for t in tensors_in((args, kwargs))), None)
        dtypes = {t.dtype for t in self._model_tensors}  # (a walk of the model's modules costs about 1 ms a forward)
        self.forward_precision = (computing_precision(device, dtypes) if device is not None and not self.dry else None)
        self._passthrough = None if self.dry else _outside_parameters((args, kwargs), self.model)
        if torch.is_grad_enabled() and not self.dry:
            self.state_writes.before()
        if self._passthrough is None and not self.dry and torch.is_grad_enabled():
            refuse_uncarried((args, kwargs), self.forward_batch, dim)
            return self._carry_inputs(args, kwargs, dim) if self.forward_batch else None
        return None

    # ------------------------------------------------------------------ the rows of the model's input
    def _carry_inputs(self, args, kwargs, axis: int):
        """The model call's floating-point inputs with the batch along ``axis`` (in any container), each replaced by a
        copy that carries its rows (``_carry``); None if there is none. So whatever the forward computes from them
        before a trainable layer (a normalisation, a mixup, a frozen part of the model) is in the autograd graph,
        where the row check proves or reads it at every step."""
        batch = self.forward_batch

        def carry(t: torch.Tensor) -> torch.Tensor:
            if t.dim() <= axis or t.shape[axis] != batch:
                return t
            ptr, where = t.untyped_storage().data_ptr(), (t.storage_offset(), t.stride(axis), batch)  # (contiguous:
            self._input_storages[ptr] = (where if t.is_contiguous() and self._input_storages.get(ptr, where) == where
                                         else None)  # a row's sample is read from its offset; None: inputs disagree)
            if not t.is_floating_point():
                if not t.is_complex() and t.numel():  # ids: an embedding of them (or of a view) is carried
                    self._input_ids.add(t.untyped_storage().data_ptr())
                return t
            return self._carry(t, (axis,))

        carried = map_tensors((args, kwargs), carry)
        return None if carried is (args, kwargs) else carried

    def _carry(self, t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        """A copy of ``t`` through ``_InputRowsNode``: it requires gradients, its gradient read where not proven."""
        assert self.forward_batch is not None  # (an open model call's)
        reading = InputRows(self.forward_batch, axes, self.forward_precision)
        self._readings += 1
        copy = _InputRowsNode.apply(self._anchor(t.device), t, reading, self.on_input_grad).as_subclass(CarriedRows)
        self._carried[id(copy)] = (copy, t, copy._version)
        return copy

    def _uncarried(self, args: tuple, kwargs: dict | None):
        """A covered layer's arguments with each copy made by ``_carry`` (not modified since) replaced by the tensor
        it copies: the layer's rows are its samples, read from its output's gradient, and nothing is back-propagated
        into the model's input for it (a first layer costs what it costs without the engine). None if none."""
        carried = self._carried

        def original(a):
            got = carried.get(id(a)) if isinstance(a, torch.Tensor) else None
            return got[1] if got is not None and got[0] is a and a._version == got[2] else a

        new_args = tuple(original(a) for a in args)
        new_kwargs = {k: original(v) for k, v in kwargs.items()} if kwargs else kwargs
        if all(a is b for a, b in zip(new_args, args)) and (
                not kwargs or new_kwargs is not None and all(new_kwargs[k] is v for k, v in kwargs.items())):
            return None
        return new_args, new_kwargs if new_kwargs is not None else {}

    def _embedding_hook(self, module, args, output):
        """The output of an embedding that is not trained (a frozen one, as in LoRA), of the model's ids (or a view of
        them): carried as the model's input is (``_carry``), since what the forward computes from it before a
        trainable layer is part of the input's rows."""
        if (self._open_forward is None or self.paused or self.dry or self._passthrough is not None
                or id(module) in self._state_of or not torch.is_grad_enabled() or in_backward() or in_replay()):
            return None
        axis = 0 if self.batch_first else 1
        ids = args[0] if args else None
        if (not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.requires_grad
                or not isinstance(ids, torch.Tensor) or ids.dim() <= axis or ids.shape[axis] != self.forward_batch
                or ids.untyped_storage().data_ptr() not in self._input_ids):
            return None  # (ids the forward made, such as relative positions, do not carry the input's rows)
        return self._carry(output, (axis,))

    def _mark_hooked(self, forward_id: int) -> None:
        """A hook was registered during this model call by someone else than the engine (every hook's handle counts
        in torch's ``RemovableHandle.next_id``): a tensor's gradient hook acts on the gradient outside the graph, so
        none of the call's rows is proven (a module's hook registered meanwhile counts too: its rows are read)."""
        for state in self.layers:
            for call in state.calls:
                if call.forward_id == forward_id:
                    call.hooked = True

    def _end_carrying(self) -> None:
        self._carried.clear()
        self._from_input.clear()
        self._input_ids.clear()
        self._input_storages.clear()
        self._readings = 0

    def _defers(self, module, args, kwargs) -> bool:
        """Whether this model call is deferred (``deferred.py``): in eval() mode with gradients enabled, right after
        another such call with no backward between them; then its layers' hooks are set aside for it."""
        eval_run, self._eval_run = self._eval_run, not module.training
        if (module.training or not eval_run or not self.defer_evaluations or self.replaying or self.dry
                or self._open_forward is not None or _GRADIENT_EDGE is None):
            return False
        dim = 0 if self.batch_first else 1
        inputs = [t for t in tensors_in((args, kwargs)) if isinstance(t, torch.Tensor)]
        batch = batch_size_of((args, kwargs), dim)
        if not batch or any(t.requires_grad for t in inputs):  # (a saliency map's input: its gradient is the point)
            return False
        self._deferred = DeferredCall(module, args, kwargs, inputs, batch, dim)
        self.deferred_calls += 1
        self._aside.set_aside(self.model, self._layer_hook_ids)
        return True

    def _forward_of_outside_call(self) -> int:
        """The model call a layer call made outside any belongs to: the last one since the last backward (a head applied
        to the model's output), or a group of its own (negative ids) that the other calls outside it join until the
        next backward. So a backward split at a detached activation (two backwards of one forward's samples, each
        clipped on its own) is seen as a model call back-propagated twice."""
        if self._last_forward is None:
            self._outside_groups += 1
            self._last_forward = -self._outside_groups
        return self._last_forward

    def backward_ended(self) -> None:
        """A backward completed: layer calls outside a model call are now another forward's, of its own batch."""
        self._last_forward = None
        self.forward_batch = None
        self._eval_run = False
        self.deferred_calls = 0

    def _check_view_outputs(self) -> None:
        """A covered layer's output that is a view of part of another tensor, modified in place afterwards: its
        gradient would never reach the engine (the in-place op rewrites the view's history)."""
        views, self._view_outputs = self._view_outputs, []
        for tensor, version, state, broadcast in views:
            if tensor._version != version and broadcast:
                guard_written_base(tensor, state)  # (writes into the table itself: broadcast.py)
            elif tensor._version != version:
                raise ValueError(
                    f"the output of {state.path} ({type(state.module).__name__}), a view of another tensor, was "
                    "modified in place after the layer returned it (e.g. `h /= 2` or `h += x`): its gradient cannot "
                    "be read any more. Use an out-of-place operation (`h = h / 2`)"
                )

    def new_pass(self) -> None:
        """A backward pass starts: recomputed calls are numbered afresh (they match the tag pass's by number)."""
        self._recomputed_ordinals.clear()

    @torch._dynamo.disable
    def _model_post_hook(self, module, args, output):
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._aside.put_back()
            return wrap_outputs(output, deferred, self._anchor)
        if in_backward() or self._open_forward is None or in_replay() or self.paused:
            return None
        carried = self._readings > 0  # the input's rows can be followed through the graph
        self._end_carrying()
        if RemovableHandle.next_id - self._handles_at > self._own_handles:
            self._mark_hooked(self._open_forward)
        self.state_writes.check()  # (a refusal: the always-called hook drops this call)
        self._check_view_outputs()
        self._finished_forward = True
        forward_id, self._open_forward = self._open_forward, None
        self._last_forward = forward_id
        if self._passthrough is not None:  # the model was a function of outside parameters: nothing is trained
            self._passthrough = None
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._passthrough_grad_hook)
            return None
        replaced = None
        if torch.is_grad_enabled() and not self.dry:
            if self.on_tag_outputs is not None:  # a plain backward proves its rows, or reads them, from its outputs
                replaced = self.on_tag_outputs(output, carried)
            returned = replaced if replaced is not None else output
            for t in tensors_in(returned):
                if t.requires_grad:
                    t.register_hook(self._scalar_output_hook if t.dim() == 0 else self._output_grad_hook)
            # (the loss check finds the per-sample outputs by these marks, in their autograd nodes)
            mark_outputs(returned, self.forward_batch, 0 if self.batch_first else 1, forward_id, self.forward_precision)
        return replaced

    def _output_grad_hook(self, grad):
        self.on_output_grad()

    def _passthrough_grad_hook(self, grad):
        self.passthrough_task = graph_task()

    def _scalar_output_hook(self, grad):
        if self.on_scalar_output_grad is not None:
            self.on_scalar_output_grad()
        self.on_output_grad()

    def _model_failed_hook(self, module, args, output):
        self._aside.put_back()  # (always called: also when the forward raised)
        self._deferred = None
        self._view_outputs = []
        if not self._finished_forward:
            self._end_carrying()
        if self._open_forward is not None and not self._finished_forward and not in_backward():
            self.drop_forward(self._open_forward)  # the forward raised: nothing of it is kept
            self._open_forward = None
        return None

    def drop_forward(self, forward_id: int) -> None:
        self.restore_switched()
        self._sources.clear()
        for state in self.layers:
            state.calls = [c for c in state.calls if c.forward_id != forward_id]

    def settle_open_forward(self) -> None:
        """Outside any model call: a model call still open never returned (Ctrl-C in its forward)."""
        if self._open_forward is not None:
            self._end_carrying()
            self.drop_forward(self._open_forward)
            self._open_forward = None

    @contextlib.contextmanager
    def pausing(self):
        """Nothing is recorded or read inside (a backward that is not training: the loss check's passes)."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous


_GRADIENT_EDGE = getattr(torch.autograd.graph, "GradientEdge", None)  # (torch 2.3 and later: deferral needs it)


def _outside_parameters(inputs, model: nn.Module, limit: int = 100_000) -> str | None:
    """The trainable parameters outside ``model`` that a model call's floating-point inputs depend on (a GAN's
    generated samples through the generator), described, or None. Only inputs that require gradients are walked."""
    roots = [t for t in tensors_in(inputs) if t.is_floating_point() and t.requires_grad]
    if not roots:
        return None
    own = {id(p) for p in model.parameters()}
    found: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    found += [t for t in roots if t.grad_fn is None and isinstance(t, nn.Parameter) and id(t) not in own]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, nn.Parameter) and variable.requires_grad and id(variable) not in own:
            found.append(variable)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    if not found:
        return None
    shapes = ", ".join(str(tuple(p.shape)) for p in found[:4]) + (", ..." if len(found) > 4 else "")
    return f"{len(found)} parameter(s) of shapes {shapes}"
