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
    from helpers import default_dtype

    with default_dtype(torch.float64):
        yield


@pytest.fixture(autouse=True)
def no_torch_function_mode_outlives_a_test():
    """The engine watches training forwards with a TorchFunctionMode (rows.ForwardWatch): one left active
    after a forward (an interrupted one, a detach) would see every later torch call of the process."""
    from torch.overrides import _get_current_function_mode_stack

    yield
    left = _get_current_function_mode_stack()
    while _get_current_function_mode_stack():  # leave the next test a clean process
        torch._C._pop_torch_function_stack()
    assert not left, f"a torch function mode was left active: {left}"
