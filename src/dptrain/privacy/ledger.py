"""What a run has spent: every private step, with the values it was applied with.

The accountant composes ``(noise_multiplier, sample_rate)`` events. A fixed-shape run also pays a truncation
term per step, which depends on the dataset size and K (``accounting.truncation_delta``). The ledger keeps
the steps as *segments* of equal values and feeds the accountant as it records them, so epsilon, the
truncation term and the budget are those of the steps actually applied: a run resumed by an engine built
with other values (a noise multiplier calibrated for a longer plan, another batch or dataset size, another
K) goes on with the new values, and the checkpoint's steps keep theirs.

The privacy unit is the ledger's, not a segment's: example-level and user-level guarantees do not compose
into either one (removing one example changes its user's clipped gradient by up to 2R), so a checkpoint of
the other unit is refused.
"""
from __future__ import annotations

import copy
from dataclasses import astuple, dataclass, replace

from .. import _checks, accounting


@dataclass(frozen=True)
class Segment:
    """``steps`` consecutive steps applied with the same values."""

    noise_multiplier: float
    sample_rate: float
    sample_size: int
    max_batch_size: int | None
    steps: int

    def values(self) -> tuple:
        return astuple(self)[:-1]

    def truncation_delta(self) -> float:
        if self.max_batch_size is None or self.steps == 0:
            return 0.0
        return accounting.truncation_delta(self.sample_size, self.sample_rate, self.max_batch_size, self.steps)

    def describe(self) -> str:
        fixed = f", max_batch_size={self.max_batch_size}" if self.max_batch_size is not None else ""
        return (f"{self.steps} step{'s' if self.steps != 1 else ''} at noise_multiplier={self.noise_multiplier:.4g}, "
                f"q={self.sample_rate:.4g} (sample_size={self.sample_size}{fixed})")


def planned_segment(config, steps: int = 0) -> Segment:
    """The values this engine applies its steps with."""
    return Segment(config.noise_multiplier, config.sample_rate, config.sample_size, config.max_batch_size, steps)


class Ledger:
    """The steps applied so far (``segments``), in the accountant as they are recorded.

    ``generation`` changes whenever a checkpoint replaces the history, so that what was derived from it
    (the budget's limit) is derived again.
    """

    def __init__(self, config, accountant: accounting.Accountant):
        self.privacy_unit = config.privacy_unit
        self.accountant = accountant
        self.generation = 0
        self._segments: list[Segment] = []

    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self._segments)

    def record(self, config) -> None:
        """One step applied with the configuration's values."""
        self.accountant.step(config.noise_multiplier, config.sample_rate)
        step = planned_segment(config, 1)
        last = self._segments[-1] if self._segments else None
        if last is not None and last.values() == step.values():
            self._segments[-1] = replace(last, steps=last.steps + 1)
        else:
            self._segments.append(step)

    def only_planned(self, config) -> bool:
        """Every step so far ran with this configuration's values (a fresh run, or an identical resume)."""
        values = planned_segment(config).values()
        return all(s.values() == values for s in self._segments)

    def with_planned(self, config, extra: int) -> list[Segment]:
        """The segments, then ``extra`` more steps at the configuration's values."""
        return self.segments + ([planned_segment(config, extra)] if extra > 0 else [])

    # ------------------------------------------------------------------ epsilon
    def truncation_delta(self, config=None, extra: int = 0) -> float:
        """The delta that truncating fixed-shape batches added (union bound over every step; 0 without K)."""
        return min(1.0, sum(s.truncation_delta() for s in self.with_planned(config, extra)))

    def epsilon(self, delta: float, config=None, extra: int = 0) -> float:
        """Epsilon at ``delta`` of the steps applied, then ``extra`` more at the configuration's values.

        The accountant's epsilon at what truncation leaves of ``delta``; ValueError when truncation alone
        spends all of it.
        """
        segments = self.with_planned(config, extra)
        truncation = min(1.0, sum(s.truncation_delta() for s in segments))
        left = delta - truncation
        if not left > 0.0:
            raise ValueError(
                f"the truncation of fixed-shape batches (max_batch_size) spends {truncation:.3g} of delta={delta:.3g} "
                f"over the {sum(s.steps for s in segments)} steps, so no epsilon holds at this delta: use a larger "
                "delta, or a larger max_batch_size (accounting.default_max_batch_size)"
            )
        if extra == 0:
            return self.accountant.get_epsilon(left)
        history = self.accountant.history
        if history and history[-1][:2] == (config.noise_multiplier, config.sample_rate):
            history[-1] = (*history[-1][:2], history[-1][2] + extra)  # one event, as calibration composed it
        else:
            history.append((config.noise_multiplier, config.sample_rate, extra))
        return accounting.epsilon_of_history(history, left, self.accountant.name)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"privacy_unit": self.privacy_unit, "segments": [list(astuple(s)) for s in self._segments]}

    def load_state_dict(self, engine_state: dict, config) -> str | None:
        """Replace the history with a checkpoint's (``engine_state``: ``PrivacyEngine.state_dict()``).

        Checks everything before changing anything. Returns a note for a checkpoint written before the
        ledger existed, whose steps are taken with this engine's sample size, K and privacy unit. A run with
        correlated noise (``config.mechanism``) resumes only with the values its steps ran with: its mechanism
        is analysed for one noise multiplier and sample rate over the whole run.
        """
        probe = copy.deepcopy(self.accountant)  # (of this engine's kind: a correlated run's refuses DP-SGD's state)
        probe.load_state_dict(engine_state["accountant"])  # refuses another accountant's state
        saved = engine_state.get("ledger")
        note = None
        if saved is None:
            segments = [Segment(sigma, q, config.sample_size, config.max_batch_size, count)
                        for sigma, q, count in probe.history]
            if segments:
                note = (f"this checkpoint was written by an older dptrain that did not record the sample size, "
                        f"max_batch_size and privacy unit of its steps: its {probe.steps} steps are taken as this "
                        f"engine's (sample_size={config.sample_size}, max_batch_size={config.max_batch_size}, "
                        f"privacy_unit={config.privacy_unit!r}). A checkpoint saved from now on records them")
        else:
            segments = self._parse(saved, config)
            merged: list[list] = []
            for s in segments:
                if merged and merged[-1][:2] == [s.noise_multiplier, s.sample_rate]:
                    merged[-1][2] += s.steps
                elif s.steps:
                    merged.append([s.noise_multiplier, s.sample_rate, s.steps])
            if [tuple(m) for m in merged] != probe.history:
                raise ValueError(
                    "not a consistent dptrain engine state: its ledger's steps "
                    f"{[(m[0], m[1], m[2]) for m in merged][:3]} differ from its accountant's history "
                    f"{probe.history[:3]}; load the state dict exactly as engine.state_dict() returned it"
                )
        values = planned_segment(config).values()
        changed = [s for s in segments if s.steps and s.values() != values]
        if getattr(config, "mechanism", None) is not None and changed:
            raise ValueError(
                f"this checkpoint of a {config.noise} run holds {changed[0].describe()}, but this engine runs "
                f"{planned_segment(config).describe().split(' at ', 1)[1]}: the correlated mechanism is analysed for "
                "one noise multiplier and sample rate over the whole run. Build the engine with the values the "
                "checkpoint was saved with")
        self.accountant.load_state_dict(engine_state["accountant"])
        self._segments = [s for s in segments if s.steps]
        self.generation += 1
        return note

    def _parse(self, saved, config) -> list[Segment]:
        if not isinstance(saved, dict) or "segments" not in saved or "privacy_unit" not in saved:
            raise ValueError("not a dptrain engine state: its 'ledger' needs keys 'privacy_unit' and 'segments'")
        unit = saved["privacy_unit"]
        if unit != config.privacy_unit:
            raise ValueError(
                f"this checkpoint's steps protect one {unit} each (privacy_unit={unit!r}), but this engine's "
                f"privacy_unit is {config.privacy_unit!r}: the two guarantees do not compose into either one (removing "
                "one example changes its user's clipped gradient by up to 2R), so its epsilon would not hold. Resume "
                f"with PrivacyEngine(..., privacy_unit={unit!r}), or start the {config.privacy_unit}-level run afresh"
            )
        segments = []
        for entry in saved["segments"]:
            if not isinstance(entry, (list, tuple)) or len(entry) != 5:
                raise ValueError(f"malformed ledger segment {entry!r}: expected "
                                 "(noise_multiplier, sample_rate, sample_size, max_batch_size, steps)")
            sigma, q, n, k, count = entry
            segments.append(Segment(
                _checks.non_negative("noise_multiplier", sigma), _checks.sample_rate(q),
                _checks.positive_int("sample_size", n), None if k is None else _checks.positive_int("max_batch_size", k),
                _checks.integer("steps", count, 0)))
        return segments

