"""What ``plan()`` returns: the per-layer decisions as a list, with the costs and the table ``dptrain plan`` prints.

Costs are per sample (batch of one), in numbers stored: the ghost norm's two T x T Gram matrices (2T^2) and one
instantiated weight gradient (p*d), the two quantities the mixed-ghost-clipping and book-keeping papers tabulate.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from .algorithms import Grad, Norm

__all__ = ["Plan", "plan_report"]

_GRADIENT_WORDS = {Grad.BOOK_KEEPING: "book-keeping", Grad.WEIGHTED_SUM: "weighted sum",
                   Grad.SECOND_PASS: "2nd backward"}


def plan_report(decisions: Sequence, ghost_available: Sequence[bool]) -> dict:
    """Per-layer costs and choices, and the totals of ``dptrain plan --json``.

    Each total is what that mode does: ``ghost`` takes the ghost norm where a layer has one and instantiates the
    rest (biases-only layers, norms, position embeddings), ``instantiate`` instantiates everything, ``mixed`` takes
    each layer's cheaper primitive where it has a choice. ``mode_total`` is what the planned mode itself stores
    (its decision rule may be "time", not the space minimum). Layers without a rule: the per-sample fallback
    instantiates their per-sample gradients in every mode (``fallback``).
    """
    layers = [
        {"name": d.name, "type": d.type, "T": d.T, "p": d.p, "d": d.d, "ghost_cost": d.ghost_cost,
         "instantiate_cost": d.instantiate_cost, "choice": d.norm, "gradient": d.grad, "ghost_available": available,
         "fallback_cost": d.instantiate_cost if d.norm == Norm.FALLBACK else 0}
        for d, available in zip(decisions, ghost_available)
    ]
    totals = {
        "ghost": sum(d.ghost_cost if available else d.instantiate_cost
                     for d, available in zip(decisions, ghost_available)),
        "instantiate": sum(d.instantiate_cost for d in decisions),
        "mixed": sum(min(d.ghost_cost, d.instantiate_cost) if available else d.instantiate_cost
                     for d, available in zip(decisions, ghost_available)),
    }
    mode_total = sum(d.ghost_cost if d.norm == Norm.GHOST else d.instantiate_cost for d in decisions)
    fallback = {layer["name"]: layer["fallback_cost"] for layer in layers if layer["fallback_cost"]}
    return {"layers": layers, "totals": totals, "mode_total": mode_total,
            "fallback": {"layers": fallback, "per_sample": sum(fallback.values())}}


class Plan(list):
    """``plan()``'s answer: the :class:`~dptrain.core.planning.LayerDecision` of each trainable layer, in call order (a
    list, equal to the engine's ``last_decisions()`` after a step on inputs of these shapes), whose ``str()`` is the
    table ``dptrain plan`` prints. ``report()`` is that table as data (``dptrain plan --json``).

    ``ghost_available``: per layer, whether it has a ghost norm at all; ``parameters``: per layer, the names of the
    trainable parameters it covers; ``title``: what the table's first line names (the model and its input).
    """

    def __init__(self, decisions: Iterable, *, ghost_available: Sequence[bool], parameters: Sequence[Sequence[str]],
                 clipping_mode: str, decision_rule: str, title: str):
        super().__init__(decisions)
        if not len(ghost_available) == len(parameters) == len(self):
            raise ValueError(f"a plan of {len(self)} layers needs as many ghost_available and parameters entries, "
                             f"got {len(ghost_available)} and {len(parameters)}")
        self.ghost_available = list(ghost_available)
        self.parameters = [sorted(names) for names in parameters]
        self.clipping_mode, self.decision_rule, self.title = clipping_mode, decision_rule, title

    def report(self) -> dict:
        """``clipping_mode``, ``decision_rule`` and :func:`plan_report` (each layer with its ``parameters``)."""
        report = plan_report(self, self.ghost_available)
        for layer, names in zip(report["layers"], self.parameters):
            layer["parameters"] = names
        return {"clipping_mode": self.clipping_mode, "decision_rule": self.decision_rule, **report}

    def table(self, title: str | None = None, notes: Sequence[str] = ()) -> str:
        """The table, its first line naming ``title`` (default: :attr:`title`), then a line per note."""
        report, mode = self.report(), self.clipping_mode
        lines = [f"{title or self.title}, per sample; clipping mode {mode} (mixed modes decide by "
                 f"{self.decision_rule})"]
        lines += [f"note: {note}" for note in notes]
        rows = [("layer", "type", "T", "p", "d", "ghost 2T^2", "inst p*d", f"{mode} does")]
        for layer in report["layers"]:
            label = layer["name"] or ", ".join(layer["parameters"]) or "<root>"
            rows.append((label, layer["type"], f"{layer['T']:,}", f"{layer['p']:,}", f"{layer['d']:,}",
                         short(layer["ghost_cost"]), short(layer["instantiate_cost"]),
                         f"{layer['choice']} norm, {_GRADIENT_WORDS[layer['gradient']]}"
                         + ("" if layer["ghost_available"] else " (has no ghost norm)")))
        widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
        right = {2, 3, 4, 5, 6}  # the numbers
        for row in rows:
            lines.append("  ".join(cell.rjust(w) if k in right else cell.ljust(w)
                                   for k, (cell, w) in enumerate(zip(row, widths))).rstrip())
        totals = report["totals"]
        lines.append(f"totals: ghost mode {short(totals['ghost'])}, instantiation everywhere "
                     f"{short(totals['instantiate'])}, per-layer minimum (mixed) {short(totals['mixed'])}")
        ghost = sum(layer["choice"] == Norm.GHOST for layer in report["layers"])
        lines.append(f"{mode}: ghost norm on {ghost} of {len(report['layers'])} layers, "
                     f"{short(report['mode_total'])} per sample for the norms")
        fallback = report["fallback"]["layers"]
        if fallback:
            names = ", ".join(f"{name or '<root>'} {short(cost)}" for name, cost in list(fallback.items())[:8])
            more = f" and {len(fallback) - 8} more" if len(fallback) > 8 else ""
            lines.append(f"fallback: {len(fallback)} layer(s) have no rule ({names}{more}): the per-sample fallback "
                         "instantiates their per-sample gradients in every mode, "
                         f"{short(report['fallback']['per_sample'])} per sample (B times that for a batch of B)")
        lines.append("(per-sample and fast-grad-clip instantiate every layer; ghost and bk use the ghost norm wherever "
                     "a layer has one; the mix modes take the cheaper per layer)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def short(value: int) -> str:
    """Costs as the papers print them, 1728 or 5.04e9 (the exact values are in ``report()``)."""
    if value < 10_000:
        return str(value)
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"
