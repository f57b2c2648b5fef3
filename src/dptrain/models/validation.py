"""Checks that a model can be trained privately, exactly: every trainable parameter is covered."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers import fallback_refusal, resolve_rule
from ..layers.registry import covering_base, layer_params


@dataclass(frozen=True)
class _Problem:
    """One module's problem: where it is, the module's kind (its class, or None) and what is wrong, said the same way
    for every module with the same problem, so that those can be listed once."""

    where: str  # "the submodule 'layer1.0.bn1'", "encoder.proj", "<root>"
    path: str  # as named_modules() gives it ('' for the model itself)
    kind: str | None
    sentence: str

    def line(self) -> str:
        return f"{self.where} ({self.kind}) {self.sentence}" if self.kind else f"{self.where}: {self.sentence}"


def find_problems(model: nn.Module, allow_fallback: bool = True) -> list[str]:
    """Every reason the engine would refuse ``model``, as readable sentences (empty if none), one per module.

    ``allow_fallback``: as the engine's option of that name (modules without a rule may use the
    generic per-sample fallback)."""
    return [problem.line() for problem in _find_problems(model, allow_fallback)]


def _find_problems(model: nn.Module, allow_fallback: bool) -> list[_Problem]:
    problems: list[_Problem] = []
    covered = layer_params(model)  # own parameters, and descendants' ones a rule claims
    for name, module in model.named_modules():
        label = name or "<root>"
        kind = type(module).__name__
        params = covered.get(module, {})
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            problems.append(_Problem(
                label, name, f"{kind}(track_running_stats=True)",
                "averages statistics over the batch into buffers used at evaluation, which leaks data outside the "
                "private gradient: set track_running_stats=False"))
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and params:
            where = f"the submodule {name!r}" if name else "the model itself"  # its path, as named_modules() gives it
            from .fixer import swappable_batch_norm  # fixer imports this package's neighbours

            fixes = ("replace it with nn.GroupNorm, or train dptrain.fix(model), a copy in which every BatchNorm is "
                     "a GroupNorm" if swappable_batch_norm(module) else
                     f"replace it with a per-sample norm (nn.GroupNorm); dptrain.fix leaves it, as "
                     f"{kind} overrides forward and a swap could drop what it adds")
            problems.append(_Problem(
                where, name, kind,
                f"normalises with statistics of the whole batch, which mixes samples and breaks per-sample clipping: "
                f"{fixes}"))
            continue
        if not params:
            continue
        rule = resolve_rule(module, allow_fallback)
        base = covering_base(module) if rule is None else None
        if base is not None:
            problems.append(_Problem(
                label, name, kind,
                f"subclasses {base.__name__} but overrides forward, so the {base.__name__} rule may not match what it "
                f"computes: register a rule for {kind} with dptrain.register_layer, freeze its parameters, or leave "
                "allow_fallback=True (the per-sample fallback replays its calls with torch.func)"))
            continue
        if rule is None:
            refusal = fallback_refusal(module)
            fixes = "freeze them (requires_grad_(False)) or register a rule with dptrain.register_layer"
            if refusal is None:  # only because the fallback is off
                why = "and allow_fallback=False"
                fixes += ", or leave allow_fallback=True (the per-sample fallback replays its calls with torch.func)"
            else:
                why = f"and the per-sample fallback cannot ({refusal})"
            problems.append(_Problem(
                label, name, kind,
                f"has trainable parameters {sorted(params)} but no layer rule computes its per-sample gradients "
                f"{why}: {fixes}"))
            continue
        unknown = sorted(set(params) - set(rule.param_names))
        if unknown:
            problems.append(_Problem(
                label, name, kind,
                f"has trainable parameters {unknown} that its rule {type(rule).__name__} does not cover: freeze them "
                "or register a rule for this class"))
            continue
        try:
            rule.validate(module)
        except ValueError as err:
            problems.append(_Problem(label, name, None, str(err)))
    return problems


#: how many module paths a line of grouped problems names
GROUPED_PATHS = 3


def grouped_problems(model: nn.Module, allow_fallback: bool = True) -> list[str]:
    """``find_problems``, with the modules that have the same problem (a ResNet's twenty BatchNorms) on one line:
    their kind, their count and the first few of their paths."""
    groups: dict[tuple, list[_Problem]] = {}
    for problem in _find_problems(model, allow_fallback):
        groups.setdefault((problem.kind, problem.sentence), []).append(problem)
    lines = []
    for (kind, sentence), same in groups.items():
        if len(same) == 1:
            lines.append(same[0].line())
            continue
        paths = ", ".join(repr(p.path) if p.path else "the model itself" for p in same[:GROUPED_PATHS])
        more = f" and {len(same) - GROUPED_PATHS} more" if len(same) > GROUPED_PATHS else ""
        lines.append(f"{len(same)} {kind} modules ({paths}{more}): each {sentence}" if kind else
                     f"{len(same)} modules ({paths}{more}): {sentence}")
    return lines


def validate(model: nn.Module, allow_fallback: bool = True) -> None:
    """Raise ``ValueError`` listing every problem that stops private training of ``model`` (modules with the same
    problem on one line)."""
    problems = grouped_problems(model, allow_fallback)
    if problems:
        raise ValueError("this model cannot be trained privately as it is:\n- " + "\n- ".join(problems))


def frozen_batchnorm_checks(model: nn.Module):
    """A frozen BatchNorm is fine in eval mode, but in train mode it mixes samples in the forward."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            where = f"the submodule {name!r}" if name else "the model itself"

            def check(mod, inputs, _where=where):
                if mod.training and torch.is_grad_enabled():
                    raise RuntimeError(
                        f"{_where} ({type(mod).__name__}) is frozen but in training mode: it normalises with "
                        "statistics of the whole batch, which mixes samples. Call .eval() on it (its running "
                        "statistics are then used), or train dptrain.fix(model), a copy in which every BatchNorm "
                        "is a GroupNorm"
                    )
            found.append((module, check))
    return found
