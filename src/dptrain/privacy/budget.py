"""The privacy budget: how many steps fit ``target_epsilon``, and what a step past it does.

The budget reads the ledger (the steps actually applied, ``ledger.Ledger``), not the plan: after a resume
whose checkpoint ran with other values than this engine's, the steps that fit are those whose composition
with the checkpoint's stays within the target.
"""
from __future__ import annotations

import math
import warnings

from .. import accounting
from .ledger import Ledger, Segment, planned_segment


class PrivacyBudgetExceeded(RuntimeError):
    """``budget="strict"``: the next step would spend more than ``target_epsilon``."""


def describe(segments: list[Segment], most: int = 3) -> str:
    text = "; ".join(s.describe() for s in segments[:most])
    return text + (f"; ... ({len(segments) - most} more)" if len(segments) > most else "")


class Budget:
    """Checks each step against ``target_epsilon``: warns once past it, or (``strict``) refuses the step.

    Within the plan of a run whose every step had this configuration's values, calibration guarantees the
    target and nothing is computed. Otherwise the number of steps that fit is found once (per history: a
    loaded checkpoint finds it again), by bisection over the ledger's epsilon.
    """

    def __init__(self, config, ledger: Ledger):
        self.config = config
        self.ledger = ledger
        self._limit: tuple[int, int] | None = None  # (ledger generation, steps that fit)
        self._warned = False

    def check(self) -> None:
        """Before the next step (at this configuration's values) is applied."""
        c, ledger = self.config, self.ledger
        if c.target_epsilon is None:
            return
        next_step = ledger.steps + 1
        if next_step <= c.planned_steps and ledger.only_planned(c):
            return
        limit = self.limit()
        if next_step <= limit:
            return
        if ledger.only_planned(c):
            why = f"the noise was calibrated for {c.planned_steps} steps"
        else:
            why = (f"the noise was calibrated for {c.planned_steps} steps from scratch, but the run so far holds "
                   f"{describe(ledger.segments)}")
        message = (f"step {next_step} would spend epsilon = {self.epsilon_after(next_step):.4g} at delta = "
                   f"{c.target_delta:.3g}, past target_epsilon = {c.target_epsilon:g} ({why}; at most {limit} fit "
                   "the target)")
        if c.budget == "strict":
            raise PrivacyBudgetExceeded(message + ": nothing was applied (budget='strict')")
        if not self._warned:
            self._warned = True
            warnings.warn(message + "; training goes on (budget='strict' refuses such steps)", stacklevel=5)

    def epsilon_after(self, steps: int) -> float:
        """Epsilon at ``target_delta`` once the run has ``steps`` steps: the ledger's, then this engine's."""
        c = self.config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if c.mechanism is not None:  # correlated noise: its own event over the run (one sigma and q)
                    delta = accounting.poisson_delta(c.target_delta, c.sample_size, c.inclusion_rate,
                                                     c.max_batch_size, steps)
                    return c.mechanism.epsilon(c.noise_multiplier, c.sample_rate, steps, delta, c.accountant)
                return self.ledger.epsilon(c.target_delta, c, max(0, steps - self.ledger.steps))
            except ValueError:  # truncation alone uses up target_delta by then
                return math.inf

    def limit(self) -> int:
        """The most steps in all (the ledger's included) whose epsilon stays within ``target_epsilon``."""
        generation = self.ledger.generation
        if self._limit is None or self._limit[0] != generation:
            self._limit = (generation, self._steps_within())
        return self._limit[1]

    def _steps_within(self) -> int:
        c, ledger = self.config, self.ledger
        target, base = c.target_epsilon, ledger.steps
        # a number of steps known to fit (calibration's), or the steps taken (if even those do not fit, no more do)
        low = max(base, c.planned_steps) if ledger.only_planned(c) else base
        high = low + max(1, low - base)
        while self.epsilon_after(high) <= target:
            low, high = high, high + 2 * (high - base)
        while high - low > 1:
            mid = (low + high) // 2
            if self.epsilon_after(mid) <= target:
                low = mid
            else:
                high = mid
        return low

    # ------------------------------------------------------------------ resuming
    def resume_note(self) -> str | None:
        """What a loaded checkpoint means for this run, when its steps ran with other values than this engine's."""
        c, ledger = self.config, self.ledger
        segments = ledger.segments
        if not segments or ledger.only_planned(c):
            return None
        last, mine = segments[-1], planned_segment(c)
        names = ("noise_multiplier", "sample_rate", "sample_size", "max_batch_size")
        changed = [f"{name} {getattr(last, name):.6g} -> {getattr(mine, name):.6g}"
                   if isinstance(getattr(mine, name), float) else f"{name} {getattr(last, name)} -> {getattr(mine, name)}"
                   for name in names if getattr(last, name) != getattr(mine, name)]
        note = (f"the checkpoint's steps ran with other values than this engine's ({', '.join(changed)}): the "
                f"accountant composes the steps as they ran ({describe(segments)}), then this engine's")
        if last.sample_size != mine.sample_size:
            note += (f". The dataset size changed from {last.sample_size} to {mine.sample_size}: the checkpoint's "
                     f"steps stay accounted at their q = {last.sample_rate:.4g}, the next ones at q = batch_size / "
                     f"sample_size = {mine.sample_rate:.4g}")
        if c.target_epsilon is None:
            return note
        limit, planned = self.limit(), c.planned_steps
        note += (f". epsilon so far: {self.epsilon_after(ledger.steps):.4g} at delta = {c.target_delta:.3g}")
        if limit >= planned:
            return note + f"; the planned {planned} steps fit target_epsilon = {c.target_epsilon:g} (up to {limit})"
        note += (f"; with target_epsilon = {c.target_epsilon:g} at most {limit} steps in all fit "
                 f"({max(0, limit - ledger.steps)} more), not the planned {planned}")
        remaining = planned - ledger.steps
        if remaining > 0:
            sigma = self._noise_for_remaining(remaining)
            if sigma is not None:
                note += (f": for the planned length build the engine with noise_multiplier={sigma:.4g} (calibrated for "
                         f"the {remaining} steps after the checkpoint's {ledger.steps}), or a larger target_epsilon")
        return note + (". budget='strict' refuses the steps past the target" if c.budget == "strict"
                       else ". Past the target training goes on with a warning (budget='strict' refuses)")

    def _noise_for_remaining(self, remaining: int) -> float | None:
        c, ledger = self.config, self.ledger
        delta = c.target_delta - ledger.truncation_delta()
        if not delta > 0.0:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return accounting.calibrate_noise_multiplier(
                    c.target_epsilon, delta, c.sample_rate, remaining, accountant=ledger.accountant.name,
                    sample_size=c.sample_size, max_batch_size=c.max_batch_size, history=ledger.accountant.history)
            except ValueError:  # the checkpoint's steps alone spend the target
                return None
