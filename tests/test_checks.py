"""dptrain.checks: the one place where the public API checks its arguments, with one message style."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dptrain import _checks, accounting, data


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), 3])
def test_integers_are_whatever_operator_index_takes(value):
    assert _checks.positive_int("steps", value) == 3 and type(_checks.positive_int("steps", value)) is int


@pytest.mark.parametrize("value", [True, False, 2.5, "3", None])
def test_bools_floats_and_text_are_not_integers(value):
    with pytest.raises(ValueError, match=r"^steps must be a positive integer, got "):
        _checks.positive_int("steps", value)


def test_integral_floats_only_where_asked():
    assert _checks.integer("steps", 10.0, 0, integral_floats=True) == 10
    with pytest.raises(ValueError, match=r"^steps must be an integer >= 0, got 10.5$"):
        _checks.integer("steps", 10.5, 0, integral_floats=True)


@pytest.mark.parametrize("check, value, message", [
    (_checks.rate, 0.0, "q must be in (0, 1], got 0.0"),
    (_checks.rate, True, "q must be a real number, got True"),
    (_checks.open_unit, 1.0, "q must be in (0, 1), got 1.0"),
    (_checks.positive, math.inf, "q must be a finite number > 0, got inf"),
    (_checks.non_negative, -1, "q must be a finite number >= 0, got -1"),
])
def test_one_message_style(check, value, message):
    with pytest.raises(ValueError) as err:
        check("q", value)
    assert str(err.value) == message


def test_index_is_an_integer_below_its_bound():
    assert _checks.index("rank", np.int64(1), 2, "num_replicas") == 1
    for bad in (2, -1, True, 0.0):
        with pytest.raises(ValueError, match=r"^rank must be an integer with 0 <= rank < num_replicas=2, got "):
            _checks.index("rank", bad, 2, "num_replicas")


def test_accounting_and_data_take_numpy_integers_and_refuse_bools():
    assert accounting.compute_epsilon(1.0, 0.01, np.int64(10), 1e-5, "rdp") > 0
    assert data.PoissonSampler(np.int64(10), 0.5, steps=np.int64(2)).steps == 2
    with pytest.raises(ValueError, match="^steps must be an integer >= 0, got True$"):
        accounting.compute_epsilon(1.0, 0.01, True, 1e-5, "rdp")
    with pytest.raises(ValueError, match="^num_samples must be a positive integer, got True$"):
        data.PoissonSampler(True, 0.5)


def test_one_default_clipping_mode():
    import importlib
    import inspect

    from dptrain import PrivacyEngine
    from dptrain.audit import AUDIT_DEFAULTS
    from dptrain.cli import TRAIN_DEFAULTS, build_parser
    from dptrain.core.algorithms import CLIPPING_MODES, DEFAULT_CLIPPING_MODE
    from dptrain.core.planning import plan

    assert DEFAULT_CLIPPING_MODE in CLIPPING_MODES
    defaults = {
        "engine": inspect.signature(PrivacyEngine).parameters["clipping_mode"].default,
        "plan": inspect.signature(plan).parameters["clipping_mode"].default,
        "dptrain train": TRAIN_DEFAULTS["clipping_mode"],
        "dptrain plan": build_parser().parse_args(["plan"]).clipping_mode,
        "audit": AUDIT_DEFAULTS["clipping_mode"],
    }
    try:
        from dptrain.integrations.hf_trainer import DPTrainer
    except ImportError:
        pass
    else:
        defaults["Trainer"] = inspect.signature(DPTrainer).parameters["clipping_mode"].default
    for name, module, attribute in (("Accelerate", "accelerate", "make_private"),
                                    ("Lightning", "lightning", "DPCallback")):
        try:
            integration = importlib.import_module(f"dptrain.integrations.{module}")
        except ImportError:
            continue
        defaults[name] = inspect.signature(getattr(integration, attribute)).parameters["clipping_mode"].default
    assert defaults == dict.fromkeys(defaults, DEFAULT_CLIPPING_MODE)
