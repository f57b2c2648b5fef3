"""Tensors a call hands on other than through what the fallback differentiates: those inside an object of its
output that torch's pytree does not flatten (a cache of keys and values), and those a library collects through a
side channel (``SideChannel``: Hugging Face's collector of hidden states). They are replaced where they are kept
by copies whose gradient is refused (``_UnusedOutput``), or the call is refused where they cannot be."""
from __future__ import annotations

import torch

from .objects import _tensor_slots
from .parts import _FallbackParts


class SideChannel:
    """Where a library keeps tensors computed inside a module's call other than in its output (Hugging Face's collector
    of hidden states and attentions, which hooks on its layers fill): ``snapshot()`` before a call of a module the
    fallback replays, ``escaped(state)`` after it, the (tensor, setter) pairs the call added (``setter`` puts another
    tensor in its place). ``layers/hf.py`` registers one in ``SIDE_CHANNELS``."""

    def snapshot(self):
        raise NotImplementedError

    def escaped(self, state) -> list:
        raise NotImplementedError


SIDE_CHANNELS: list[SideChannel] = []


class _UnusedOutput(torch.autograd.Function):
    """Copies of tensors that a module's output holds where the per-sample fallback does not differentiate them (a
    cache of keys and values): their gradient is refused, with ``message``, if the loss depends on them."""

    @staticmethod
    def forward(ctx, message: str, *tensors):
        ctx.message = message
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if any(g is not None for g in grads):
            raise ValueError(ctx.message)
        return (None, *grads)


class _GuardedOutputs(_FallbackParts):
    """``FallbackRule``'s guards on the tensors a call hands on that the replay does not differentiate (mixed into
    it)."""

    def _guard_escaped(self, module) -> None:
        """Tensors the call put where a side channel keeps them (Hugging Face's collector of hidden states) rather
        than in its output: their gradient would reach the module's parameters around the replay, which
        differentiates the output only. Replaced there by copies that refuse a gradient (``_UnusedOutput``)."""
        channels, self._channels = self._channels, []
        escaped = [(t, setter) for channel, state in channels for t, setter in channel.escaped(state)
                   if isinstance(t, torch.Tensor) and t.requires_grad
                   and type(t.grad_fn).__name__ != "_UnusedOutputBackward"]
        if not escaped:
            return
        message = (
            f"{self._name(module)}: the loss depends on a tensor computed inside its call that left it other than "
            "through its output (hidden states or attentions that Hugging Face collects for output_hidden_states or "
            "output_attentions, a weighted sum of the layers' hidden states), which the per-sample fallback, "
            "differentiating the module's output only, would miss. Compute the loss without them "
            "(output_hidden_states=False, use_weighted_layer_sum=False), register a rule for "
            f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
        )
        for (_, setter), copy in zip(escaped, _UnusedOutput.apply(message, *(t for t, _ in escaped))):
            setter(copy)

    def _guard_hidden(self, module, leaf, path: str) -> None:
        """Replace the tensors inside ``leaf`` (an object of the call's output that holds some that depend on the
        parameters) that require grad by copies whose gradient is refused (``_UnusedOutput``): the module used them
        inside its call, where their gradient is part of the replay's; a loss that used them after the call would
        reach the parameters around the fallback. (Those of an object passed in and held on, a cache that several
        layers fill, are guarded alike: a loss on a cache is refused.)"""
        slots = [(t, setter) for t, setter in _tensor_slots(leaf)
                 if t.requires_grad and type(t.grad_fn).__name__ != "_UnusedOutputBackward"]
        if not slots:
            return
        if any(setter is None for _, setter in slots):
            raise self._hidden_refusal(module, leaf, None, path)
        message = self._hidden_refusal(module, leaf, None, path, used=True)
        copies = _UnusedOutput.apply(str(message), *(t for t, _ in slots))
        for (_, setter), copy in zip(slots, copies):
            setter(copy)

    def _hidden_refusal(self, module, leaf, k, path, used: bool = False) -> ValueError:
        what = (f"a {leaf.dtype} tensor that depends" if isinstance(leaf, torch.Tensor)
                else f"a {type(leaf).__name__} holding tensors that depend")
        cache = ("Cache" in type(leaf).__name__ and " (a cache of keys and values, which training does not "
                 "need: call the model with use_cache=False, or set model.config.use_cache = False)" or "")
        where = path if path is not None else "" if k is None else None
        if used:
            return ValueError(
                f"{self._name(module)}: the loss depends on its output {where or '(the whole output)'}, {what} on its "
                "trainable parameters, which the per-sample fallback does not differentiate (it takes "
                "floating-point tensors in tuples, lists, dicts, Hugging Face ModelOutputs and other containers "
                f"registered with torch.utils._pytree){cache}. Compute the loss without it, register a rule for "
                f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
            )
        return ValueError(
            f"{self._name(module)}: its output {where or '(the whole output)'} is {what} on its "
            "trainable parameters, which the per-sample fallback cannot differentiate: it takes "
            "floating-point tensors in tuples, lists, dicts, Hugging Face ModelOutputs and other containers "
            f"registered with torch.utils._pytree{cache}. Return such tensors, register a rule for "
            f"{type(module).__name__} with dptrain.register_layer, or freeze its parameters"
        )
