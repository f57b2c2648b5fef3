"""What a replay runs in: the mark that a recorded call is being replayed (``in_replay``, which the capture's hooks
read to stay silent), the module called past its own hooks with its parameters swapped (``replay``), in an empty
``contextvars`` context, and the plain-autograd vjp for the replays that run outside a ``vmap`` (``autograd_vjp``)."""
from __future__ import annotations

import contextvars
import threading
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils import _pytree as pytree

_state = threading.local()


@contextmanager
def replaying():
    """Marks a replay of a recorded call: capture hooks must neither switch parameters nor record calls."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_replay() -> bool:
    """True while the fallback (or a recognised norm's check) replays a module call."""
    return getattr(_state, "depth", 0) > 0


class _Bypass(nn.Module):
    """Calls ``target.forward`` directly, so the target's own hooks (the engine's) do not run on a replay."""

    def __init__(self, target: nn.Module):
        super().__init__()
        self.target = target

    def forward(self, args, kwargs):
        return self.target.forward(*args, **kwargs)


def replay(module: nn.Module, args: tuple, kwargs: dict, params: dict[str, torch.Tensor] | None = None):
    """``module(*args, **kwargs)`` with its own parameters replaced by ``params`` (name -> tensor).

    Every other parameter of the subtree enters detached (the replay differentiates only
    ``params``); buffers enter as copies, so a forward that updates them in place (running
    statistics) leaves the module as it was. It runs in an empty ``contextvars`` context, so that
    state a library keeps per model call in context variables does not record it.

    Each tensor *slot* (a module object and the attribute name it keeps the tensor under) is
    swapped once, whatever the number of names it answers to: a submodule registered under two
    names (timm's CoaT keeps one conv at the root and inside a block) has one slot per tensor, and
    swapping it under both names would restore it wrong (the second swap saves the first one's
    stand-in as the "original", which then stays in the module in place of the user's parameter).
    A parameter of ``params`` is substituted in its own slot only; where the same parameter is also
    registered on a descendant, that descendant's slot enters detached (its own rule handles it).
    """
    params = params or {}
    own: dict[tuple[int, str], torch.Tensor] = {}  # (id of the owning module, local name) -> replacement
    for name, tensor in params.items():
        path, _, leaf = name.rpartition(".")
        own[(id(module.get_submodule(path)), leaf)] = tensor
    swapped: dict[str, torch.Tensor] = {}
    for prefix, owner in module.named_modules(remove_duplicate=True):  # each module object once
        dotted = f"target.{prefix}." if prefix else "target."
        for leaf, p in owner._parameters.items():
            if p is not None:
                swapped[dotted + leaf] = own.get((id(owner), leaf), p.detach())
        for leaf, b in owner._buffers.items():
            if b is not None:
                swapped[dotted + leaf] = b.clone()
    # In an empty context: what a library keeps per model call in context variables (Hugging Face's collector of
    # hidden states, which its layers' hooks append to) does not see the replay's calls of the children.
    with replaying():
        return contextvars.Context().run(torch.func.functional_call, _Bypass(module), swapped, (args, kwargs),
                                         tie_weights=False)


def autograd_vjp(fn, primals: dict[str, torch.Tensor]):
    """``torch.func.vjp(fn, primals)`` through plain autograd: (output, pullback), the pullback giving
    ``({name: gradient},)`` (zeros for a parameter the output does not depend on) and callable more than once.

    For the replays that run outside a ``vmap`` (one sample at a time, the checks, the second pass): plain autograd
    runs what functorch's transforms cannot (a custom ``autograd.Function`` without ``setup_context``, as routers
    written for torch < 2.0 are), and nothing else differs (the other parameters enter the replay detached)."""
    leaves = {n: p.detach().requires_grad_(True) for n, p in primals.items()}
    with torch.enable_grad():
        out = fn(leaves)

    def pullback(cotangent):
        outs, cots = [], []
        for o, c in zip(pytree.tree_leaves(out), pytree.tree_leaves(cotangent)):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                outs.append(o)
                cots.append(c)
        got = torch.autograd.grad(outs, list(leaves.values()), cots, retain_graph=True, allow_unused=True) \
            if outs else [None] * len(leaves)
        return ({n: torch.zeros_like(p) if t is None else t for (n, p), t in zip(leaves.items(), got)},)

    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), pullback
