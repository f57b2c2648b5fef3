"""Forward/backward hooks that record, per layer call, the activation and the output gradient.

Ghost differentiation (book-keeping paper, section 2.1): a layer's parameters are switched
to ``requires_grad=False`` for the duration of its own forward call only, so autograd
records no parameter-gradient work (the non-private gradient is never computed) while
output gradients still flow; the engine forms every parameter gradient itself. A layer
whose input does not require grad (the first trainable layer) then gets its output
attached to an engine-owned "origin" leaf, so back-propagation still reaches it. Outside
its layer's call a parameter keeps requiring grad, so any other use of it reaches autograd
and is caught by the engine instead of escaping clipping.

The model's own call is hooked too: its input gives the batch size (read, never inferred
from what a layer happens to see), a forward that raises drops what it recorded, and its
output's gradient marks the start of a plain ``loss.backward()``. A layer call recorded
while a backward pass runs is a recomputation (activation checkpointing) and is marked so.

A layer's output gradient is read by a pre-hook on the node that made the output, which runs after
every tensor hook (a user's hook that scales it counts). A training forward that writes a buffer or
parameter of the model is refused (``StateWrites``: version counters). The hooks the model holds are
``EngineHook``s: a deep or pickled copy of the model gets inert ones, and no engine.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree as pytree

from .broadcast import BroadcastRows, broadcast_rows, rows_of, shared_use_marker
from .distributed import is_dtensor
from .layers.numerics import swap01
from .layers.protocol import LayerDims, LayerRule, OutputLeaves
from .layers.fallback import in_replay
from .rows import ForwardWatch, RowReader, computing_precision, pattern_key, tensors_in
from .rows.losses import mark_outputs


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def graph_task() -> int:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task() if task is not None else -1


@dataclass
class Call:
    """One forward call of a covered module, and later its output gradient."""

    activation: Any
    dims: LayerDims
    batch_size: int
    version: int | None = None  # the activation's version counter when it was captured
    forward_id: int | None = None  # the model call it belongs to (None: outside one, or a recomputation)
    recomputed: bool = False  # recorded during a backward pass (checkpointing recomputes the forward)
    grad: torch.Tensor | None = None
    shape: tuple = ()  # the shape of the output (the gradient) as the rule sees it
    key: tuple = ()  # rows.pattern_key: the shape relative to the batch size
    ordinal: int | None = None  # which call of its layer in the model call (or the recomputation); None: neither
    cacheable: bool = False  # its layout may be cached (a watched model call, no reordering op before it)
    unread: bool = False  # no layout was known for its pattern when it was recorded: a tag pass reads it
    tagged: torch.Tensor | None = None  # its output gradient in a tag pass
    tags: torch.Tensor | None = None  # the per-sample tags of that pass
    rowmap: Any = None  # rows.RowMap, once read
    precision: torch.dtype | None = None  # the lowest precision its model call computed in (rows.computing_precision)
    broadcast: bool = False  # a call on one row, its output broadcast over the batch (broadcast.py)
    trace: int | None = None  # the trace record of its model call (rows.Traces): its layout is cached per trace
    #: where its output gradient is read in the graph, for rows.proof (ids: the call does not hold the graph): the
    #: edge (id of the node, output index), the shapes where it is read at a reshape's base (base, output), and
    #: whether the rule sees the output with its first two dimensions swapped (sequence first)
    edge: tuple | None = None
    edge_shape: tuple | None = None
    edge_view: tuple | None = None
    edge_swapped: bool = False
    provable: bool = True  # nothing outside the graph acts on its gradient (no user hook in its forward)
    shared_use: str | None = None  # an operation that used its output of batch size 1 without broadcasting it


class CallList:
    """A layer's calls still waiting for their output gradient, held weakly.

    A call lives as long as the autograd graph that is to deliver its gradient (the hook on its output holds
    it): a forward whose graph was dropped without a backward (its loss failed, its outputs were thrown
    away) leaves nothing behind here.
    """

    def __init__(self, calls=()):
        self._refs = [weakref.ref(c) for c in calls]
        self._held = [c for c in calls if c.grad is not None]

    def _live(self) -> list[Call]:
        return [c for c in (r() for r in self._refs) if c is not None]

    def __iter__(self):
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __bool__(self) -> bool:
        return any(r() is not None for r in self._refs)

    def __getitem__(self, k):
        return self._live()[k]

    def append(self, call: Call) -> None:
        if len(self._refs) > 8:
            self._refs = [r for r in self._refs if r() is not None]
        self._refs.append(weakref.ref(call))

    def hold(self, call: Call) -> None:
        """Keep a call that received its gradient until it is reduced: a recomputation's graph (reentrant
        checkpointing) is freed at the end of its nested backward, before the outer backward reduces it."""
        self._held.append(call)

    def clear(self) -> None:
        self._refs.clear()
        self._held.clear()


@dataclass
class LayerState:
    name: str
    module: nn.Module
    rule: LayerRule
    params: dict[str, nn.Parameter]
    _calls: CallList = field(default_factory=CallList, repr=False)

    @property
    def path(self) -> str:
        """The module's path in the model, as ``named_modules()`` gives it (``<root>``: the model itself)."""
        return self.name or "<root>"

    @property
    def calls(self) -> CallList:
        return self._calls

    @calls.setter
    def calls(self, calls) -> None:
        self._calls = calls if isinstance(calls, CallList) else CallList(calls)


class EngineHook(functools.partial):
    """One of the engine's hooks as the model holds it: ``EngineHook(fn)`` calls ``fn``.

    A copy of the model (``copy.deepcopy``, or ``torch.save`` then ``torch.load``) gets a ``DroppedHook`` in its
    place: a copy is a plain model, attached to no engine, and neither the engine nor its optimizer is copied
    along. Attach an engine to the copy to train it privately.
    """

    __slots__ = ()

    def __deepcopy__(self, memo):
        return DroppedHook()

    def __reduce__(self):
        return (DroppedHook, ())


class DroppedHook:
    """What an engine hook becomes in a copy of the model: nothing."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return None

    def __repr__(self) -> str:
        return "DroppedHook()"


class _GradientPenalty(torch.autograd.Function):
    """Identity on a gradient taken with ``create_graph=True`` under ``engine.paused()`` through a covered layer;
    refuses to be differentiated by a training backward (a loss built on that gradient: a gradient penalty).
    Differentiated under ``paused()`` again (a second input derivative), it is the identity.

    Ghost differentiation records no parameter in a layer's forward, so the graph of such a gradient has lost
    its direct dependence on the layer's weights: its backward would silently drop part of the penalty's
    gradient.
    """

    @staticmethod
    def forward(ctx, grad, where: str, capture: weakref.ref):
        ctx.where, ctx.capture = where, capture
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, grad):
        capture = ctx.capture()
        if capture is not None and capture.paused:
            return grad, None, None
        raise RuntimeError(
            f"the loss depends on a gradient taken through {ctx.where} with create_graph=True inside "
            "engine.paused() (a gradient penalty, or a double backward): gradient penalties are not supported with "
            "per-sample clipping yet, since the engine would drop the penalty's direct dependence on the weights. "
            "Train without the penalty term, or take that gradient without create_graph=True (detached)"
        )


class _Origin(torch.autograd.Function):
    """Identity on ``x`` that makes it require grad through ``anchor`` (no gradient flows back)."""

    @staticmethod
    def forward(ctx, anchor, x):
        if x._is_view():  # marking a view dirty would detach it from its base's history
            return x.clone()
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, None


class _OutputLeaves(torch.autograd.Function):
    """Identity (a copy of each) on the output leaves of a covered call that its rule differentiates
    (``LayerRule.capture_leaves``): one node, so its backward receives every leaf's gradient at once, after every
    tensor hook on them, the user's included, and ``None`` for a leaf that no gradient reaches in this backward (an
    output the model does not use): autograd runs a node once all the gradients it will get have arrived. ``read``
    takes them and gives back what flows on to the leaves. ``anchor`` makes the copies require grad where the leaves
    do not (the layer's parameters are switched off during its call).
    """

    @staticmethod
    def forward(ctx, anchor, read, *leaves):
        ctx.read = read
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in leaves)

    @staticmethod
    def backward(ctx, *grads):
        grads = ctx.read(grads)
        return (None, None, *(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[2:])))


class StateWrites:
    """Data written outside the private gradient: a buffer or parameter of the model written in place (its version
    counter moved), replaced or registered during a training forward.

    Running statistics updated from the batch, embedding rows renormalised in place by ``max_norm``: the batch
    reaches the model's state without clipping or noise. Every buffer and parameter (frozen or not) is looked at,
    whatever the module that writes it. ``before`` snapshots them at the model's pre-hook, ``check`` compares at its
    forward hook: one pass over the model's tensors each, the list of their holders cached until a module or
    parameter is registered anywhere. ``buffers_only`` (FSDP2, which swaps the parameters in and out of the modules
    during the forward): parameters are not looked at.
    """

    def __init__(self, model: nn.Module, buffers_only: bool = False):
        self.model = model
        self.buffers_only = buffers_only
        self._holders: list[tuple[str, str, dict]] = []  # (module path, "buffer"/"parameter", the module's dict)
        self._seen = -1
        self._before: list[tuple[dict, str, torch.Tensor, int]] | None = None

    def _current_holders(self) -> list[tuple[str, str, dict]]:
        from .trainable import registrations  # (trainable imports this module)

        if self._seen != registrations():
            self._seen = registrations()
            # Every module's buffer dict, empty or not: a buffer registered later is seen without a new walk.
            self._holders = [(path, "buffer", m._buffers) for path, m in self.model.named_modules()]
            if not self.buffers_only:
                self._holders += [(path, "parameter", m._parameters)
                                  for path, m in self.model.named_modules() if m._parameters]
        return self._holders

    @torch._dynamo.disable  # (version counters move at every step: traced, each step would recompile)
    def before(self) -> None:
        self._before = [(d, name, t, t._version) for _, _, d in self._current_holders()
                        for name, t in d.items() if t is not None]

    @torch._dynamo.disable
    def check(self) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        written = next(((d, name) for d, name, t, version in before
                        if d.get(name) is not t or t._version != version), None)
        if written is None and len(before) != sum(1 for _, _, d in self._holders for t in d.values() if t is not None):
            known = {(id(d), name) for d, name, _, _ in before}
            written = next(((d, name) for _, _, d in self._holders for name, t in d.items()
                            if t is not None and (id(d), name) not in known), None)
        if written is not None:
            raise self._refusal(*written)

    def _refusal(self, holder: dict, name: str) -> RuntimeError:
        path, kind = next((path, kind) for path, kind, d in self._holders if d is holder)
        module = self.model.get_submodule(path)
        where = f"{path}.{name}" if path else name
        return RuntimeError(
            f"the {kind} {where!r} of {type(module).__name__} was written during a training forward (in place, "
            "replaced or registered): what it holds may depend on the batch (running statistics, embedding rows "
            "renormalised by max_norm, a cache of inputs) and would leak it into the model outside the private "
            "gradient, without clipping or noise. Its value was already modified by this call: restore the model from a copy taken "
            "before it if it must not hold this batch. Fix: call .eval() on that module, build it without updating "
            "state (track_running_stats=False, no max_norm), or, if what it writes does not depend on the data, "
            "compute it in a separate call under engine.paused() or torch.no_grad()"
        )


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


class Capture:
    """Installs and removes the hooks; the engine reacts to what they record.

    ``set_layers`` may be called again while installed (the trainable set changed): hooks
    look up each module's current state, so a module that is no longer covered records
    nothing, and newly covered modules are hooked.
    """

    def __init__(self, model: nn.Module, on_grad: Callable[[LayerState, Call, torch.Tensor], None], *,
                 on_model_call: Callable[[], None], on_output_grad: Callable[[], None],
                 params_by_name: bool = False, batch_first: bool = True, dry: bool = False,
                 rows: RowReader | None = None):
        self.model = model
        #: the engine's row maps: which calls of a model call still need their rows read by a tag pass
        self.rows = rows if rows is not None else RowReader()
        self._ordinals: dict[int, int] = {}  # per layer: how many calls it made in this model call / recomputation
        self._recomputed_ordinals: dict[int, int] = {}
        self._watch: ForwardWatch | None = None
        self._forward_calls: list = []  # (layer state, call) of the open model call
        #: the open model call's input depends on trainable parameters outside the model (a GAN's generated samples):
        #: the model is a function for it, not trained (``_outside_parameters``)
        self._passthrough: str | None = None
        #: the model call that layer calls made outside any belong to (``_forward_of_outside_call``)
        self._last_forward: int | None = None
        self._outside_groups = 0
        #: the graph task of the last backward that went through such a call's output
        self.passthrough_task = -1
        self._forward_needs_tags = False
        #: set by the engine: replaces a model call's outputs by tagging ones (plain backward of new patterns);
        #: (outputs, patterns not read yet, the input's rows can be followed through the graph)
        self.on_tag_outputs: Callable[[Any, bool, bool], Any] | None = None
        #: set by the engine: a gradient reached a scalar output of the model (a loss computed inside it)
        self.on_scalar_output_grad: Callable[[], None] | None = None
        #: set by the engine: the gradient of a tensor carrying the model input's rows (``rows.InputRows``)
        self.on_input_grad: Callable[[Any, torch.Tensor], None] | None = None
        #: ``plan()``'s dry forward: every call recorded (sizes only, gradients on or off), nothing switched or hooked
        self.dry = dry
        self.called: list[LayerState] = []  # dry: the layers in the order of their first call
        self.params_by_name = params_by_name
        self.batch_first = batch_first
        self.on_grad = on_grad
        self.on_model_call = on_model_call
        self.on_output_grad = on_output_grad
        self.layers: list[LayerState] = []
        self._state_of: dict[int, LayerState] = {}
        self._hooked: dict[int, nn.Module] = {}  # by id, with the module itself (an id is reused after a module dies)
        self._checked: dict[int, nn.Module] = {}
        #: while set (engine.paused()), nothing is switched or recorded
        self.paused = False
        self._handles: list[Any] = []
        self._own_ids: set[int] = set()  # ids of every hook the engine registered (for the order checks)
        self._pre_ids: dict[int, int] = {}
        self._pre_hook_fns: dict[int, Callable] = {}
        self._post_ids: dict[int, int] = {}
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._switched: dict[int, list[list[nn.Parameter]]] = {}
        self._sources: dict[tuple[int, int], torch.Tensor] = {}  # capture-site activations awaiting their target
        self._view_outputs: list = []  # (output, its version, layer) of this model call's outputs that are views
        #: batch size of the model's current forward call, read from its first tensor argument
        self.forward_batch: int | None = None
        #: the lowest precision the open model call computes in (``rows.computing_precision``), for reading rows
        self.forward_precision: torch.dtype | None = None
        self._param_dtypes: tuple[torch.dtype, ...] = ()
        self._forward_count = 0
        self._open_forward: int | None = None  # id of a model call that has not returned yet
        self._finished_forward = False
        #: the model's buffers and parameters, checked for writes by each training forward
        self.state_writes = StateWrites(model, buffers_only=params_by_name)

    # ------------------------------------------------------------------ install / remove
    def install(self, layers: list[LayerState], extra_checks: list[tuple[nn.Module, Callable]] = ()) -> None:
        self._keep(self.model.register_forward_pre_hook(EngineHook(self._model_pre_hook), with_kwargs=True,
                                                          prepend=True))
        self._keep(self.model.register_forward_hook(EngineHook(self._model_post_hook), prepend=True))
        self._keep(self.model.register_forward_hook(EngineHook(self._model_failed_hook), always_call=True))
        self.add_checks(extra_checks)
        self.set_layers(layers)

    def add_checks(self, checks: list[tuple[nn.Module, Callable]]) -> None:
        """Forward pre-hooks that refuse a module's call (a frozen BatchNorm in training mode), once per module."""
        for module, check in checks:
            if self._checked.get(id(module)) is not module:
                self._checked[id(module)] = module
                self._keep(module.register_forward_pre_hook(EngineHook(check)))

    def _keep(self, handle):
        self._handles.append(handle)
        self._own_ids.add(handle.id)
        return handle

    def set_layers(self, layers: list[LayerState]) -> None:
        self.layers = layers
        self._param_dtypes = tuple({p.dtype for s in layers for p in s.params.values()})
        self._state_of = {id(s.module): s for s in layers}
        for state in layers:
            if self._hooked.get(id(state.module)) is state.module:
                continue
            module = state.module
            self._hooked[id(module)] = module
            self._pre_hook_fns[id(module)] = EngineHook(self._make_pre_hook(module))
            pre = self._keep(module.register_forward_pre_hook(self._pre_hook_fns[id(module)], with_kwargs=True))
            post = self._keep(module.register_forward_hook(
                EngineHook(self._make_post_hook(module)), always_call=True, with_kwargs=True, prepend=True))
            self._pre_ids[id(module)], self._post_ids[id(module)] = pre.id, post.id
            if state.rule.captures_input:
                for k, site in enumerate(state.rule.capture_sites(module)):
                    if site.source is not None and site.source_input:
                        self._keep(site.source.register_forward_pre_hook(
                            EngineHook(self._make_source_hook(module, k, True))))
                    elif site.source is not None:
                        self._keep(site.source.register_forward_hook(
                            EngineHook(self._make_source_hook(module, k, False))))
                    self._keep(site.target.register_forward_pre_hook(
                        EngineHook(self._make_input_hook(module, k, site.source is not None))))

    def remove(self) -> None:
        self._end_watch()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._own_ids.clear()
        self._hooked.clear()
        self._checked.clear()
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
            return None  # a recomputation (checkpointing), evaluation, a fallback's replay, or paused
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
        self._forward_needs_tags = False
        self._view_outputs = []
        self._end_watch()
        device = next((t.device for t in tensors_in((args, kwargs))), None)
        self.forward_precision = (computing_precision(device, self._param_dtypes)
                                  if device is not None and not self.dry else None)
        self._forward_calls = []
        self._passthrough = None if self.dry else _outside_parameters((args, kwargs), self.model)
        if torch.is_grad_enabled() and not self.dry:
            self.state_writes.before()
        if self._passthrough is None and not self.dry and self.forward_batch:  # (last: it watches the forward alone)
            inputs = [t for t in tensors_in((args, kwargs)) if t.dim() > dim and t.shape[dim] == self.forward_batch]
            self._watch = _start_watch(self.forward_batch, inputs, dim, self._anchor, self.on_input_grad,
                                       self.forward_precision, self.rows.traces)
        return None

    def _settle_calls(self, watch, forward_id: int) -> None:
        """The model call returned: its calls' layouts are the verified trace's it followed to its end, or are read
        in its backward (a verifying forward: its trace is kept once that backward has read every row)."""
        record = watch.verified_record()
        # A forward compiled whole (torch.compile) runs its operations where the watch does not see them: its trace
        # shows nothing of what it computed, so it is verified at every step (proofs from its graph, tag passes).
        unseen = watch.operations == 0 and bool(self._forward_calls)
        verifying = record is None or unseen
        if verifying:
            record = self.rows.traces.new_record()
            if not watch.seen and not unseen:  # a trace that picked rows by the data is read at every step, never kept
                self.rows.pending_trace(forward_id, watch.keys, record)
        self.rows.forward_clean = not watch.seen
        self.rows.last_followed = not verifying
        self.rows.last_trace = record
        self.rows.last_divergence = watch.diverged_at
        for state, call in self._forward_calls:
            call.trace = record
            call.cacheable = not watch.seen
            call.provable = not watch.hooked
            if self.rows.needs_tags(state, call):
                call.unread = True
            self._forward_needs_tags |= call.unread
        self._forward_calls = []

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
        """A backward completed: layer calls made outside a model call from now on are another forward's."""
        self._last_forward = None

    def note_unread_call(self) -> None:
        """A call of the open model call became one whose rows must be read (a table of batch size 1 used without
        broadcasting it, broadcast.py): its model outputs are tagged for a plain backward."""
        if self._open_forward is not None:
            self._forward_needs_tags = True

    def _end_watch(self) -> bool:
        """Stop watching the model call; whether it was watched."""
        watch, self._watch = self._watch, None
        if watch is None:
            return False
        watch.__exit__(None, None, None)
        return True

    def _check_view_outputs(self) -> None:
        """A covered layer's output that is a view of part of another tensor, modified in place afterwards: its
        gradient would never reach the engine (the in-place op rewrites the view's history)."""
        views, self._view_outputs = self._view_outputs, []
        for tensor, version, state, broadcast in views:
            if tensor._version != version and broadcast:
                _guard_written_base(tensor, state)  # (writes into the table itself: broadcast.py)
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
        if in_backward() or self._open_forward is None or in_replay() or self.paused:
            return None
        watch = self._watch  # (the forward ended: what the checks below compute is not the forward's)
        self._watch = None
        if watch is not None:
            watch.__exit__(None, None, None)
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
        carried = watch is not None and bool(watch.readings)  # the input's rows can be followed
        if watch is not None:
            self._settle_calls(watch, forward_id)
        replaced = None
        if torch.is_grad_enabled() and not self.dry:
            if self.on_tag_outputs is not None:  # a plain backward reads new patterns' rows from tagged outputs
                replaced = self.on_tag_outputs(output, self._forward_needs_tags, carried)
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
        self._view_outputs = []
        if not self._finished_forward:
            self._end_watch()
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
            self._end_watch()  # (its watch too: a mode left active would see every later torch call)
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

    # ------------------------------------------------------------------ layer hooks
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
        if (next(reversed(module._forward_pre_hooks), None) == self._pre_ids[id(module)]
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
        def pre_hook(module, inputs, kwargs=None):
            state = self._state_of.get(id(module))
            # A replay by the per-sample fallback runs children as they are: nothing to switch or record.
            if state is None or not torch.is_grad_enabled() or in_replay() or self.paused or self.dry:
                return None
            self._check_hook_order(module, state)
            if state.rule.before_call is not None:  # (the fallback keeps a cache passed in as it is before the call)
                state.rule.before_call(module, inputs, kwargs or {})
            params = self._current_params(state) if self.params_by_name else state.params.values()
            switched = [p for p in params if p.requires_grad]
            for p in switched:
                p.requires_grad_(False)
            self._switched.setdefault(id(module), []).append(switched)
            return None

        return self._quietly(pre_hook)

    def _quietly(self, hook):
        """A layer hook of the engine's: what it computes is not the forward's (the model call's watch does not
        see it, nor pays for it)."""
        capture = weakref.ref(self)

        def quiet(*args, **kwargs):
            alive = capture()
            if alive is None or not (alive.dry or torch.is_grad_enabled()):
                return None  # (evaluation: nothing to record; the hooks cost this test alone)
            watch = alive._watch
            if watch is None:
                return hook(*args, **kwargs)
            stack = _get_current_function_mode_stack()
            if stack and stack[-1] is watch:  # (the usual case: out of the way altogether, at no cost per operation)
                with _pop_mode_temporarily():
                    return hook(*args, **kwargs)
            watch.quiet += 1  # (a mode of the program's own above it: the watch lets operations through unrecorded)
            try:
                return hook(*args, **kwargs)
            finally:
                watch.quiet -= 1

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
        def post_hook(module, args, kwargs, output):
            if in_replay():
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

        return self._quietly(post_hook)

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
        # Sequence first: a tensor [T, B, ...] is given to the rules as [B, T, ...]; one that already leads with
        # the batch (a pooled [B, d]) stays; with T == B it stays as it is for a rule whose rows are read over both
        # leading axes (either layout is then found from the gradient), and is refused for the others.
        swap = (lambda t: _batch_to_front(t, forward_batch, state)) if not self.batch_first else (lambda t: t)
        # A table broadcast over the batch that an earlier layer handed over ([1, ...], broadcast.py) is seen by the
        # rule as its rows over the batch, the call's output too where it is one (a LayerNorm on a position table).
        inputs = swap(_broadcast_rows_of(inputs))
        broadcast = isinstance(tensor, BroadcastRows)
        if broadcast:
            tensor = rows_of(tensor)
        seen_output = swap(tensor)
        if site is None:
            args, kwargs = inputs
            activation = state.rule.capture_call(module, args, kwargs, seen_output)
        else:
            activation = state.rule.capture_at(module, site, inputs, seen_output)
        output_swapped = seen_output is not tensor
        if not self.dry and tensor.grad_fn is None and tensor.requires_grad and _of_own_parameter(tensor, state):
            # A parameter of the layer itself, or a view of one made while its flag was off (a class token's
            # cls.expand(B, -1, -1)): its gradient would go to the parameter without reaching the engine. The rule
            # differentiates the call itself (the fallback's replay); the model gets the values, with no history
            # (a view of them: _Origin copies a view rather than mark the parameter's storage as written).
            tensor = tensor.detach().view_as(tensor)
        if not tensor.requires_grad and not self.dry:
            tensor = _Origin.apply(self._anchor(tensor.device), tensor)
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
        if self.dry:
            return tensor
        if broadcast:  # the model gets the layer's own [1, ...] output; the engine hooks its rows over the batch
            call.broadcast = True
            returned = broadcast_rows(tensor, shared_use_marker(call, self), f"{state.path} ({type(module).__name__})")
        else:
            returned = tensor
        call.edge_swapped = output_swapped
        if output_swapped:
            self._on_gradient(tensor, state, lambda g: self.on_grad(state, call, swap01(g)), call)
        else:
            self._on_gradient(tensor, state, lambda g: self.on_grad(state, call, g), call)
        return returned

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
            call.ordinal = ordinals.get(id(state.module), 0)
            ordinals[id(state.module)] = call.ordinal + 1
            call.key = pattern_key(call.shape, forward_batch)
            if recomputed:  # (a recomputation of the last model call: its trace, and its cacheability)
                call.trace, call.cacheable = self.rows.last_trace, self.rows.forward_clean
        if not self.dry and not recomputed:
            watch = self._watch
            if watch is not None and call.ordinal is not None:
                watch.note(("call", id(state.module), call.ordinal, call.key), state.path)
                self._forward_calls.append((state, call))
            elif self.rows.needs_tags(state, call):  # (outside a watched model call: read at every step)
                call.unread = self._forward_needs_tags = True
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

    def _on_gradient(self, tensor: torch.Tensor, state: LayerState, read: Callable[[torch.Tensor], None],
                     call: Call | None = None) -> None:
        """Call ``read`` with the gradient of ``tensor`` as the node that made it receives it.

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
        if node is None:
            tensor.register_hook(read)
            return
        if call is not None:
            call.edge = (id(node), index)
            if shape is not None:
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
            read(grad)
            return None

        node.register_prehook(pre_hook)


def _guard_written_base(rows: torch.Tensor, state: LayerState) -> None:
    """A table's rows over the batch (a view of the layer's output) whose memory was written in place in the forward.

    Writes into the table itself leave later uses of it on copies of the rows that lead to the engine's hook
    (``broadcast._write_table``). A use of another view of the output after a write leads instead through the
    write's node on the output's base (``CopySlices``), around the hook: its gradient would escape clipping. Each such
    node refuses the gradient that reaches it."""
    where = f"{state.path} ({type(state.module).__name__})"

    def refuse(grad_outputs):
        raise ValueError(
            f"the output of {where}, a table broadcast over the batch, was modified in place in the forward (e.g. "
            "`t /= 2`), and the loss depends on a view of it taken before the write or through another name: its "
            "gradient would not reach the engine, which reads each sample's part of it. Modify the table "
            "out of place (`t = t / 2`), or write it only through the name the layer returned"
        )

    node = rows._base.grad_fn
    while node is not None and type(node).__name__ == "CopySlices":
        node.register_prehook(refuse)
        node = node.next_functions[0][0]


def _of_own_parameter(tensor: torch.Tensor, state: LayerState) -> bool:
    """Whether ``tensor`` is one of the layer's trainable parameters or a view of one."""
    base = tensor._base if tensor._is_view() else tensor
    return any(base is p for p in state.params.values())


def _broadcast_rows_of(inputs: tuple) -> tuple:
    """A layer call's inputs ((args, kwargs), or a capture site's tensors) with each BroadcastRows replaced by its rows
    over the batch (a quick look first: this runs at every layer call)."""
    flat = (*inputs[0], *inputs[1].values()) if len(inputs) == 2 and isinstance(inputs[1], dict) else inputs
    if any(type(a) is BroadcastRows or isinstance(a, (list, tuple, dict)) for a in flat):
        return pytree.tree_map_only(BroadcastRows, rows_of, inputs)
    return inputs


@torch._dynamo.disable
def _start_watch(batch: int, inputs: list, axis: int, anchor, record, precision, traces) -> ForwardWatch:
    """A model call's watch (``rows.ForwardWatch``), entered; run eagerly under torch.compile, whose
    tracing would rebuild the mode without its state."""
    watch = ForwardWatch(batch, inputs, axis, anchor, record, precision, traces)
    watch.__enter__()
    return watch


def _outside_parameters(inputs, model: nn.Module, limit: int = 100_000) -> str | None:
    """The trainable parameters outside ``model`` that a model call's floating-point inputs depend on (a GAN's
    generated samples through the generator), described, or None. Only inputs that require gradients are walked."""
    roots = [t for t in tensors_in(inputs) if t.is_floating_point() and t.requires_grad]
    if not roots:
        return None
    own = {id(p) for p in model.parameters()}
    found, seen = [], set()
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


def outside_model_call(state: LayerState) -> ValueError:
    """The refusal of a layer call whose samples cannot be counted: made outside a call of the model."""
    return ValueError(
        f"{state.path} ({type(state.module).__name__}) was called outside a call of the model given "
        "to the engine, or the model's input held no tensor to read the batch size from: through a plain "
        "loss.backward() the engine cannot tell which sample each row belongs to. Call the model itself "
        "(model(x)), or use engine.backward(per_sample_losses)"
    )


def _batch_to_front(inputs, batch: int | None, state: LayerState):
    """Tensors [T, B, ...] of a sequence-first model as [B, T, ...] (every tensor, if the batch is unknown)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() < 2:
            return inputs
        if batch is None:
            return swap01(inputs)
        first, second = inputs.shape[0] == batch, inputs.shape[1] == batch
        if first and second:
            if getattr(state.rule, "rows_fold_into_tokens", False):
                # the rows are read over both leading axes (rows.py): [T, B, ...] and [B, T, ...] alike
                return inputs
            raise ValueError(
                f"{state.path} ({type(state.module).__name__}) got a tensor of shape "
                f"{tuple(inputs.shape)} in a sequence-first model (batch_first=False) whose batch is {batch}: with "
                f"as many positions as samples the engine cannot tell which axis is the batch, and the rule "
                f"{type(state.rule).__name__} cannot take its rows in either layout. Use another batch size for "
                "this step, or freeze this layer"
            )
        return swap01(inputs) if second else inputs
    if isinstance(inputs, tuple):
        return tuple(_batch_to_front(x, batch, state) for x in inputs)
    if isinstance(inputs, dict):
        return {k: _batch_to_front(v, batch, state) for k, v in inputs.items()}
    return inputs
