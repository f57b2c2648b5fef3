"""The contract every layer rule fulfils, and the registry that finds a rule for a module.

A rule turns one module call into *operands*: tensors whose dim 0 is the batch and dim 1
is the "token" axis T (sequence positions, conv output locations, ...). Several calls of
the same module are concatenated along dim 1, which keeps per-sample norms exact when a
module is reused (the cross terms between calls are then part of the Gram matrices and
of the instantiated gradients).

From the operands a rule provides the paper primitives for its trainable parameters:

- ``ghost_sq_norm``   module 3 of the book-keeping paper: ||dL_i/dW||^2 without forming it
- ``per_sample_grads`` module 4: the per-sample gradients themselves (also used for biases)
- ``clipped_grads``    module 2b(C): sum_i C_i dL_i/dW computed directly from a, g and C
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one module call, as in the papers' complexity tables.

    ``T`` is the number of token positions per sample, ``p`` the output width and ``d`` the
    input width of the weight seen as a matrix (``d = C_in * prod(kernel) / groups`` for a
    convolution), ``blocks`` the number of independent weight blocks (conv groups).
    A rule without a ghost norm reports ``ghost_supported=False``.
    """

    T: int
    p: int
    d: int
    blocks: int = 1
    ghost_supported: bool = True

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

    module_types: tuple[type[nn.Module], ...] = ()
    #: names of the parameters this rule knows how to handle, in the module
    param_names: tuple[str, ...] = ("weight", "bias")

    def validate(self, module: nn.Module) -> None:
        """Raise ``ValueError`` if this module's configuration cannot be made private exactly."""

    def capture(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> Any:
        """Keep what the backward needs from the forward call (usually the input tensor)."""
        return inputs[0].detach()

    def dims(self, module: nn.Module, activation: Any, output: torch.Tensor) -> LayerDims:
        raise NotImplementedError

    def operands(self, module: nn.Module, activation: Any, grad_output: torch.Tensor) -> tuple:
        """Tensors of shape [B, T, ...] from which every primitive is computed."""
        raise NotImplementedError

    def concat_calls(self, calls: list[tuple]) -> tuple:
        """Operands of several calls of one module as if they were one call with more tokens."""
        return tuple(torch.cat(parts, dim=self.token_dim) for parts in zip(*calls))

    #: the axis of the operands that holds the token positions
    token_dim: int = 1

    def ghost_sq_norm(self, module: nn.Module, ops: tuple) -> torch.Tensor:
        """[B] squared norms of the weight's per-sample gradients (only if ghost_supported)."""
        raise NotImplementedError

    def per_sample_grads(self, module: nn.Module, ops: tuple, names: set[str]) -> dict[str, torch.Tensor]:
        """{name: [B, *param.shape]} per-sample gradients of the named parameters."""
        raise NotImplementedError

    def clipped_grads(
        self, module: nn.Module, ops: tuple, factors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """{name: sum_i factors[name][i] * dL_i/d(name)} without per-sample gradients."""
        raise NotImplementedError


_REGISTRY: list[LayerRule] = []


def register_layer(rule: LayerRule | type[LayerRule]) -> LayerRule:
    """Register a rule (class or instance); usable as a class decorator.

    Rules registered later win over earlier ones for the same class, so a user can
    override a built-in rule. Lookup follows the class hierarchy: a subclass of
    ``nn.Linear`` is covered by the ``nn.Linear`` rule unless a closer rule exists.
    """
    instance = rule() if isinstance(rule, type) else rule
    if not instance.module_types:
        raise ValueError(f"{type(instance).__name__}.module_types is empty: name the nn.Module classes it covers")
    _REGISTRY.append(instance)
    return rule


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for the closest class in ``type(module).__mro__``; later registrations win ties."""
    best: tuple[int, int] | None = None
    found = None
    mro = type(module).__mro__
    for order, rule in enumerate(_REGISTRY):
        for cls in rule.module_types:
            if cls in mro:
                key = (mro.index(cls), -order)
                if best is None or key < best:
                    best, found = key, rule
    return found


def registered_rules() -> list[LayerRule]:
    return list(_REGISTRY)


def trainable_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's own (non-recursive) parameters that require grad."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, *, f] -> [B, T, f] with T the product of the middle dims (T = 1 for [B, f])."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def float32_at_least(x: torch.Tensor) -> torch.Tensor:
    """Norms are accumulated in float32 or wider, also under bf16/fp16 training."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x

