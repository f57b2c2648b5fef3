"""The user-level example (examples/user_level_lm.py) trains a character model privately per author and learns."""
from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "user_level_lm.py"


def _run(argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("example_user_level_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module.main(argv)


def test_user_level_example_learns_with_a_user_level_epsilon():
    out = _run(["--authors", "1000", "--held-out-authors", "100", "--epochs", "2", "--quiet"])
    assert out["privacy_unit"] == "user"
    assert out["authors"] == 1000 and out["sample_rate"] == pytest.approx(0.1)  # 100 expected authors of 1000
    assert out["steps"] == 20  # two epochs of round(1 / q) = 10 steps
    assert math.isfinite(out["epsilon"]) and out["epsilon"] == pytest.approx(8.0, rel=0.05)  # calibrated
    # On authors never seen in training: better than untrained, and better than any model that ignores context.
    assert out["held_out_loss"] < out["context_free_loss"] < out["untrained_loss"]


def test_user_level_example_with_banded_correlated_noise(tmp_path, monkeypatch):
    """--noise bandmf: authors in 2 cyclic groups (the within-group rate doubles), the same steps and target."""
    monkeypatch.setenv("DPTRAIN_CACHE_DIR", str(tmp_path))
    out = _run(["--authors", "1000", "--held-out-authors", "100", "--epochs", "2", "--noise", "bandmf",
                "--bands", "2", "--quiet"])
    assert (out["noise"], out["bands"], out["steps"]) == ("bandmf", 2, 20)
    assert out["sample_rate"] == pytest.approx(0.2)
    assert out["epsilon"] == pytest.approx(8.0, rel=0.05) and out["epsilon"] <= 8.0
    assert out["held_out_loss"] < out["context_free_loss"] < out["untrained_loss"]
