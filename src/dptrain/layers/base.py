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

import inspect
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

    #: True: the gradient is read at the first input of ``hook_target(module)`` instead of the
    #: module's output (for parameters consumed inside a larger module, such as a ViT's
    #: class token and position embedding, whose contribution enters a dropout layer).
    captures_input: bool = False

    def hook_target(self, module: nn.Module) -> nn.Module:
        return module

    def capture_sites(self, module: nn.Module) -> list[CaptureSite]:
        """For ``captures_input`` rules: where each call's activation and gradient are read.

        Default: one site whose gradient target is ``hook_target(module)``. A parameter that scales
        the output of one submodule before it enters another (a layer scale ``x + gamma * f(x)``)
        needs two points: the activation ``f(x)`` and the gradient of the product.
        """
        return [CaptureSite(self.hook_target(module))]

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

    def capture(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> Any:
        """Keep what the backward needs from the forward call (usually the input tensor)."""
        return inputs[0].detach()

    def capture_call(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> Any:
        """``capture`` for a call with its keyword arguments; by default they are bound to the
        forward's positional order (``layer(input=x)`` is ``layer(x)``). A rule that needs the whole
        call (the per-sample fallback, which replays it) overrides this."""
        return self.capture(module, positional_inputs(module, args, kwargs), output)

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

    def factorable(self, module: nn.Module) -> bool:
        """Whether ``weight_factors`` gives factors for this module (the ghost norm of a tied weight)."""
        return type(self).weight_factors is not LayerRule.weight_factors

    def weight_factors(self, module: nn.Module, ops: tuple) -> tuple | None:
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


@dataclass(frozen=True)
class CaptureSite:
    """A capture point of a ``captures_input`` rule: the gradient is read at the first input of
    ``target``; the activation is ``source``'s output (its first input with ``source_input=True``)
    from the same forward, or, without a source, ``target``'s inputs."""

    target: nn.Module
    source: nn.Module | None = None
    source_input: bool = False


@dataclass(frozen=True)
class OneHot:
    """The one-hot matrix [B, T, size] of token ids [B, T], never formed."""

    ids: torch.Tensor
    size: int


def factor_gram(x, y) -> torch.Tensor:
    """[B, Tx, Ty] inner products between the rows of two factors (dense or one-hot)."""
    if isinstance(x, OneHot) and isinstance(y, OneHot):
        return (x.ids.unsqueeze(2) == y.ids.unsqueeze(1)).float()
    if isinstance(x, OneHot):
        y = float32_at_least(y)
        index = x.ids.unsqueeze(1).expand(y.shape[0], y.shape[1], x.ids.shape[1])
        return torch.gather(y, 2, index).transpose(1, 2)  # y[b, s, ids[b, t]]
    if isinstance(y, OneHot):
        return factor_gram(y, x).transpose(1, 2)
    x, y = float32_at_least(x), float32_at_least(y)
    return torch.bmm(x, y.transpose(1, 2))


def shared_sq_norm(factors: list[tuple]) -> torch.Tensor:
    """||sum_m U_m^T V_m||_F^2 per sample, cross terms included, from Gram matrices only."""
    total = None
    for i, (u_i, v_i) in enumerate(factors):
        for j in range(i, len(factors)):
            u_j, v_j = factors[j]
            term = (factor_gram(u_i, u_j) * factor_gram(v_i, v_j)).sum((1, 2))
            term = term if i == j else 2 * term
            total = term if total is None else total + term
    return total


_REGISTRY: list[LayerRule] = []


def register_layer(rule: LayerRule | type[LayerRule]) -> LayerRule:
    """Register a rule (class or instance); usable as a class decorator.

    Rules registered later win over earlier ones for the same class, so a user can
    override a built-in rule. Lookup follows the class hierarchy: a subclass of
    ``nn.Linear`` is covered by the ``nn.Linear`` rule unless a closer rule exists.
    ``module_types`` may also name a class as ``"package.module.ClassName"``, so that a
    rule for an optional library's layer needs no import of that library.
    """
    instance = rule() if isinstance(rule, type) else rule
    if not instance.module_types:
        raise ValueError(f"{type(instance).__name__}.module_types is empty: name the nn.Module classes it covers")
    _REGISTRY.append(instance)
    return rule


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for the closest class in ``type(module).__mro__``; later registrations win ties.

    A rule registered for a base class does not cover a subclass that overrides ``forward``
    (for example a LayerNorm applied to channels-first inputs): its per-sample gradients
    could differ silently, so such a subclass needs its own rule.
    """
    best: tuple[int, int] | None = None
    found = None
    mro = type(module).__mro__
    names = [f"{c.__module__}.{c.__qualname__}" for c in mro]
    for order, rule in enumerate(_REGISTRY):
        for cls in rule.module_types:
            if isinstance(cls, str):
                depth = names.index(cls) if cls in names else None
            else:
                depth = mro.index(cls) if cls in mro else None
            if depth is None or type(module).forward is not mro[depth].forward:
                continue
            key = (depth, -order)
            if best is None or key < best:
                best, found = key, rule
    return found


def covering_base(module: nn.Module) -> type | None:
    """A base class of ``module`` that has a rule, if ``module`` only misses it by overriding forward."""
    mro = type(module).__mro__
    names = {f"{c.__module__}.{c.__qualname__}": c for c in mro}
    for rule in _REGISTRY:
        for cls in rule.module_types:
            base = names.get(cls) if isinstance(cls, str) else (cls if cls in mro else None)
            if base is not None and base is not type(module):
                return base
    return None


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


def trainable_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's own (non-recursive) parameters that require grad."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def container_params(module: nn.Module) -> tuple[str, ...]:
    """Dotted names of the parameters ``module`` keeps in ``nn.ParameterDict`` / ``nn.ParameterList``
    children. A container is never called: the module reads them in its own forward (PEFT's embedding
    adapters), so they are the module's to handle when it has no rule (the per-sample fallback's)."""
    return tuple(
        f"{cname}.{pname}" for cname, child in module.named_children()
        if isinstance(child, (nn.ParameterDict, nn.ParameterList))
        for pname, _ in child.named_parameters(recurse=False)
    )


def layer_params(model: nn.Module) -> dict[nn.Module, dict[str, nn.Parameter]]:
    """{module: trainable parameters its rule handles}: its own, minus those an ancestor's rule
    claims by a dotted name in ``param_names``, plus those it claims itself (by dotted name); a
    module without a rule claims its parameter containers' parameters (``container_params``)."""
    claims: dict[nn.Module, dict[str, nn.Parameter]] = {}
    claimed: set[tuple[int, str]] = set()  # (id of the owning module, local name)
    for module in model.modules():
        rule = find_rule(module)
        for dotted in (rule.claims(module) if rule is not None else container_params(module)):
            path, leaf = dotted.rsplit(".", 1)
            try:
                owner = module.get_submodule(path)
            except AttributeError:
                continue
            p = owner._parameters.get(leaf)
            if p is not None and p.requires_grad:
                claims.setdefault(module, {})[dotted] = p
                claimed.add((id(owner), leaf))
    out = {}
    for module in model.modules():
        # A parameter also registered on a descendant is an alias (Hugging Face ties BertLMPredictionHead.bias
        # to decoder.bias): the descendant that uses it handles it; any other use is caught by the engine.
        below = {id(p) for child in module.children() for p in child.parameters()}
        params = {
            n: p for n, p in trainable_params(module).items()
            if (id(module), n) not in claimed and id(p) not in below
        }
        params.update(claims.get(module, {}))
        if params:
            out[module] = params
    return out


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, *, f] -> [B, T, f] with T the product of the middle dims (T = 1 for [B, f])."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def float32_at_least(x: torch.Tensor) -> torch.Tensor:
    """Norms are accumulated in float32 or wider, also under bf16/fp16 training."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32, or the widest of ``dtypes`` if wider: where norms, clipping factors and their
    products with low-precision (bf16/fp16) operands are formed."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def scale_samples(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t[i] * factor[i]`` for every sample i (dim 0), in ``t``'s dtype.

    The product is formed in float32 (or wider) and rounded once: a clipping factor is never
    rounded to bf16/fp16 itself, which would scale every entry of a sample's contribution by
    the same rounding error (up to 2^-8 relative in bf16) and let it exceed the threshold.
    """
    acc = accumulation_dtype(t.dtype, factor.dtype)
    scaled = t.to(acc) * factor.to(acc).reshape(-1, *([1] * (t.dim() - 1)))
    return scaled.to(t.dtype)


def weighted_sum(factor: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """``sum_i factor[i] * per_sample[i]`` formed in float32 or wider (the engine casts it to the parameter's
    dtype), for the small per-sample gradients of biases and norm layers."""
    acc = accumulation_dtype(per_sample.dtype, factor.dtype)
    return torch.tensordot(factor.to(acc), per_sample.to(acc), dims=1)

