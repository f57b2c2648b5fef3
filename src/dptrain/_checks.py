"""Argument checks for the public API, with one message style: ``<name> must be <requirement>, got <value>``.

Integers are whatever ``operator.index`` accepts (``int``, ``numpy.int64``), never ``bool``; real numbers
are ``numbers.Real``, never ``bool``.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any


class CheckError(ValueError):
    """A value that fails its check; ``requirement`` is what it must be (the command line words it for an option)."""

    def __init__(self, name: str, requirement: str, value: Any):
        super().__init__(f"{name} must be {requirement}, got {value!r}")
        self.name, self.requirement, self.value = name, requirement, value


def _fail(name: str, requirement: str, value: Any, meaning: str = "") -> CheckError:
    return CheckError(name, f"{requirement}{f' ({meaning})' if meaning else ''}", value)


def unknown(name: str, value: Any, valid: Sequence[str]) -> ValueError:
    """The error for a value that is none of the valid ones: ``unknown <name> <value>; valid: <valid, ...>``."""
    return ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def choice(name: str, value: Any, valid: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in valid:
        raise unknown(name, value, valid)
    return value


def integer(name: str, value: Any, minimum: int, meaning: str = "", integral_floats: bool = False) -> int:
    """An integer >= ``minimum``; ``integral_floats`` also takes 10.0 (from epochs * steps arithmetic), not 10.5."""
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            if integral_floats and isinstance(value, numbers.Real) and float(value).is_integer():
                number = int(value)  # type: ignore[call-overload]  # (numbers.Real's stub: no __int__, loose __trunc__)
    if number is None or number < minimum:
        requirement = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _fail(name, requirement, value, meaning)
    return number


def index(name: str, value: Any, bound: int, bound_name: str) -> int:
    """An integer in ``[0, bound)``, such as a rank below the number of replicas."""
    try:
        number = integer(name, value, 0)
    except ValueError:
        number = None
    if number is None or number >= bound:
        raise _fail(name, f"an integer with 0 <= {name} < {bound_name}={bound}", value)
    return number


def positive_int(name: str, value: Any, meaning: str = "") -> int:
    return integer(name, value, 1, meaning)


def real(name: str, value: Any, meaning: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, "a real number", value, meaning)
    return float(value)


def positive(name: str, value: Any, meaning: str = "") -> float:
    number = real(name, value, meaning)
    if not (math.isfinite(number) and number > 0):
        raise _fail(name, "a finite number > 0", value, meaning)
    return number


def non_negative(name: str, value: Any, meaning: str = "") -> float:
    number = real(name, value, meaning)
    if not (math.isfinite(number) and number >= 0):
        raise _fail(name, "a finite number >= 0", value, meaning)
    return number


def rate(name: str, value: Any, meaning: str = "") -> float:
    """A probability in (0, 1]."""
    number = real(name, value, meaning)
    if not 0.0 < number <= 1.0:
        raise _fail(name, "in (0, 1]", value, meaning)
    return number


def sample_rate(value: Any) -> float:
    """The Poisson sample rate q of DP-SGD, in (0, 1]."""
    return rate("sample_rate", value,
                "the probability that each example is in a batch, i.e. expected batch size / dataset size")


def first_line(err: BaseException) -> str:
    """The first non-blank line of an error's message (its type's name if the message is blank)."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def open_unit(name: str, value: Any, meaning: str = "") -> float:
    """A number in (0, 1), such as delta."""
    number = real(name, value, meaning)
    if not 0.0 < number < 1.0:
        raise _fail(name, "in (0, 1)", value, meaning)
    return number
