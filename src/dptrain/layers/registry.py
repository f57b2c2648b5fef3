"""The rule registry: which rule covers a module (by class hierarchy), and which trainable parameters each
module's rule handles (its own, and descendants' parameters it claims by a dotted name).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.nn.utils import parametrize

from .protocol import LayerRule

__all__ = [
    "container_params", "covering_base", "find_rule", "layer_params", "register_layer", "trainable_params",
    "unregister_layer",
]


_REGISTRY: list[LayerRule] = []


def register_layer(rule: LayerRule | type[LayerRule]) -> LayerRule | type[LayerRule]:
    """Register a rule (class or instance); usable as a class decorator. Returns ``rule``.

    Rules registered later win over earlier ones for the same class, so a user can
    override a built-in rule. Lookup follows the class hierarchy: a subclass of
    ``nn.Linear`` is covered by the ``nn.Linear`` rule unless a closer rule exists.
    ``module_types`` may also name a class as ``"package.module.ClassName"``, so that a
    rule for an optional library's layer needs no import of that library.

    A rule class is registered once: registering it again (a module imported twice, a test run
    twice) keeps its one entry and its place; an instance given then replaces the registered one.
    ``unregister_layer`` removes it.
    """
    if not (isinstance(rule, LayerRule) or isinstance(rule, type) and issubclass(rule, LayerRule)):
        raise TypeError(f"register_layer takes a LayerRule subclass or instance, got {rule!r}")
    instance = rule() if isinstance(rule, type) else rule
    if not instance.module_types:
        raise ValueError(f"{type(instance).__name__}.module_types is empty: name the nn.Module classes it covers")
    for k, registered in enumerate(_REGISTRY):
        if type(registered) is type(instance):
            if not isinstance(rule, type):
                _REGISTRY[k] = instance
            return rule
    _REGISTRY.append(instance)
    return rule


def unregister_layer(rule: LayerRule | type[LayerRule]) -> None:
    """Remove a rule registered with ``register_layer`` (given as its class or an instance of it).

    For tests and experiments: a module covered by it is then covered by the next closest rule, or
    by none. Raises ``ValueError`` if no rule of that class is registered.
    """
    cls = rule if isinstance(rule, type) else type(rule)
    for k, registered in enumerate(_REGISTRY):
        if type(registered) is cls:
            del _REGISTRY[k]
            return
    raise ValueError(f"{cls.__name__} is not a registered layer rule")


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for the closest class in ``type(module).__mro__``; later registrations win ties.

    A rule registered for a base class does not cover a subclass that overrides ``forward``
    (for example a LayerNorm applied to channels-first inputs): its per-sample gradients
    could differ silently, so such a subclass needs its own rule. Nor does it cover a module with a
    parametrized tensor (``torch.nn.utils.parametrizations.weight_norm``): the tensor is computed from
    other parameters at each access, which the per-sample fallback differentiates through.
    """
    if _parametrized(module):
        return None
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
            if depth is None or type(module).forward is not getattr(mro[depth], "forward", None):
                continue
            key = (depth, -order)
            if best is None or key < best:
                best, found = key, rule
    return found


def covering_base(module: nn.Module) -> type | None:
    """A base class of ``module`` that has a rule, if ``module`` only misses it by overriding forward."""
    if _parametrized(module):  # it misses the rule by computing a tensor from parametrizations
        return None
    mro = type(module).__mro__
    names = {f"{c.__module__}.{c.__qualname__}": c for c in mro}
    for rule in _REGISTRY:
        for cls in rule.module_types:
            base = names.get(cls) if isinstance(cls, str) else (cls if cls in mro else None)
            if base is not None and base is not type(module):
                return base
    return None


def trainable_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's own (non-recursive) parameters that require grad."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def _parametrized(module: nn.Module) -> bool:
    """Whether ``module`` computes some tensor of its own from parametrizations (``torch.nn.utils.parametrize``)."""
    return parametrize.is_parametrized(module)


# {qualified class name: function(module) -> dotted names of descendants' parameters its forward reads itself}
_READS_CHILD_PARAMS: dict[str | Callable[[nn.Module], bool], Callable[[nn.Module], Iterable[str]]] = {}


def reads_child_params(kind, names) -> None:
    """Declare that some modules read descendants' parameters in their own forward, outside the descendant's
    call (``F.linear(x, self.qkv.weight, bias)``): ``names(module)`` gives their dotted names. ``kind`` is a
    class as ``"package.module.ClassName"`` (no import needed) or a predicate on the module (a structure that
    several libraries' classes share). Such a module without a rule then claims them, and the per-sample
    fallback differentiates its replay with respect to them."""
    _READS_CHILD_PARAMS[kind] = names


def _child_reads(module: nn.Module) -> tuple[str, ...]:
    reads = _READS_CHILD_PARAMS.get(f"{type(module).__module__}.{type(module).__qualname__}")
    if reads is None:
        reads = next((fn for kind, fn in _READS_CHILD_PARAMS.items() if callable(kind) and kind(module)), None)
    return tuple(reads(module)) if reads is not None else ()


def container_params(module: nn.Module) -> tuple[str, ...]:
    """Dotted names of the parameters ``module`` keeps in ``nn.ParameterDict`` / ``nn.ParameterList``
    children, and the originals of its parametrized tensors (``parametrizations.weight.original0``). A
    container is never called for the batch: the module reads them in its own forward (PEFT's embedding
    adapters; weight norm's magnitude and direction, through ``module.weight``), so they are the module's to
    handle when it has no rule (the per-sample fallback's); so are the descendants' parameters a module of a
    class declared with ``reads_child_params`` reads in its own forward."""
    names = [
        f"{cname}.{pname}" for cname, child in module.named_children()
        if isinstance(child, (nn.ParameterDict, nn.ParameterList))
        for pname, _ in child.named_parameters(recurse=False)
    ]
    if _parametrized(module):
        parametrizations = module.parametrizations
        assert isinstance(parametrizations, nn.ModuleDict)  # (torch.nn.utils.parametrize keeps them so)
        names += [f"parametrizations.{tensor}.{pname}" for tensor, plist in parametrizations.items()
                  for pname, _ in plist.named_parameters(recurse=False)]
    names += _child_reads(module)
    return tuple(names)


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
