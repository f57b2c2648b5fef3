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
import warnings

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
    ``device``, and the model's parameters' and buffers' dtypes (``params``, frozen ones too: a gradient through a
    frozen fp16 part is rounded in fp16). A gradient's own dtype does not show it: a float32 input
    of a bf16 model, or a LayerNorm's float32 output under autocast, gets a float32 gradient computed in bf16."""
    lowest = None
    _, on, dtype = autocast_state(device.type)
    for dt in ([dtype] if on else []) + list(params):
        if dt.is_floating_point and (lowest is None or torch.finfo(dt).eps > torch.finfo(lowest).eps):
            lowest = dt
    return lowest


#: the most a tag pass scales a sample's loss up (``even_scales``): 2^40 keeps within float32's and bf16's range
EVEN_UP_TO = 40


def even_scales(losses: torch.Tensor, precision: torch.dtype | None) -> torch.Tensor | None:
    """Per-sample powers of two, at least 1 and at most 2^40, that bring each loss up towards the largest
    (``floor(log2(max |L| / |L_i|))``), or None where none would be 8 or more (or under fp16, with a non-finite loss,
    or under data parallelism: ``_data_parallel``).

    The tag passes, and a reference pass that then stands for the real gradient, weigh the losses by them (the tags'
    ratios are unchanged). A part of a small sample's gradient in another's row below the backward's own rounding of
    that row is rounded away in every pass alike, so no reading shows it (a sample whose loss weighs 1e-4, coupled
    into another's row under bf16: 1.2-1.3 R, silent; an outside probe). Weighted, the small sample's gradient is as
    large as the others' in the passes that read the rows, wherever its loss tells its scale (a loss weighted small,
    a sample the model already fits)."""
    if precision == torch.float16 or losses.dim() != 1 or losses.numel() < 2 or _data_parallel():
        return None
    size = losses.detach().abs().to(torch.float64)
    exponent = torch.log2(size.max() / size.clamp_min(torch.finfo(torch.float64).tiny)).floor().clamp(0, EVEN_UP_TO)
    if not bool(torch.isfinite(size).all() & (exponent >= 3).any()):  # (one read on the host)
        return None
    return torch.pow(2.0, exponent)


def _data_parallel() -> bool:
    """Several processes: each rank runs the backwards every rank agreed on (FSDP2 gathers parameters in each), and a
    reference pass only some ranks' losses asked for would hang the others; the passes are not weighted there."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def finite(grad: torch.Tensor) -> bool:
    return bool(torch.isfinite(grad).all())


#: the relative misfit a row of one sample may show where every pass is computed alike (``reproducible``): none but
#: the float64 rounding of its sketch's fit, as a tag's power of two commutes with rounding
EXACT_REL = 2.0 ** -30
_WARNED: list[str] = []  # (the loose reading on CUDA is said once a process)


def reproducible(device: torch.device | None, precision: torch.dtype | None) -> bool:
    """Whether the backward gives a row of one sample exactly its tag times the real row: every pass runs the same
    deterministic kernels on the same values scaled by a power of two, which commutes with rounding (the CPU's
    kernels, or CUDA's with ``torch.use_deterministic_algorithms(True)``), in a format whose range keeps small
    gradients normal (not fp16, where they are subnormal and a tag rounds them)."""
    if device is None or precision == torch.float16:
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.are_deterministic_algorithms_enabled())


def tolerance(dtype: torch.dtype, precision: torch.dtype | None,
              device: torch.device | None = None) -> tuple[float, float]:
    """(eps, rel) of a reading: the gradient's rounding unit (or the forward's lower one), and the relative misfit a
    row of one sample may show.

    Where the passes are ``reproducible``, a row of one sample is exactly its tag times the real row: eps is 0 and
    rel ``EXACT_REL``, so a row that holds another sample's gradient is read as mixed down to what the backward keeps
    of it (its own rounding: docs/row-check.md). A tolerance of rounding there let a sample whose gradient is 1e-4 of another's pass its share
    into that one's rows as rounding, while clipping gives the small sample's gradient, formed from the other's
    values, the full weight R: 1.2-2.1 R, silent, every mode, at an R that clips both (an outside probe).

    Elsewhere (a GPU's non-deterministic kernels, fp16) rounding differs from pass to pass: eps is the gradient's
    dtype's unit (or the forward's lower one; float32's is the floor, as a float64 model may normalise in float32)
    and rel a thousand of them, at most 5 % (bf16 autocast). A mixture below rel of its row passes there."""
    if reproducible(device, precision):
        return 0.0, EXACT_REL
    if device is not None and device.type == "cuda" and precision != torch.float16 and not _WARNED:
        _WARNED.append(device.type)
        warnings.warn(
            "the row check reads rows by tag passes on CUDA without deterministic algorithms, so it allows each row "
            "a thousand rounding units of misfit: a sample whose gradient is less than about 1e-4 of another's could "
            "couple with it unseen. torch.use_deterministic_algorithms(True) makes the reading exact "
            "(docs/row-check.md, section 4)", stacklevel=2)
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
    # Each row's sample as its tags name it (its ratio in every pass, to the nearest tag), fitting or not: what a row
    # may hold as rounding is measured against its own sample's rows (``floor``).
    fits_of, ids = [], torch.zeros(rows, dtype=torch.long, device=g.device)
    named = torch.ones(rows, dtype=torch.bool, device=g.device)
    for k, t in enumerate(tagged):
        ratio = (g * t).sum(1) / gg.clamp_min(torch.finfo(torch.float64).tiny)
        digit = -torch.log2(ratio.clamp_min(2.0 ** -(DIGITS + 1)))
        nearest = digit.round()
        named &= (nearest >= 0) & (nearest < DIGITS)
        ids += nearest.clamp(0, DIGITS - 1).long() * DIGITS ** k
        fits_of.append((t, ratio, (digit - nearest).abs()))
    sample_of_id = torch.full((max(DIGITS ** len(tagged), batch),), -1, dtype=torch.long, device=g.device)
    tag_ids = sum((-torch.log2(v.to(g.device))).round().long() * DIGITS ** k for k, v in enumerate(tags))
    sample_of_id[tag_ids] = torch.arange(batch, device=g.device)
    samples = torch.where(named, sample_of_id[ids.clamp(max=sample_of_id.numel() - 1)], -1)
    # Rounding is relative to the magnitudes of a row's own computation, which are its sample's: a row may hold
    # ``noise`` times its sample's largest row of rounding, and a row of no sample (a padded one, a head the loss
    # leaves out) is one whose real and tagged gradients are that quiet. The floor was the call's largest row, any
    # sample's: one sample of a large gradient (a loss weighed 1e9 next to 1e-4, an input 1e5 times the others') put
    # every other sample's rows under it, mixed or not, and they were taken for rows of no sample or fitted within
    # it (1.04-2.1 R, silent, every mode; an outside probe). A row whose tags name no sample has no floor.
    #
    # "Rounding noise" is float32's at most, but in fp16: a row of one sample is its tag times its real row to within
    # its own rounding (scaling by a power of two commutes with rounding, in bf16 too), which ``rel`` allows for,
    # relative to the row. The rounding unit of a bf16 forward times 64 is half the largest row: rows up to that size
    # were taken for rows of no sample and given the sample their place in a layout says, mixed or not (1.3-1.5 R under
    # bf16 autocast; an outside probe). fp16's range is narrow: a small row's elements are subnormal there, where a
    # tag's power of two rounds them absolutely, so rows whose elements are within 64 of fp16's smallest steps are
    # noise whatever their sample (``subnormal``), and 64 of its units relative to the sample's largest row.
    low_range = eps == torch.finfo(torch.float16).eps
    noise = 64 * (eps if low_range else min(eps, torch.finfo(torch.float32).eps))  # (0 where the passes are exact)
    norm = gg.sqrt()
    largest = torch.zeros(batch + 1, dtype=norm.dtype, device=g.device)
    largest = largest.scatter_reduce(0, samples + 1, norm, "amax", include_self=True)
    largest[0] = 0.0  # (rows whose tags name no sample)
    floor = noise * largest[samples + 1]
    # rows within 64 steps of the subnormal range (fp16's, else float32's: bf16 has its range) round absolutely
    width = math.prod(shape[axes:]) * real.shape[1]  # (a sketch's squared norm is k times its row's, on average)
    floor = floor.clamp_min(64 * (2.0 ** -24 if low_range else 2.0 ** -149) * math.sqrt(width))
    empty = norm <= floor
    for t in tagged:
        empty &= t.square().sum(1).sqrt() <= floor
    ok = named | empty
    for t, ratio, off_tag in fits_of:
        residual = (t - ratio.unsqueeze(1) * g).square().sum(1)  # no cancellation, unlike tt - ratio * gt
        fits = residual <= rel ** 2 * t.square().sum(1) + floor ** 2
        # A row of one sample has its tag to within the rounding of its computation (rel); so little slack
        # also keeps a mixture of rows of a single value each from passing for a tag by chance.
        ok &= (fits & (off_tag <= 2 * rel)) | empty
    samples, ok, empty = samples.cpu(), (ok & ((samples >= 0) | empty)).cpu(), empty.cpu()
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
    eps, rel = tolerance(grad.dtype, precision, grad.device)
    err = None
    for axes in ((1, 2) if two_axes and grad.dim() >= 3 else (1,)):
        try:
            return read_sketches(sketch_rows(grad, axes, projections), [sketch_rows(t, axes, projections) for t in tagged],
                                 tags, batch, tuple(grad.shape), axes, eps, rel)
        except RowsMixSamples as e:
            err = e
    assert err is not None  # (one reading at least)
    raise err
