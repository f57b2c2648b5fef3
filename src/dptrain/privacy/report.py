"""``engine.privacy_report()``: what the steps taken spent, a dict for programs that reads as sentences for people."""
from __future__ import annotations

import dataclasses
from typing import Any

from .. import accounting
from .ledger import Ledger

__all__ = ["PrivacyReport"]


class PrivacyReport(dict):
    """The engine's privacy report: a ``dict`` (``report["epsilon"]``, ``json.dumps(report)``, ``dict(report)``)
    whose ``str()`` says what it means::

        epsilon = 2.98 at delta = 1e-05 after 90 of 90 planned steps (target 3, pld accountant)
          noise multiplier 2.589, sample rate 0.1781, max grad norm 1, per example

    Keys: ``epsilon`` (spent by the steps taken, at ``delta``), ``delta``, ``steps``, ``planned_steps`` (the length
    the noise was calibrated for; None with a given noise multiplier), ``target_epsilon``, ``noise_multiplier``,
    ``sample_rate`` (q), ``accountant``, ``max_grad_norm``, ``clipping_mode``, ``privacy_unit``, ``max_batch_size``
    and ``truncation_delta`` (fixed-shape batches), ``history`` (the steps as they ran, one segment per set of
    values), ``noise``, ``cyclic_groups`` and ``strategy`` (correlated noise). A training-framework integration may
    add ``sampling``, ``epsilon_is_proven_bound`` and ``note``, which the text shows too. Saving it with
    ``torch.save`` for a ``weights_only`` load: save ``dict(report)``.
    """

    @classmethod
    def of_run(cls, config: Any, ledger: Ledger, accountant: str, steps: int, epsilon: float,
               delta: float) -> PrivacyReport:
        """The report of a run: the values of its configuration (``config``, the engine's ``EngineConfig``), the steps
        as the ledger recorded them and ``epsilon``, what they spent at ``delta``."""
        mechanism = config.mechanism
        if mechanism is None:  # the truncation term of the steps as they ran
            truncation = ledger.truncation_delta()
        else:  # correlated noise: one mechanism over the run
            truncation = 0.0 if config.max_batch_size is None else accounting.truncation_delta(
                config.sample_size, config.inclusion_rate, config.max_batch_size, steps)
        return cls({
            "noise_multiplier": config.noise_multiplier,
            "sample_rate": config.sample_rate,
            "steps": steps,
            "planned_steps": config.planned_steps,
            "epsilon": epsilon,
            "target_epsilon": config.target_epsilon,
            "delta": delta,
            "accountant": accountant,
            "max_grad_norm": config.max_grad_norm,
            "clipping_mode": config.clipping_mode,
            "privacy_unit": config.privacy_unit,
            "max_batch_size": config.max_batch_size,
            "truncation_delta": truncation,
            "history": [dataclasses.asdict(segment) for segment in ledger.segments],
            "noise": config.noise,
            "cyclic_groups": config.cyclic_groups,
            "strategy": None if mechanism is None else mechanism.strategy.as_dict(),
        })

    def __str__(self) -> str:
        planned = self.get("planned_steps")
        steps = self["steps"]
        length = f"{steps} of {planned} planned steps" if planned is not None else f"{steps} steps"
        target = self.get("target_epsilon")
        aim = f"target {target:g}, " if target is not None else ""
        lines = [f"epsilon = {self['epsilon']:.3g} at delta = {self['delta']:.3g} after {length} "
                 f"({aim}{self['accountant']} accountant)"]
        unit = "per user" if self.get("privacy_unit") == "user" else "per example"
        lines.append(f"  noise multiplier {self['noise_multiplier']:.4g}, sample rate {self['sample_rate']:.4g}, "
                     f"max grad norm {self['max_grad_norm']:g}, {unit}")
        if planned is not None and steps > planned:
            lines.append(f"  past the plan by {steps - planned} steps: epsilon is above what the noise was "
                         "calibrated for")
        if self.get("noise", "gaussian") != "gaussian":
            lines.append(f"  correlated noise: {self['noise']}, cyclic Poisson sampling over {self['cyclic_groups']} "
                         "group(s)")
        if self.get("max_batch_size") is not None:
            lines.append(f"  fixed-shape batches of {self['max_batch_size']} rows: truncation takes "
                         f"{self['truncation_delta']:.3g} of delta")
        if len(self.get("history") or ()) > 1:
            lines.append(f"  the steps ran with {len(self['history'])} sets of values (a resumed run): see "
                         "report['history']")
        if "sampling" in self:
            lines.append(f"  sampling: {self['sampling']}")
        if self.get("epsilon_is_proven_bound") is False:
            lines.append("  epsilon is NOT a proven bound for this sampling")
        if "note" in self:
            lines.append(f"  note: {self['note']}")
        return "\n".join(lines)
