"""The privacy budget: how many steps fit ``target_epsilon``, and what a step past it does."""
from __future__ import annotations

import math
import warnings

from . import accounting


class PrivacyBudgetExceeded(RuntimeError):
    """``budget="strict"``: the next step would spend more than ``target_epsilon``."""


class Budget:
    """Checks each step against ``target_epsilon``: warns once past it, or (``strict``) refuses the step.

    The noise was calibrated for ``planned_steps``; the steps that still fit the target are found once,
    by bisection over the accountant's epsilon, when training first runs past the plan.
    """

    def __init__(self, config):
        self.config = config
        self._limit: int | None = None
        self._warned = False

    def check(self, next_step: int) -> None:
        """Before step number ``next_step`` (1-based) is applied."""
        c = self.config
        if c.target_epsilon is None or next_step <= c.planned_steps:
            return
        if self._limit is None:
            self._limit = self._steps_within()
        if next_step <= self._limit:
            return
        message = (f"step {next_step} would spend epsilon = {self.epsilon_after(next_step):.4g} at delta = "
                   f"{c.target_delta:.3g}, past target_epsilon = {c.target_epsilon:g} (the noise was calibrated "
                   f"for {c.planned_steps} steps; at most {self._limit} fit the target)")
        if c.budget == "strict":
            raise PrivacyBudgetExceeded(message + ": nothing was applied (budget='strict')")
        if not self._warned:
            self._warned = True
            warnings.warn(message + "; training goes on (budget='strict' refuses such steps)", stacklevel=5)

    def epsilon_after(self, steps: int) -> float:
        c = self.config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if c.mechanism is not None:  # correlated noise: its own event (the truncation term as DP-SGD's)
                    delta = accounting.poisson_delta(c.target_delta, c.sample_size, c.inclusion_rate,
                                                     c.max_batch_size, steps)
                    return c.mechanism.epsilon(c.noise_multiplier, c.sample_rate, steps, delta, c.accountant)
                return accounting.compute_epsilon(c.noise_multiplier, c.sample_rate, steps, c.target_delta,
                                                  accountant=c.accountant, sample_size=c.sample_size,
                                                  max_batch_size=c.max_batch_size)
            except ValueError:  # truncation alone uses up target_delta by then
                return math.inf

    def _steps_within(self) -> int:
        """The largest number of steps whose epsilon stays within ``target_epsilon`` (at least the plan)."""
        target = self.config.target_epsilon
        low, high = self.config.planned_steps, self.config.planned_steps + 1
        while self.epsilon_after(high) <= target:
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            if self.epsilon_after(mid) <= target:
                low = mid
            else:
                high = mid
        return low
