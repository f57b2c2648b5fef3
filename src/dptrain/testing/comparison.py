"""The engine's result against the oracle's: every parameter where they differ beyond a tolerance
(``mismatches``), and the largest relative error, for reports (``max_relative_error``)."""
from __future__ import annotations

import math

import torch


def mismatches(got: dict, expected: dict, *, rtol: float, atol: float = 0.0, relative_to: str = "entry",
               what: str = "") -> list[str]:
    """Every way in which ``got`` ({name: tensor}, the engine's) differs from ``expected`` (the oracle's), one
    line each; empty where they agree. Names must be the same; each entry must satisfy
    ``|got - expected| <= atol + rtol * scale`` (NaN never does), with ``scale`` the entry's own ``|expected|``
    (``relative_to="entry"``) or the largest ``|expected|`` of all parameters (``"largest"``), which suits
    gradients whose small entries are sums that cancel. ``what`` starts each line.
    """
    if relative_to not in ("entry", "largest"):
        raise ValueError(f"relative_to must be 'entry' or 'largest', got {relative_to!r}")
    prefix = f"{what}: " if what else ""
    out = [f"{prefix}{name!r} is not a parameter of the oracle's" for name in got if name not in expected]
    largest = max((r.abs().max().item() for r in expected.values() if r.numel()), default=0.0)
    for name, ref in expected.items():
        value = got.get(name)
        if value is None:
            out.append(f"{prefix}{name!r} got no gradient")
            continue
        if value.shape != ref.shape:
            out.append(f"{prefix}{name!r} has shape {tuple(value.shape)}, the oracle's {tuple(ref.shape)}")
            continue
        dtype = torch.promote_types(value.dtype, ref.dtype)
        value, ref = value.to(device=ref.device, dtype=dtype), ref.to(dtype)
        error = (value - ref).abs()
        bound = atol + rtol * (ref.abs() if relative_to == "entry" else largest)
        bad = ~(error <= bound)  # NaN counts as a mismatch
        if bool(bad.any()):
            bounds = torch.broadcast_to(torch.as_tensor(bound, dtype=dtype, device=ref.device), error.shape)
            k = int(torch.where(bad.flatten(), error.flatten().nan_to_num(float("inf")), -1.0).argmax())
            out.append(f"{prefix}{name!r} differs by {error.flatten()[k].item():.3g} at entry {k} (allowed "
                       f"{bounds.flatten()[k].item():.3g}; largest entry of the oracle's {largest:.3g})")
    return out


def max_relative_error(got: dict, expected: dict) -> tuple[float, str]:
    """(max |got - expected| / the largest |expected| of all parameters (the absolute error where that is 0), the
    worst parameter's name): the measure that ``mismatches(..., relative_to="largest")`` bounds, for reports.
    Names and shapes must match."""
    assert set(got) == set(expected), f"parameter names differ: {sorted(set(got) ^ set(expected))}"
    largest = max((r.abs().max().item() for r in expected.values() if r.numel()), default=0.0) or 1.0
    worst, worst_name = 0.0, ""
    for name, ref in expected.items():
        assert got[name].shape == ref.shape, f"{name}: shape {tuple(got[name].shape)} != {tuple(ref.shape)}"
        error = (got[name].to(ref.device) - ref).abs().max().item() if ref.numel() else 0.0
        if not error / largest <= worst:  # also catches NaN, which no later parameter replaces
            worst, worst_name = error / largest, name
            if math.isnan(worst):
                break
    return worst, worst_name
