"""Reading which sample each row belongs to from tag passes, on per-row sketches (``sketch.py``).

A layer call's output gradient is linear in the weights of the per-sample losses. Back-propagating
``sum_i v_i L_i`` with distinct per-sample tags ``v`` (a *tag pass*) next to the real backward
``sum_i L_i`` gives, for a row ``r`` that belongs to one sample ``s``, a tagged gradient
``t_r = v_s g_r``. A least-squares fit of ``t_r`` on ``g_r`` over the whole row gives the ratio
``v_s`` (robust in float32, unlike element-wise ratios) and its residual shows a row that mixes
samples. The fit is taken on the rows' sketches, which keep both (``sketch.py``).
"""
from __future__ import annotations

import math

import torch

from ..layers.numerics import autocast_state
from .errors import RowsMixSamples
from .layout import RowMap, classify

DIGITS = 4  # tags per pass: 1, 1/2, 1/4, 1/8


def tag_passes(batch: int) -> int:
    """How many tag passes tell ``batch`` samples apart: one per base-4 digit of their ids."""
    return max(1, math.ceil(math.log(max(batch, 1), DIGITS) - 1e-9))


def make_tags(batch: int, generator: torch.Generator, passes: int | None = None) -> list[torch.Tensor]:
    """Per-sample tags for ceil(log4 B) tag passes (float64): sample s gets the base-4 digits of a random id.

    A tag is a power of two (1, 1/2, 1/4, 1/8): scaling by it is exact in any floating-point format, so a
    row of one sample is its tag times the real row up to the rounding of its own computation, and two
    tags are a factor of two apart, which bf16 rounding cannot bridge. At most 1, so a tag pass never
    overflows where the real backward does not. Two samples differ in some digit: a row mixing them
    fails that pass's fit.
    """
    ids = torch.randperm(batch, generator=generator)
    passes = max(tag_passes(batch), passes or 0)
    return [torch.pow(2.0, -((ids // DIGITS ** k) % DIGITS).to(torch.float64)) for k in range(passes)]


def computing_precision(device: torch.device, params) -> torch.dtype | None:
    """The lowest floating-point precision the forward computes in now: autocast's dtype where autocast is on for
    ``device``, and the (trainable) parameters' dtypes. A gradient's own dtype does not show it: a float32 input
    of a bf16 model, or a LayerNorm's float32 output under autocast, gets a float32 gradient computed in bf16."""
    lowest = None
    _, on, dtype = autocast_state(device.type)
    for dt in ([dtype] if on else []) + list(params):
        if dt.is_floating_point and (lowest is None or torch.finfo(dt).eps > torch.finfo(lowest).eps):
            lowest = dt
    return lowest


def finite(grad: torch.Tensor) -> bool:
    return bool(torch.isfinite(grad).all())


def tolerance(dtype: torch.dtype, precision: torch.dtype | None) -> tuple[float, float]:
    """(eps, rel) of a reading: the gradient's rounding unit (or the forward's lower one), and the relative misfit a
    row of one sample may show. The gradient's dtype does not tell the precision it was computed in (a float64 model
    may normalise in float32): float32's is the floor, or the forward's lower one (bf16 autocast allows 5 %, so a
    row mixing a few percent of another sample's gradient passes there). A row that mixes samples misses by far
    more than rounding."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1e-12
    if precision is not None:
        eps = max(eps, torch.finfo(precision).eps)
    return eps, min(1e3 * max(eps, torch.finfo(torch.float32).eps), 0.05)


def read_sketches(real: torch.Tensor, tagged: list[torch.Tensor], tags: list[torch.Tensor], batch: int,
                  shape: tuple[int, ...], axes: int, eps: float, rel: float) -> RowMap:
    """The row-to-sample map of one call from the sketches of its real output gradient and of its tag passes
    (``[rows, k]`` each, rows along the first ``axes`` dimensions of ``shape``). Raises ``RowsMixSamples``."""
    rows = real.shape[0]
    g = real
    gg = g.square().sum(1)
    scale = gg.max().sqrt() if rows else gg.new_zeros(())
    # A row whose gradient is rounding noise next to the call's largest row says nothing about its sample, if its tagged
    # gradients are as quiet: a row of one sample is its tag times the real row. A row whose real gradient is nothing
    # and a tagged one is not holds gradients of several samples that cancel in their sum (one sample's loss minus
    # another's output): its samples' own gradients there are not nothing, and it is read as mixed.
    #
    # "Rounding noise" is float32's at most, but in fp16: a row of one sample is its tag times its real row to within
    # its own rounding (scaling by a power of two commutes with rounding, in bf16 too), which ``rel`` allows for,
    # relative to the row. The rounding unit of a bf16 forward times 64 is half the largest row: rows up to that size
    # were taken for rows of no sample and given the sample their place in a layout says, mixed or not (1.3-1.5 R under
    # bf16 autocast, where the mixing rows were under half the largest; an outside probe). fp16's range is narrow: a
    # small row's elements are subnormal there, where a tag's power of two rounds them, and a row of one sample misses
    # its fit (rows of samples whose losses weigh 1e-3 next to others' 1e3, or under a GradScaler): 64 of its units
    # (6 % of the largest row) stay noise.
    low_range = eps == torch.finfo(torch.float16).eps
    noise = 64 * (eps if low_range else min(eps, torch.finfo(torch.float32).eps))
    empty = gg.sqrt() <= noise * scale
    for t in tagged:
        tt = t.square().sum(1)
        empty &= tt.sqrt() <= noise * torch.maximum(scale, tt.max().sqrt())
    ids = torch.zeros(rows, dtype=torch.long, device=g.device)
    ok = torch.ones(rows, dtype=torch.bool, device=g.device)
    for k, t in enumerate(tagged):
        ratio = torch.where(empty, torch.ones_like(gg), (g * t).sum(1) / gg.clamp_min(torch.finfo(torch.float64).tiny))
        residual = (t - ratio.unsqueeze(1) * g).square().sum(1)  # no cancellation, unlike tt - ratio * gt
        fits = residual <= rel ** 2 * t.square().sum(1) + (noise * scale) ** 2
        digit = -torch.log2(ratio.clamp_min(2.0 ** -(DIGITS + 1)))
        nearest = digit.round()
        # A row of one sample has its tag to within the rounding of its computation (rel); so little slack
        # also keeps a mixture of rows of a single value each from passing for a tag by chance.
        ok &= (fits & ((digit - nearest).abs() <= 2 * rel) & (nearest >= 0) & (nearest < DIGITS)) | empty
        ids += nearest.clamp(0, DIGITS - 1).long() * DIGITS ** k
    ids, ok, empty = ids.cpu(), ok.cpu(), empty.cpu()
    sample_of_id = torch.full((max(DIGITS ** len(tagged), batch),), -1, dtype=torch.long)
    tag_ids = sum((-torch.log2(v.cpu())).round().long() * DIGITS ** k for k, v in enumerate(tags))
    sample_of_id[tag_ids] = torch.arange(batch)
    samples = sample_of_id[ids.clamp(max=sample_of_id.numel() - 1)]
    ok &= (samples >= 0) | empty
    if not bool(ok.all()):
        bad = int((~ok).sum())
        raise RowsMixSamples(f"{bad} of {rows} rows along the {'first' if axes == 1 else 'first two'} "
                             f"ax{'is' if axes == 1 else 'es'} mix the gradients of several samples")
    samples = torch.where(empty, torch.full_like(samples, -1), samples)
    return classify(samples, shape, batch, axes)


def read_rows(grad: torch.Tensor, tagged: list[torch.Tensor], tags: list[torch.Tensor], batch: int,
              two_axes: bool, precision: torch.dtype | None = None, projections=None) -> RowMap:
    """The row-to-sample map of one call from whole gradients (its real one and its tag passes'), read on their
    sketches as the engine does (along the first axis, then, with ``two_axes``, the first two)."""
    from .sketch import Projections, sketch_rows

    projections = projections or Projections(0)
    eps, rel = tolerance(grad.dtype, precision)
    err = None
    for axes in ((1, 2) if two_axes and grad.dim() >= 3 else (1,)):
        try:
            return read_sketches(sketch_rows(grad, axes, projections), [sketch_rows(t, axes, projections) for t in tagged],
                                 tags, batch, tuple(grad.shape), axes, eps, rel)
        except RowsMixSamples as e:
            err = e
    assert err is not None  # (one reading at least)
    raise err
