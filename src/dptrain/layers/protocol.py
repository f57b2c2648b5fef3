"""The contract every layer rule fulfils: ``LayerRule``, the sizes it reports (``LayerDims``) and where a
rule that reads a parameter between two submodules captures its tensors (``CaptureSite``).

A rule turns one module call into *operands*: tensors whose dim 0 is the batch and dim 1
is the "token" axis T (sequence positions, conv output locations, ...). Several calls of
the same module are concatenated along dim 1, which keeps per-sample norms exact when a
module is reused (the cross terms between calls are then part of the Gram matrices and
of the instantiated gradients).

From the operands a rule provides the paper primitives for its trainable parameters:

- ``ghost_sq_norm``   module 3 of the book-keeping paper: ||dL_i/dW||^2 without forming it
- ``per_sample_grads`` module 4: the per-sample gradients themselves (also used for biases)
- ``clipped_grads``    module 2b(C): sum_i C_i dL_i/dW computed directly from a, g and C; the
  default builds it from ``weight_factors`` (the weight) and ``per_sample_grads`` (the rest)

The weight factors may be a :class:`~dptrain.layers.numerics.OneHot` (token ids).
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .numerics import OneHot, factor_weighted_sum, weighted_sum

__all__ = ["CaptureSite", "LayerDims", "LayerRule", "OneHot", "OutputLeaves", "positional_inputs"]


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one module call, as in the papers' complexity tables.

    ``T`` is the number of token positions per sample, ``p`` the output width and ``d`` the
    input width of the weight seen as a matrix (``d = C_in * prod(kernel) / groups`` for a
    convolution), ``blocks`` the number of independent weight blocks (conv groups).
    A rule without a ghost norm reports ``ghost_supported=False``; the per-sample fallback
    (``dptrain.layers.fallback``) reports ``fallback=True`` and ``p * d`` = its parameter count.
    """

    T: int
    p: int
    d: int
    blocks: int = 1
    ghost_supported: bool = True
    fallback: bool = False

    @property
    def ghost_cost(self) -> int:
        """Space of the ghost norm per sample: two T x T Gram matrices per block (eq. 4.1)."""
        return 2 * self.T * self.T * self.blocks

    @property
    def instantiate_cost(self) -> int:
        """Space of one instantiated per-sample weight gradient: the weight's size."""
        return self.p * self.d * self.blocks


class LayerRule:
    """Per-layer primitives. Subclasses set ``module_types`` and implement the methods."""

    module_types: tuple[type[nn.Module] | str, ...] = ()
    #: names of the parameters this rule knows how to handle, in the module. A dotted name
    #: (``"qkv.weight"``) claims a descendant's parameter that the module uses itself (for
    #: example ``F.linear(x, self.qkv.weight, bias)``): it is then this rule's, not the
    #: descendant's rule's, and named by its dotted path in the operand methods.
    param_names: tuple[str, ...] = ("weight", "bias")

    #: True: the gradient is read at the input of a submodule (``capture_sites``) instead of the
    #: module's output (for parameters consumed inside a larger module, such as a ViT's
    #: class token and position embedding, whose contribution enters a dropout layer).
    captures_input: bool = False

    def capture_sites(self, module: nn.Module) -> list[CaptureSite]:
        """For ``captures_input`` rules: where each call's activation and gradient are read.

        One site per point: the gradient at a submodule's first input (``CaptureSite(target)``). A
        parameter that scales the output of one submodule before it enters another (a layer scale
        ``x + gamma * f(x)``) needs two points: the activation ``f(x)`` and the gradient of the product.
        """
        return [CaptureSite(module)]

    def capture_at(self, module: nn.Module, site: int, inputs: tuple, tensor: torch.Tensor) -> Any:
        """``capture`` for site ``site`` of ``capture_sites``.

        ``inputs`` is ``(source tensor,)`` for a site with an activation source, else the target's inputs.
        """
        return self.capture(module, inputs, tensor)

    def claims(self, module: nn.Module) -> tuple[str, ...]:
        """Dotted names of descendants' parameters this rule handles for ``module`` (default: those in
        ``param_names``); they are then this rule's, not the descendant's rule's."""
        return tuple(n for n in self.param_names if "." in n)

    def validate(self, module: nn.Module) -> None:
        """Raise ``ValueError`` if this module's configuration cannot be made private exactly."""

    #: None, or a function ``(module, args, kwargs)`` the capture calls before each recorded call of the module runs
    #: (the per-sample fallback keeps the objects among the arguments that the call may change, a cache of keys and
    #: values, as they are before it)
    before_call: ClassVar[Callable[..., None] | None] = None

    def capture(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> Any:
        """Keep what the backward needs from the forward call (usually the input tensor)."""
        return inputs[0].detach()

    def capture_call(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> Any:
        """``capture`` for a call with its keyword arguments; by default they are bound to the
        forward's positional order (``layer(input=x)`` is ``layer(x)``). A rule that needs the whole
        call (the per-sample fallback, which replays it) overrides this."""
        return self.capture(module, positional_inputs(module, args, kwargs), output)

    #: True: a call whose output is a container of tensors (tuple, list, dict, Hugging Face ``ModelOutput``) is taken
    #: by ``capture_leaves``, and its output gradient is that of the leaves the rule picks (``OutputLeaves``), all at
    #: once. False: such a call is refused, naming the module (the engine differentiates a layer through its output)
    takes_output_leaves: bool = False

    def capture_leaves(self, module: nn.Module, args: tuple, kwargs: dict, output: Any,
                       batch: int | None) -> tuple[Any, OutputLeaves] | None:
        """(activation, the output's leaves to differentiate) of a call whose output is a container (only for a rule
        with ``takes_output_leaves``); ``batch``: the model call's batch size, if known. ``None``: no leaf of the
        output depends on the rule's trainable parameters (the call adds nothing to their gradients)."""
        raise NotImplementedError

    def dims(self, module: nn.Module, activation: Any, output: torch.Tensor) -> LayerDims:
        """The sizes of one call (``LayerDims``: T, p, d, whether a ghost norm exists), from which the planner and
        the mixed modes choose between a ghost norm and an instantiated per-sample gradient."""
        raise NotImplementedError

    def operands(self, module: nn.Module, activation: Any, grad_output: torch.Tensor) -> tuple:
        """Tensors of shape [B, T, ...] from which every primitive is computed."""
        raise NotImplementedError

    def concat_calls(self, calls: list[tuple]) -> tuple:
        """Operands of several calls of one module as if they were one call with more tokens."""
        return tuple(torch.cat(parts, dim=1) for parts in zip(*calls))

    #: True: every leading axis of the call's input and output is a token axis in the same place (features
    #: last), so rows of several samples can be regrouped into one sample's tokens ([B, K, ...]), and a
    #: sequence-first call ([T, B, ...]) read over its two leading axes (``dptrain.rows``)
    rows_fold_into_tokens: bool = False

    #: Optional hook ``regroup_call(module, activation, grad, samples, batch) -> (operands, [LayerDims])`` for a
    #: call whose rows along dim 0 are not the samples in order (windows or tokens folded into the batch, rows
    #: reordered or routed): ``samples[r]`` (long, on the CPU) is the sample of row ``r`` (-1: a row with no
    #: gradient, which contributes nothing), ``batch`` the number of samples, and the operands returned are those
    #: of one call of ``batch`` samples. Rows are regrouped by ``dptrain.rows`` only through it where the rule has
    #: it (the per-sample fallback, whose activation is the whole call, replays each sample's rows); without it,
    #: only a tensor activation sharing the output's leading axes can be regrouped, and other calls are refused.
    regroup_call: ClassVar[Callable[..., Any] | None] = None

    def ghost_sq_norm(self, module: nn.Module, ops: tuple) -> torch.Tensor:
        """[B] squared norms of the weight's per-sample gradients (only if ghost_supported)."""
        raise NotImplementedError

    def per_sample_grads(self, module: nn.Module, ops: tuple, names: set[str]) -> dict[str, torch.Tensor]:
        """{name: [B, *param.shape]} per-sample gradients of the named parameters."""
        raise NotImplementedError

    def clipped_grads(
        self, module: nn.Module, ops: tuple, factors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``{name: sum_i factors[name][i] * dL_i/d(name)}`` for the named parameters (module 2b(C)).

        The default needs no code of its own: ``weight``, where ``weight_factors`` gives factors
        ``U, V``, is ``sum_i C_i U_i^T V_i`` formed from them without any per-sample gradient; every
        other parameter (biases, norm scales, tokens: gradients as small as a norm) is the weighted sum
        of its per-sample gradients from ``per_sample_grads``. Override it where the layer has a kernel
        of its own (a convolution's weight-gradient kernel on scaled output gradients).
        """
        out: dict[str, torch.Tensor] = {}
        if "weight" in factors and self.factorable(module):
            uv = self.weight_factors(module, ops)
            if uv is not None:
                weight = module.get_parameter("weight")
                out["weight"] = factor_weighted_sum(*uv, factors["weight"]).reshape(weight.shape)
        rest = [n for n in factors if n not in out]
        if rest:
            per_sample = self.per_sample_grads(module, ops, set(rest))
            missing = [n for n in rest if n not in per_sample]
            if missing:
                raise KeyError(f"{type(self).__name__}.per_sample_grads gave no gradient for {missing}")
            out.update((n, weighted_sum(factors[n], per_sample[n])) for n in rest)
        return out

    def factorable(self, module: nn.Module) -> bool:
        """Whether ``weight_factors`` gives factors for this module (the ghost norm of a tied weight)."""
        return type(self).weight_factors is not LayerRule.weight_factors

    def weight_factors(self, module: nn.Module, ops: tuple) -> tuple[Any, torch.Tensor] | None:
        """(U [B, T, rows], V [B, T, cols]) with dL_i/dW = U_i^T V_i, W seen as [dim 0, rest].

        Used for the exact ghost norm of a weight shared by several modules (tied
        embeddings): the cross terms between modules come from Gram matrices of the
        factors. ``U`` may be a :class:`OneHot`. ``None``: the weight is instantiated instead.
        """
        return None

    def expand_batch(self, module: nn.Module, activation: Any, output: torch.Tensor, batch: int):
        """(activation, output) repeated over a batch that a size-1 call is broadcast to, or None.

        A layer fed an input of batch size 1 that broadcasts over the batch (a position
        embedding fed ids of shape [1, T]) loses the per-sample gradients in its summed
        output gradient; expanding the output to the batch keeps them, at no copy.
        """
        return None


def expand_input_rows(rule, module, activation, output, batch):
    """``LayerRule.expand_batch`` for a rule whose activation is the call's input tensor, one row per output row
    (linear, convolution, embedding): a call on one row broadcast over the batch afterwards (a position table on
    ``[1, T]`` ids, a projection of timm XCiT's Fourier features) has that row for each sample, at no copy."""
    return activation.expand(batch, *activation.shape[1:]), output.expand(batch, *output.shape[1:])


@dataclass(frozen=True)
class OutputLeaves:
    """The leaves of a container output (in ``torch.utils._pytree`` order) that a rule differentiates.

    ``per_sample``: the positions of the leaves that depend on the rule's trainable parameters and lead with the call's
    ``rows`` (one per sample, or rows that the engine maps to samples from the gradient like a tensor output's); the
    call's output gradient is theirs, each flattened per row and joined: ``[rows, sum of their sizes]`` (``join``), in
    the widest of their dtypes, zeros for a leaf that no gradient reached. ``shared``: the positions of leaves that
    depend on those parameters without leading with the rows (a table broadcast over the batch, a scalar): which
    sample a gradient on them comes from cannot be told, so one that receives a gradient is refused. ``paths``:
    every leaf's key path (``[1]``, ``.attentions[0]``), which refusals name. ``axes``: where a per-sample leaf's
    batch is not its first axis (a module run sequence-first, ``[T, B, d]``, in a batch-first model), each per-sample
    leaf's batch axis, verified by the rule (``FallbackRule``); ``join`` moves it to the front and ``split`` back, so
    the rows of the joined gradient are the samples. ``None``: every per-sample leaf leads with its rows.
    """

    count: int
    rows: int | None
    per_sample: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]  # each per-sample leaf's shape after its rows
    dtypes: tuple[torch.dtype, ...]
    shared: tuple[int, ...]
    paths: tuple[str, ...]
    axes: tuple[int, ...] | None = None

    @property
    def width(self) -> int:
        """The size of one row of the joined gradient."""
        return sum(math.prod(s) for s in self.shapes)

    def join(self, grads) -> torch.Tensor:
        """The joined gradient ``[rows, width]`` of the per-sample leaves' gradients (``None``: zeros)."""
        dtype = functools.reduce(torch.promote_types, self.dtypes)
        like = next(g for g in grads if g is not None)
        if self.axes is not None:  # each leaf's batch axis to the front (a leaf of zeros is made that way)
            grads = [g if g is None else g.movedim(axis, 0) for g, axis in zip(grads, self.axes)]
        parts = [(g if g is not None else like.new_zeros(self.rows, *shape, dtype=dtype)).reshape(self.rows, -1)
                 for g, shape in zip(grads, self.shapes)]
        return torch.cat([part.to(dtype) for part in parts], 1)

    def split(self, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A joined gradient ``[..., width]`` (rows or one row) cut into the leaves' ``[..., *shape]``."""
        sizes = [math.prod(s) for s in self.shapes]
        parts = tuple(part.reshape(*g.shape[:-1], *shape) for part, shape in zip(g.split(sizes, -1), self.shapes))
        if self.axes is None or g.dim() < 2:
            return parts
        lead = g.dim() - 2  # the rows' axis, after any axes vmap left in front
        return tuple(part.movedim(lead, lead + axis) for part, axis in zip(parts, self.axes))

    def pick(self, output) -> tuple[torch.Tensor, ...]:
        """The per-sample leaves of an output of the same call (a replay's)."""
        from torch.utils import _pytree as pytree

        leaves = pytree.tree_leaves(output)
        if len(leaves) != self.count:
            raise ValueError(f"the call's output has {len(leaves)} leaves, the recorded one {self.count}")
        return tuple(leaves[k] for k in self.per_sample)


@dataclass(frozen=True)
class CaptureSite:
    """A capture point of a ``captures_input`` rule: the gradient is read at the first input of
    ``target``; the activation is ``source``'s output (its first input with ``source_input=True``)
    from the same forward, or, without a source, ``target``'s inputs."""

    target: nn.Module
    source: nn.Module | None = None
    source_input: bool = False


def positional_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A call's arguments in the order of ``module.forward``'s signature (keywords bound to their place)."""
    if not kwargs:
        return args
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{type(module).__name__} was called with arguments its forward does not take: {err}") from None
    bound.apply_defaults()  # an argument skipped by keyword keeps its place (its default)
    out: list = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out.extend(value)
        elif kind is not inspect.Parameter.VAR_KEYWORD:
            out.append(value)
    return tuple(out)
