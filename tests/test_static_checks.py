"""The habits CI holds: the lint (``ruff check``) and the type check of ``src/`` (``mypy``), both configured in
pyproject.toml, at zero findings. Each runs as CI would from the checkout's root.

They need the ``test`` extra (``pip install -e '.[test]'`` brings ruff and mypy); without a tool its test skips,
saying so. ``ruff check --fix`` mends most lint findings itself (the import order among them).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed: pip install -e '.[test]'")
def test_lint_finds_nothing():
    run = run_tool("ruff", "check", ".")
    assert run.returncode == 0, f"ruff check . (fix with ruff check --fix .):\n{run.stdout[-8000:]}{run.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed: pip install -e '.[test]'")
def test_type_check_finds_nothing():
    run = run_tool("mypy")  # files, options: pyproject.toml's [tool.mypy]
    assert run.returncode == 0 and "error:" not in run.stdout, (
        f"python -m mypy (src/dptrain, configured in pyproject.toml):\n{run.stdout[-8000:]}{run.stderr[-2000:]}")
