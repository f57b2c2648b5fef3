"""Data written outside the private gradient: the model's buffers and parameters checked for writes by each
training forward (``StateWrites``)."""
from __future__ import annotations

import torch
from torch import nn

from .trainable import registrations


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
