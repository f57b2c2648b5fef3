"""Evaluation in ``eval()`` mode with gradients enabled costs what it costs without the engine: such a model call is
*deferred* - run with the layers' hooks set aside, nothing recorded - and replayed only if a backward reaches it.

A forward with gradients enabled may still be back-propagated (training in ``eval()`` mode, to keep dropout off, is
legitimate), and the engine cannot know at forward time whether it will be. So it learns it from the loop: a model
call in ``eval()`` mode with gradients enabled is deferred when the model's previous call was one too and no backward
came between them (an evaluation loop that forgot ``torch.no_grad()``: its first batch is recorded, the others run
free), after a training backward through ``engine.backward`` in one process. Never deferred: a call whose input
requires gradients (a saliency map's), under data parallelism, before the first ``engine.backward``, after a plain
``loss.backward()``.

A deferred call's outputs that require gradients are detached from its plain forward's graph (whose parameter
gradients would be neither clipped nor noised: it is freed at once) and pass through ``_DeferredOutput``, which keeps
the call's inputs and random state and gives no gradient. When ``engine.backward(losses)`` reaches one (``reached``),
``replay``:

1. calls the model again on the same inputs under the same random state - an ordinary training forward, recorded,
   whose rows are checked like any other -
2. and back-propagates, instead of the losses, ``L_i + s_i - s_i.detach()`` with ``s_i = <G_i, new_i>``: ``G`` the
   gradient of the summed losses at the deferred outputs, ``new`` the replay's outputs. Its value is ``L_i``, and
   the step's loss check (``rows.losses``) reads it down to the deferred outputs, marked as model outputs: a loss
   that couples samples there is refused as on any step. A loss that passes is separable, so its gradient at the
   replay's outputs for any per-sample weighting (tag passes, clipping factors) is the losses' at the deferred ones:
   the step is exact.

The replay must compute what the deferred call did, as with activation checkpointing: an input modified in place
since is refused, and so is a replay whose outputs differ (a forward that changes state it reads, nondeterministic
kernels): the losses were computed on the deferred output. Refused too: a backward that reaches a deferred output other than
through ``engine.backward``, or a second time (each sample is clipped once a step), and losses that reach an output of
a deferred call that is not per-sample (a loss computed inside the model).
"""
from __future__ import annotations

from typing import Any

import torch

from ..rows.losses import OUTPUT_MARK, OutputMark
from ..rows.outputs import map_per_sample


class DeferredCall:
    """One deferred model call: what it was given, and the random state it ran in."""

    DEFERRED, REPLAYING, CONSUMED = "deferred", "replaying", "consumed"

    def __init__(self, model, args, kwargs, inputs: list[torch.Tensor], batch: int, axis: int):
        #: the model called (another engine's losses may reach the call: only its own engine replays it)
        self.model = model
        self.args, self.kwargs, self.batch = args, kwargs, batch
        self.axis = axis  # (the model's batch axis)
        self.versions = [(t, t._version) for t in inputs]
        self.cpu_state = torch.default_generator.get_state()
        cuda = [t.device for t in inputs if t.is_cuda]
        self.devices = list(dict.fromkeys(cuda)) if cuda else cuda
        self.device_states = [torch.cuda.get_rng_state(d) for d in self.devices] if cuda else cuda
        #: deferred; being replayed by engine.backward (its backward is the replay's: the deferred output's gives
        #: nothing); or back-propagated once already
        self.state = self.DEFERRED

    def call_again(self):
        """The model called again on the same inputs, in the random state of the deferred call."""
        if any(t._version != version for t, version in self.versions):
            raise RuntimeError(
                "engine.backward reached a model call made in eval() mode after an evaluation, which the engine "
                "replays to train on it (dptrain/deferred.py), but its input was modified in place since: call "
                "model.train() between evaluating and training in eval() mode, or leave the input as it was until "
                "the backward. Nothing of this backward was accumulated")
        model = self.model
        # in eval() mode, as it was made (a model switched to train() since would replay with dropout on)
        modes = [(m, m.training) for m in model.modules()] if model.training else None
        if modes is not None:
            model.eval()
        try:
            with torch.random.fork_rng(devices=self.devices):
                torch.set_rng_state(self.cpu_state)
                for device, state in zip(self.devices, self.device_states):
                    torch.cuda.set_rng_state(state, device)
                return model(*self.args, **self.kwargs)
        finally:
            for module, training in modes or ():
                module.training = training


_AGAIN = ("a backward reached the output of a model call that was made in eval() mode after an evaluation and already "
          "back-propagated by engine.backward: each sample's gradient is clipped once a step. Call the model again for "
          "another backward. Nothing of this backward was accumulated")


class _DeferredOutput(torch.autograd.Function):
    """A deferred call's output, detached from the graph of its plain forward (whose parameter gradients would be
    neither clipped nor noised, and which is freed at once), attached to the engine's anchor instead; its backward
    gives nothing (the replay's graph carries the gradient). ``axis``: where its batch sits (None: not per-sample);
    ``k``: which of the call's per-sample outputs it is."""

    @staticmethod
    def forward(ctx, x, anchor, call, axis, k):
        ctx.call, ctx.axis, ctx.k = call, axis, k
        ctx.save_for_backward(x)  # (the output itself: the replay is compared with it)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.call.state
        if state == DeferredCall.DEFERRED:
            raise RuntimeError(
                "a backward reached the output of a model call that ran in eval() mode with gradients enabled right "
                "after another such call, which the engine took for an evaluation and did not record (its "
                "parameters' gradients would be neither clipped nor noised). Back-propagate per-sample losses with "
                "engine.backward(losses), which replays the call to train on it; or call model.train() (or evaluate "
                "under torch.no_grad()) between evaluating and training in eval() mode")
        if state == DeferredCall.CONSUMED:
            raise RuntimeError(_AGAIN)
        return None, None, None, None, None


def wrap_outputs(output, call: DeferredCall, anchor):
    """The deferred call's output with each tensor that requires gradients passed through ``_DeferredOutput``."""
    count = [0]

    def wrap(t: torch.Tensor, found: int | None) -> torch.Tensor:
        out = _DeferredOutput.apply(t.detach(), anchor(t.device), call, found, count[0] if found is not None else None)
        count[0] += found is not None
        return out

    return map_per_sample(output, call.batch, call.axis, wrap, others=True)


def _per_sample(output, call: DeferredCall) -> list[torch.Tensor]:
    """The per-sample tensors of a replay's output, in the order ``wrap_outputs`` numbered the deferred call's."""
    found: list[torch.Tensor] = []
    map_per_sample(output, call.batch, call.axis, lambda t, _: found.append(t) or t)  # type: ignore[func-returns-value]  # (kept, then itself)
    return found


def reached(losses: torch.Tensor, model, limit: int = 100_000) -> list:
    """The deferred outputs of calls of ``model`` the losses' graph reaches, as (autograd node, the call, the batch
    axis, which per-sample output of the call): the walk stops at them, at other models' (whose backward refuses),
    and at the model's recorded outputs (``rows.losses.OUTPUT_MARK``)."""
    found: list[tuple] = []
    seen: set[Any] = set()
    stack = [losses.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, _DeferredOutput._backward_cls):
            if node.call.model is model:
                found.append((node, node.call, node.axis, node.k))
            continue
        if OUTPUT_MARK in node.metadata:  # type: ignore[operator]  # (torch's stub: metadata a method, a dict in fact)
            continue
        stack.extend(n for n, _ in node.next_functions)
    return found


def replay(losses: torch.Tensor, tag_losses: torch.Tensor | None, deferred: list, pausing):
    """Call the model again for each deferred call the losses reach (``reached``), and the losses (and the tag passes'
    losses) with the same values whose gradient reaches the replays' outputs instead of the deferred ones: see the
    module docstring. Returns (the losses, the tag passes' losses), and the calls replayed (consumed once their
    backward ends; at once if the replay fails)."""
    if any(call.state != DeferredCall.DEFERRED for _, call, _, _ in deferred):
        raise RuntimeError(_AGAIN)
    for node, call, axis, _ in deferred:
        old = node.saved_tensors[0]
        if axis is None:
            raise RuntimeError(
                f"engine.backward reached an output of shape {tuple(old.shape)} of a model call made in eval() mode "
                "after an evaluation, which the engine replays to train on it (dptrain/deferred.py), but that "
                "output has no row per sample (a loss computed inside the model?): give engine.backward per-sample "
                "losses computed from per-sample outputs, or call model.train() between evaluating and training in "
                "eval() mode. Nothing of this backward was accumulated")
        # (a model output to the step's loss check, which reads the losses' rows down to it)
        node.metadata[OUTPUT_MARK] = {0: OutputMark(axis, call.batch, None, tuple(old.shape), None)}
    calls = list(dict.fromkeys(call for _, call, _, _ in deferred))
    try:
        return _replayed(losses, tag_losses, deferred, calls, pausing), calls
    except BaseException:
        for call in calls:  # (a replay that failed half-way is not replayed again)
            if call.state == DeferredCall.REPLAYING:
                call.state = DeferredCall.CONSUMED
        raise


def _replayed(losses, tag_losses, deferred: list, calls: list, pausing):
    """``replay``'s losses and tag passes' losses, the calls made again."""
    GradientEdge = torch.autograd.graph.GradientEdge
    new_outputs = {}
    for call in calls:
        new_outputs[call] = _per_sample(call.call_again(), call)
        call.state = DeferredCall.REPLAYING
    edges = [GradientEdge(node, 0) for node, _, _, _ in deferred]
    pairs = []
    for node, call, axis, k in deferred:
        old = node.saved_tensors[0]
        new = new_outputs[call][k] if k < len(new_outputs[call]) else None
        if new is None or new.shape != old.shape:
            raise RuntimeError(
                "engine.backward replayed a model call made in eval() mode after an evaluation (dptrain/deferred.py), "
                f"and the replay did not return its output of shape {tuple(old.shape)} again: the forward depends on "
                "state it changes. Call model.train() between evaluating and training in eval() mode. Nothing of "
                "this backward was accumulated")
        if not torch.equal(new.detach(), old):
            # The losses were computed on the deferred output: moved onto another computation, their gradient is no
            # longer the losses' gradient, and nothing bounds what one sample does to the step.
            raise RuntimeError(
                "engine.backward replayed a model call made in eval() mode after an evaluation (dptrain/deferred.py) "
                f"and its output of shape {tuple(old.shape)} came out different (largest difference "
                f"{float((new.detach() - old).abs().max()):.3g}): the forward changes state it reads (a counter, its "
                "own random generator), runs nondeterministic kernels, or the parameters changed since. The losses "
                "were computed on the evaluation's output, so the step cannot be taken from the replay. Call "
                "model.train() between evaluating and training in eval() mode, or evaluate under torch.no_grad(). "
                "Nothing of this backward was accumulated")
        pairs.append((new, axis))

    def moved(objective: torch.Tensor) -> torch.Tensor:
        with pausing():
            grads = torch.autograd.grad(objective.sum(), edges, retain_graph=True, allow_unused=True)
        total = None
        for (new, axis), g in zip(pairs, grads):
            if g is None:
                continue
            rows = g.movedim(axis, 0) * new.movedim(axis, 0)
            s = rows.reshape(rows.shape[0], -1).sum(1).to(objective.dtype)
            total = s if total is None else total + s
        return objective if total is None else objective + (total - total.detach())

    return moved(losses), (moved(tag_losses) if tag_losses is not None else None)
