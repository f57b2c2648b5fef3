"""The per-sample fallback: exact per-sample gradients for any module that has no rule.

A module with trainable parameters of its own and no registered rule (a subclass that
overrides ``forward``, a module that uses a parameter directly, ``x * self.scale``, a layer
from a library released after this one) keeps each call whole: its arguments (the batched
tensors detached) and, in the backward, its output gradient ``g``. The per-sample gradients
of the module's *own* parameters then come from ``torch.func``: a ``vmap`` over the batch of
the ``vjp`` of the replayed call with respect to those parameters, with cotangent ``g_i``.
Children take part in the replay as they are (their parameters used, not differentiated:
their own rules handle them).

An output that is a container (tuple, list, dict, Hugging Face ``ModelOutput``: anything
``torch.utils._pytree`` flattens) is differentiated through its floating-point leaves that depend
on those parameters (``capture_leaves``; the engine hands the call their gradients joined per row,
zeros for a leaf the loss does not use): ``g_i`` is cut into the leaves' cotangents.

This is instantiation only (modules 4 + 5 of the book-keeping paper): it costs one more
forward of the module per call, vectorised over the batch, and a per-sample gradient of
each of its own parameters (``B x`` their size), never a ghost norm.

A replay is only exact when the module treats samples independently. At every call the rule
checks this and refuses otherwise: it perturbs one sample's input and checks that no other
sample's output moves (and that the replay reproduces the recorded output at all, which random
operations such as dropout break), that each sample replayed alone gives its rows of the call,
and that the per-sample gradients sum to the gradient of the whole batch. Every call, since
each check reads values: a module may mix samples only on some data (an expert's capacity), once
a coefficient is no longer 0, or once a batch has more than one sample.

A call whose rows are not the samples in order (windows or tokens folded into the batch, as window attention
calls its modules on ``[B * windows, N, d]``) is regrouped by ``FallbackRule.regroup_call`` with the sample of
each row (read by ``dptrain.rows``): each sample's rows are replayed alone, as the sample's own forward calls the
module. The check above then perturbs one row of the call.

The package, one concept per module: ``replay_context`` (what a replay runs in, ``in_replay``), ``records`` (what is
kept of a call), ``arguments`` (a call's arguments, objects it may change, arguments every sample shares),
``objects`` (tensors inside other objects), ``container_outputs`` and ``guarded_outputs`` (outputs other than one
tensor, and tensors handed on that the replay does not differentiate), ``batch_axes`` (the batch at another axis),
``folded`` (rows folded into the batch), ``bags`` (flat bags), ``one_by_one`` (where ``vmap`` cannot run),
``independence`` (the checks that samples stay apart), ``rule`` (``FallbackRule``, assembling them) and
``coverage`` (which modules the fallback refuses).
"""
from .coverage import fallback_refusal, fallback_warning
from .guarded_outputs import SIDE_CHANNELS, SideChannel
from .independence import SampleMixingError, min_dtype
from .records import FallbackCall, FallbackOperands, FoldedRows
from .replay_context import autograd_vjp, in_replay, replay, replaying
from .rule import FallbackRule

__all__ = [
    "SIDE_CHANNELS", "FallbackCall", "FallbackOperands", "FallbackRule", "FoldedRows", "SampleMixingError",
    "SideChannel", "autograd_vjp", "fallback_refusal", "fallback_warning", "in_replay",
    "min_dtype", "replay", "replaying",
]
