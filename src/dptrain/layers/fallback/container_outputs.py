"""Calls whose output is a container (tuple, list, dict, Hugging Face ``ModelOutput``: anything
``torch.utils._pytree`` flattens): differentiated through its floating-point leaves that depend on the module's
trainable parameters (``capture_leaves``), read from a replay at every call; the engine hands the call their
gradients joined per row, zeros for a leaf the loss does not use."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..protocol import OutputLeaves
from .independence import SampleMixingError
from .objects import _tensors_within
from .parts import _FallbackParts
from .records import FallbackCall


class _ContainerOutputs(_FallbackParts):
    """``FallbackRule``'s capture of a call with a container output (mixed into it)."""

    def capture_leaves(self, module, args, kwargs, output, batch):
        """A call whose output is a container (tuple, list, dict, ModelOutput): the leaves its per-sample gradients
        come from are the floating-point ones that depend on its trainable parameters (read from a replay that
        differentiates them, at every call); those that lead with the call's rows (the model's batch
        size where one of them does, else the first one's leading size) are per-sample, the others shared
        (``OutputLeaves``). ``None``: no leaf depends on them."""
        if self.swapped:
            raise ValueError(
                f"{self._name(module)} returns {type(output).__name__} in a sequence-first model (batch_first=False): "
                "the per-sample fallback takes a container output only from a batch-first model. Register a rule for "
                f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
            )
        flat, _ = pytree.tree_flatten_with_path(output)
        paths, leaves = tuple(pytree.keystr(path) for path, _ in flat), [leaf for _, leaf in flat]
        floats = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            return None
        for k in floats:
            self._refuse_output_hooks(module, leaves[k])
        call = self._keep_call(module, args, kwargs, leaves[floats[0]].device)
        base_signature = call.signature
        meta = any(leaves[k].is_meta for k in floats)  # (plan on the meta device: shapes only, every leaf counts)
        depends, replayed = (floats, None) if meta else self._depending(module, call, leaves, floats, paths)
        if not depends:
            return None
        found = self._verified_for(output, "axes")  # a tensor output that batch_not_leading verified just now
        if found is not None:
            return found.apply(call, batch), found.picked
        leading = [leaves[k].shape[0] for k in depends if leaves[k].dim() > 0]
        rows = batch if batch in leading else leading[0] if leading else None
        per_sample = tuple(k for k in depends if leaves[k].dim() > 0 and leaves[k].shape[0] == rows)
        picked = OutputLeaves(
            count=len(leaves), rows=rows, per_sample=per_sample,
            shapes=tuple(tuple(leaves[k].shape[1:]) for k in per_sample),
            dtypes=tuple(leaves[k].dtype for k in per_sample),
            shared=tuple(k for k in depends if k not in per_sample), paths=paths,
        )
        call.outputs = picked
        call.signature = (*call.signature, ("rows", rows, per_sample, picked.shared))
        self._set_rows(module, args, kwargs, call, rows or 0)
        # (one sample in the model call: its rows may interact, nothing can mix); at every call, the values decide
        if call.batch > 1 and per_sample and not meta and batch != 1:
            # the leading rows may be tokens or windows rather than the samples: every row is checked apart
            ambiguous = rows != batch or any(batch in tuple(leaves[k].shape[1:]) for k in depends)
            try:
                if ambiguous:
                    self._check_rows(module, call, output, again=replayed)
                else:
                    self._check_independence(module, call, output, again=replayed)
            except SampleMixingError as err:  # the batch may sit at another axis (a module run sequence-first)
                leading = call.signature
                call.signature, call.outputs = base_signature, None
                if rows != batch and batch is not None and batch > 1 and not self.swapped:
                    # rows that are not the samples (tokens, windows): the batch at another axis, where one verifies;
                    # else the rows are left to the row reader, as far as perturbing row 0 alone allows
                    found = self._axes_of_call(module, call, leaves, tuple(depends), paths, batch)
                    if found is not None:
                        return found.apply(call, batch), found.picked
                    call.signature, call.outputs = leading, picked
                    self._check_independence(module, call, output, again=replayed)
                else:
                    found = self._axes_after_refusal(module, call, leaves, tuple(depends), paths, batch, err)
                    return found.apply(call, batch), found.picked
        return call, picked

    def _depending(self, module, call: FallbackCall, leaves: list, floats: list[int],
                   paths: tuple[str, ...]) -> tuple[tuple[int, ...], list]:
        """(the positions among ``floats`` of the output leaves that depend on the module's trainable parameters, the
        leaves of the replay that read them): a replay with those parameters requiring grad (and nothing else) says
        which leaves require grad. Read at every call: which leaves depend on them can change with the values (a
        branch on the data that computes a leaf from the parameters on some batches only), and a leaf left out would
        lose its part of the gradient; the same replay then serves the check that samples stay apart.

        A tensor that depends on them inside an object the output holds but torch's pytree does not flatten (a
        class of its own: a cache of keys and values) is not differentiated: the loss must not use it. At every call
        it is replaced in that object by a copy that refuses any gradient (``_guard_hidden``); where it cannot be
        replaced (inside a tuple of such an object), or where a leaf that depends on them is not floating point, the
        call is refused."""
        depends, hidden, replayed = self._read_depending(module, call, leaves, floats)
        for k in hidden:
            self._guard_hidden(module, leaves[k], paths[k])
        return depends, replayed

    def _read_depending(self, module, call: FallbackCall, leaves: list, floats: list[int]):
        """(the float leaves that depend on the trainable parameters, the other leaves that hold tensors that do, and
        the replay's leaves, detached), from one replay."""
        names = tuple(n for n in self.param_names if module.get_parameter(n).requires_grad)
        primals = {n: module.get_parameter(n).detach().requires_grad_(True) for n in names}
        device, enabled, dtype = call.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            try:
                out = self._replay(module, *call.arguments(), primals)
            except (RuntimeError, ValueError, TypeError) as err:
                raise self._cannot_replay(module, err) from err
        replayed = pytree.tree_leaves(out)
        if len(replayed) != len(leaves):
            raise self._not_reproduced(module)
        hidden = []
        for k, leaf in enumerate(replayed):
            if k not in floats and any(t.requires_grad for t in _tensors_within(leaf)):
                if isinstance(leaf, torch.Tensor):  # (an integer tensor that depends on them)
                    raise self._hidden_refusal(module, leaf, k, None)
                hidden.append(k)
        depends = tuple(k for k in floats if replayed[k].requires_grad)
        return depends, tuple(hidden), [t.detach() if isinstance(t, torch.Tensor) else t for t in replayed]
