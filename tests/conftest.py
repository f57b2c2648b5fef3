"""Shared fixtures for the dptrain test suite."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The tests run thousands of tiny operations: one intra-op thread avoids thread hand-off
# latency, which dominates (and explodes on a busy machine) at these sizes.
torch.set_num_threads(1)

# Make tests/helpers.py importable as ``helpers`` whatever the rootdir / import mode.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def float64():
    """Run a test with float64 as torch's default dtype, restoring the previous default after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
