"""A call's arguments as the fallback keeps them: the tensors detached, which of them carry the call's rows
(``_set_rows``), an object the call may change (a cache of keys and values) kept as it was before the call
(``before_call``) and copied for each replay, and the arguments as long as the batch that every sample shares
(a table or a mask: ``_shared_arguments``)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..numerics import autocast_state
from .bags import _flat_bag_arguments
from .guarded_outputs import SIDE_CHANNELS
from .independence import _close, _perturb_first, _rows_kept
from .objects import _may_change, _snapshot
from .parts import _FallbackParts
from .records import FallbackCall


class _CallArguments(_FallbackParts):
    """``FallbackRule``'s record of a call's arguments, and of those every sample shares (mixed into it)."""

    # its state, which FallbackRule.__init__ sets and describes
    _before: dict[int, tuple[Any, Any]]

    def before_call(self, module, args, kwargs) -> None:
        """The objects among the call's arguments that hold tensors, as they are before it runs (copies, their tensors
        detached): a call may change them (a cache of keys and values it adds its own to), and its replays must
        see them as the call did (``_keep_call``). And the side channels' state (``SIDE_CHANNELS``)."""
        held = [leaf for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))) if _may_change(leaf)]
        self._before = {id(leaf): (leaf, _snapshot(leaf)) for leaf in held}
        self._channels = [(channel, channel.snapshot()) for channel in SIDE_CHANNELS]

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
