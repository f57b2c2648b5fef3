"""Clipping functions (per-sample factor C_i from the norm) and clipping styles (groups).

A style splits the trainable parameters into K groups; each sample's gradient is clipped
per group to R_k = R / sqrt(K), so the whole per-sample contribution still has norm <= R
and noise of standard deviation sigma * R keeps the same guarantee.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import _checks

CLIPPING_FNS = ("abadi", "automatic", "global")
"""The valid values of ``clipping_fn``: ``abadi`` ``min(1, R/||g||)``, ``automatic`` ``R/(||g|| + gamma)``,
``global`` ``1[||g|| <= R]``."""
CLIPPING_STYLES = ("all-layer", "layer-wise", "param-wise")
"""The named values of ``clipping_style`` (a list of lists of module names is the fourth kind)."""


def clipping_factors(norms: torch.Tensor, threshold: float, fn: str, gamma: float) -> torch.Tensor:
    """C_i for per-sample norms ||g_i||.

    abadi: min(1, R/||g_i||); automatic (Bu et al.): R / (||g_i|| + gamma);
    global (Bu et al.): 1 if ||g_i|| <= R else 0.
    """
    if fn == "abadi":
        return threshold / norms.clamp_min(threshold)
    if fn == "automatic":
        return threshold / (norms + gamma)
    if fn == "global":
        return (norms <= threshold).to(norms.dtype)
    raise _checks.unknown("clipping_fn", fn, CLIPPING_FNS)


def build_groups(
    style: str | Sequence[Sequence[str]], modules: Sequence[str], params: Sequence[tuple[str, str]]
) -> list[list[tuple[str, str]]]:
    """Partition of the (module name, parameter name) pairs into clipping groups.

    ``style`` is a style name or a list of lists of module names; in that case every
    module with trainable parameters must appear in exactly one group.
    """
    if isinstance(style, str):
        if style == "all-layer":
            return [list(params)]
        if style == "layer-wise":  # a layer whose only parameters are tied to an earlier one has no group
            return [g for g in ([p for p in params if p[0] == m] for m in modules) if g]
        if style == "param-wise":
            return [[p] for p in params]
        raise _checks.unknown("clipping_style", style, (*CLIPPING_STYLES, "or a list of lists of module names"))
    groups = [list(g) for g in style]
    if not groups or any(isinstance(g, str) or not g for g in groups):
        raise ValueError("clipping_style as groups must be a non-empty list of non-empty lists of module names")
    seen: dict[str, int] = {}
    for k, group in enumerate(groups):
        for name in group:
            if name not in modules:
                raise ValueError(
                    f"clipping group {k} names {name!r}, which is not a module with trainable parameters; "
                    f"valid names: {', '.join(modules)}"
                )
            if name in seen:
                raise ValueError(f"module {name!r} is in clipping groups {seen[name]} and {k}; each must be in one")
            seen[name] = k
    missing = [m for m in modules if m not in seen]
    if missing:
        raise ValueError(f"modules {missing} are in no clipping group; every trainable module must be in one")
    return [g for g in ([p for p in params if p[0] in set(group)] for group in groups) if g]


def group_threshold(max_grad_norm: float, num_groups: int) -> float:
    return max_grad_norm / math.sqrt(num_groups)
