"""``fix(model)``: swap the modules private training cannot use for ones it can.

- ``BatchNorm1d/2d/3d`` (and ``SyncBatchNorm``) become ``GroupNorm(gcd(num_groups, C), C)``
  with the same ``eps`` and the affine weight and bias carried over. BatchNorm normalises
  with statistics of the whole batch, so one sample changes every other sample's output
  and per-sample gradients stop being per-sample. GroupNorm normalises each sample on its
  own: it is a *different function*, so a network pretrained with BatchNorm needs
  fine-tuning after the swap (the running statistics are dropped).
  A GroupNorm never gets one value per group (its output would be its bias, whatever the
  input): where its first input has one value per channel (``[N, C]``, or ``[N, C, 1, 1]``
  after global pooling, as in squeeze-excite blocks and heads) it takes one group,
  ``GroupNorm(1, C)``, a norm over all channels. The spatial size is only known at the call,
  so a forward pre-hook of the new GroupNorm decides at its first call (and refuses a later
  call that would leave one value per group).
  A BatchNorm with a fused activation (timm's ``BatchNormAct2d`` / ``SyncBatchNormAct``:
  norm, then its ``drop`` and ``act`` submodules) becomes ``nn.Sequential(norm=GroupNorm,
  drop=..., act=...)``: the activation (and a drop layer) stays, the same module objects. A
  BatchNorm subclass that overrides ``forward`` in any other way is left as it is, since a swap
  could drop what it adds (``validate`` still reports it).
- ``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and ``nn.MultiheadAttention`` become
  ``dptrain.nn.DPRNN``/``DPLSTM``/``DPGRU``/``DPMultiheadAttention`` with the same options
  and weights: the same function, built from ``nn.Linear`` layers the engine clips exactly.
  Only these exact classes are swapped: a subclass may override ``forward``, which a swap
  would silently drop (``validate`` still reports it).

Trainable/frozen flags, train/eval mode, device and dtype are carried over. Hooks
registered on a swapped module are not. In-place activations (``ReLU(inplace=True)``,
``out += identity``) need no change: the engine keeps each covered layer's input before
any later in-place operation can touch it and gets each output's gradient from the value
the layer produced, which the torchvision tests check.

``validate(model)`` (``dptrain.models.validation``) lists what stops private training without
changing anything; ``planned_fixes(model)`` lists what ``fix`` would change.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .. import _checks
from ..nn import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention

__all__ = ["fix", "planned_fixes"]

DEFAULT_NUM_GROUPS = 32


def fix(model: nn.Module, *, inplace: bool = False, num_groups: int = DEFAULT_NUM_GROUPS) -> nn.Module:
    """A copy of ``model`` (or ``model`` itself with ``inplace=True``) with the swaps above done.

    Always use the returned module: when ``model`` itself is swapped (e.g. ``fix(nn.LSTM(...))``)
    it is a new object even with ``inplace=True``. ``num_groups`` is the largest GroupNorm
    group count; a layer with ``C`` channels gets ``gcd(num_groups, C)`` groups (32 groups
    for 64 channels, one group, i.e. LayerNorm over ``C, H, W``, when ``C`` is odd).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fix() needs an nn.Module, got {type(model).__name__}")
    num_groups = _checks.positive_int("num_groups", num_groups)
    for name, module in model.named_modules():  # before deepcopy, which fails on them with a vaguer error
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():  # type: ignore[misc]  # (torch's stub: self as a protocol)
            raise ValueError(f"{name or '<root>'} ({type(module).__name__}) has not seen an input yet, so its size is "
                             "unknown: run one forward pass before dptrain.fix")
    target = model if inplace else copy.deepcopy(model)
    root = _replacement(target, num_groups)
    if root is not None:
        return root
    _swap_children(target, num_groups, replaced={}, visited=set())
    return target


def planned_fixes(model: nn.Module, *, num_groups: int = DEFAULT_NUM_GROUPS) -> list[str]:
    """What ``fix(model)`` would change, one sentence per module, without changing anything."""
    plans = []
    for name, module in model.named_modules():
        label = name or "<root>"
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and swappable_batch_norm(module):
            C = module.num_features
            groups = math.gcd(num_groups, C)
            norm = f"GroupNorm({groups}, {C})"
            kept = _kept_children(module)
            if kept:
                target = "Sequential(" + ", ".join([norm] + [f"{k}={_describe(m)}" for k, m in kept.items()]) + ")"
                keeps = f"; keeps its {' and '.join(kept)}"
            else:
                target, keeps = norm, ""
            lazy = (f" (GroupNorm(1, {C}), a norm over all channels, if its first input has one value per channel, "
                    "as [N, C] or [N, C, 1, 1] after global pooling: decided at the first forward, so that no group "
                    "holds a single value)") if _needs_lazy_groups(C, groups) else ""
            plans.append(
                f"{label}: {type(module).__name__}({C}) -> {target}{lazy}{keeps}; a different normalisation "
                "(per sample instead of per batch): fine-tune after the swap"
            )
        elif type(module) in _DP_VERSIONS:
            plans.append(
                f"{label}: {type(module).__name__} -> dptrain.nn.{_DP_VERSIONS[type(module)].__name__}, "
                "same function and weights"
            )
    return plans


def _swap_children(module: nn.Module, num_groups: int, replaced: dict[int, nn.Module], visited: set[int]) -> None:
    visited.add(id(module))
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if id(child) in replaced:  # a module registered twice stays shared after the swap
            setattr(module, name, replaced[id(child)])
            continue
        new = _replacement(child, num_groups)
        if new is not None:
            replaced[id(child)] = new
            setattr(module, name, new)
        elif id(child) not in visited:
            _swap_children(child, num_groups, replaced, visited)


def _replacement(module: nn.Module, num_groups: int) -> nn.Module | None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if not swappable_batch_norm(module):
            return None
        norm = _group_norm_for(module, num_groups)
        kept = _kept_children(module)
        if not kept:
            return norm
        return nn.Sequential(OrderedDict([("norm", norm), *kept.items()])).train(module.training)
    dp_class = _DP_VERSIONS.get(type(module))
    if dp_class is None:
        return None
    new = dp_class(**_constructor_args(module), **_factory_args(module))
    new.load_state_dict(module.state_dict())
    for torch_name, p in module.named_parameters(recurse=True):
        for own in _own_params(new, torch_name):
            own.requires_grad_(p.requires_grad)
    return new.train(module.training)


# BatchNorm forwards that normalise and nothing else (subclasses that keep them are swapped as they are)
_PLAIN_BATCH_NORM_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}
# forwards that normalise, then apply the module's ``drop`` and ``act`` submodules in this order (timm's norm_act)
_NORM_THEN_CHILDREN_FORWARDS = {("timm.layers.norm_act", "BatchNormAct2d.forward"),
                                ("timm.layers.norm_act", "SyncBatchNormAct.forward")}


def _norm_then_children(module: nn.Module) -> bool:
    forward = type(module).forward
    return (getattr(forward, "__module__", None), getattr(forward, "__qualname__", None)) in _NORM_THEN_CHILDREN_FORWARDS


def swappable_batch_norm(module: nn.Module) -> bool:
    """A BatchNorm whose forward is known: a plain one, or timm's norm + drop + act."""
    return type(module).forward in _PLAIN_BATCH_NORM_FORWARDS or _norm_then_children(module)


def _kept_children(module: nn.Module) -> dict[str, nn.Module]:
    """What a BatchNorm applies after normalising, kept by the swap: timm's ``drop`` and ``act``
    (an ``nn.Identity`` does nothing, so none is kept)."""
    if not _norm_then_children(module):
        return {}
    return {name: child for name in ("drop", "act")
            if (child := getattr(module, name, None)) is not None and not isinstance(child, nn.Identity)}


def _describe(module: nn.Module) -> str:
    text = repr(module)
    return text if "\n" not in text and len(text) <= 60 else type(module).__name__


def _needs_lazy_groups(C: int, groups: int) -> bool:
    """Whether the group count must wait for the input: more than one group (one group over C >= 2
    channels always holds more than one value), or a single channel."""
    return groups > 1 or C == 1


class _GroupsAtFirstCall:
    """Forward pre-hook of a GroupNorm made by ``fix``: at its first call, one group if the input has
    one value per channel (``[N, C]``, ``[N, C, 1, 1]``), else the group count it was built with.
    The decision stays (the GroupNorm's rule reads ``num_groups`` in the backward); a later call whose
    groups would hold one value each, whose output would be the bias whatever the input, is refused."""

    def __init__(self, groups: int):
        self.groups = groups
        self.decided = False

    def __call__(self, module: nn.GroupNorm, inputs):
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None  # GroupNorm's own forward says what is wrong
        per_channel = math.prod(x.shape[2:])
        if not self.decided:
            module.num_groups = 1 if per_channel == 1 else self.groups
            self.decided = True
        if module.num_channels // module.num_groups * per_channel < 2:
            raise ValueError(
                f"this GroupNorm({module.num_groups}, {module.num_channels}), which dptrain.fix made from a "
                f"BatchNorm, got an input of shape {tuple(x.shape)}: each group would hold one value, so its output "
                "would be its bias whatever the input. A single value has no per-sample normalisation: remove this "
                "norm, or replace the BatchNorm by hand with a per-sample norm that suits its input"
            )
        return None


def _group_norm_for(bn: nn.modules.batchnorm._BatchNorm, num_groups: int) -> nn.GroupNorm:
    C = bn.num_features
    groups = math.gcd(num_groups, C)
    gn = nn.GroupNorm(groups, C, eps=bn.eps, affine=bn.affine, **_factory_args(bn))
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    if _needs_lazy_groups(C, groups):
        gn.register_forward_pre_hook(_GroupsAtFirstCall(groups))
    return gn.train(bn.training)


def _factory_args(module: nn.Module) -> dict:
    tensor: torch.Tensor | None = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return {} if tensor is None else {"device": tensor.device, "dtype": tensor.dtype}


def _constructor_args(module: nn.Module) -> dict:
    if isinstance(module, nn.MultiheadAttention):
        return dict(embed_dim=module.embed_dim, num_heads=module.num_heads, dropout=module.dropout,
                    bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                    add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
                    batch_first=module.batch_first)
    args: dict[str, Any] = dict(input_size=module.input_size, hidden_size=module.hidden_size, num_layers=module.num_layers,
                bias=module.bias, batch_first=module.batch_first, dropout=module.dropout,
                bidirectional=module.bidirectional)
    if isinstance(module, nn.LSTM):
        args["proj_size"] = module.proj_size
    if type(module) is nn.RNN:
        args["nonlinearity"] = module.nonlinearity
    return args


def _own_params(new: nn.Module, torch_name: str) -> list[nn.Parameter]:
    """The DP module's parameters holding (part of) the torch parameter ``torch_name``."""
    if isinstance(new, DPMultiheadAttention):
        packed = {"in_proj_weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                  "in_proj_bias": ("q_proj.bias", "k_proj.bias", "v_proj.bias"),
                  "q_proj_weight": ("q_proj.weight",), "k_proj_weight": ("k_proj.weight",),
                  "v_proj_weight": ("v_proj.weight",), "bias_k": ("bias_k_token.weight",),
                  "bias_v": ("bias_v_token.weight",)}
        return [new.get_parameter(n) for n in packed.get(torch_name, (torch_name,))]
    return [getattr(new, torch_name)]  # the recurrent modules answer to torch's names


_DP_VERSIONS: dict[type[nn.Module], type[nn.Module]] = {
    nn.RNN: DPRNN,
    nn.LSTM: DPLSTM,
    nn.GRU: DPGRU,
    nn.MultiheadAttention: DPMultiheadAttention,
}
