"""Numeric helpers shared by the layer rules: Gram matrices of weight factors, token flattening, and
the precision rules (norms, clipping factors and their products in float32 or wider, also when the
model trains in bf16/fp16).

Nothing here knows about modules or the registry: these are functions of tensors.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OneHot:
    """The one-hot matrix [B, T, size] of token ids [B, T], never formed."""

    ids: torch.Tensor
    size: int



def factor_gram(x, y) -> torch.Tensor:
    """[B, Tx, Ty] inner products between the rows of two factors (dense or one-hot)."""
    if isinstance(x, OneHot) and isinstance(y, OneHot):
        return (x.ids.unsqueeze(2) == y.ids.unsqueeze(1)).float()
    if isinstance(x, OneHot):
        y = float32_at_least(y)
        index = x.ids.unsqueeze(1).expand(y.shape[0], y.shape[1], x.ids.shape[1])
        return torch.gather(y, 2, index).transpose(1, 2)  # y[b, s, ids[b, t]]
    if isinstance(y, OneHot):
        return factor_gram(y, x).transpose(1, 2)
    return wide_matmul(x, y.transpose(1, 2))


def shared_sq_norm(factors: list[tuple]) -> torch.Tensor:
    """||sum_m U_m^T V_m||_F^2 per sample, cross terms included, from Gram matrices only."""
    total = None
    for i, (u_i, v_i) in enumerate(factors):
        for j in range(i, len(factors)):
            u_j, v_j = factors[j]
            term = (factor_gram(u_i, u_j) * factor_gram(v_i, v_j)).sum((1, 2))
            term = term if i == j else 2 * term
            total = term if total is None else total + term
    assert total is not None  # (one set of factors at least)
    return total


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, *, f] -> [B, T, f] with T the product of the middle dims (T = 1 for [B, f])."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def swap01(t):
    """A tensor with its first two dimensions swapped (batch-first <-> time-first); anything else as it is."""
    return t.transpose(0, 1) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t


def float32_at_least(x: torch.Tensor) -> torch.Tensor:
    """Norms are accumulated in float32 or wider, also under bf16/fp16 training."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


_LOW = (torch.float16, torch.bfloat16)
#: whether a device's mm/bmm takes bf16/fp16 operands with a float32 output (``out_dtype``: CUDA, in torch's recent
#: releases), by device type; asked once
_TAKES_OUT_DTYPE: dict[str, bool] = {}


def takes_out_dtype(device: torch.device) -> bool:
    """Whether ``torch.mm``/``torch.bmm`` on ``device`` multiply bf16 and fp16 operands as they are into a float32
    result (tensor cores, float32 accumulation)."""
    known = _TAKES_OUT_DTYPE.get(device.type)
    if known is None:
        known = False
        if device.type == "cuda":
            try:
                one = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device)
                known = (torch.bmm(one, one, out_dtype=torch.float32).dtype == torch.float32
                         and torch.mm(one[0], one[0], out_dtype=torch.float32).dtype == torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):  # (an older torch, or a GPU without the kernel)
                known = False
        _TAKES_OUT_DTYPE[device.type] = known
    return known


def wide_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` (``[n, m] @ [m, k]``, or batched ``[b, n, m] @ [b, m, k]``) in float32 or wider.

    bf16/fp16 operands of one dtype are multiplied as they are where the device gives a float32 result of them
    (``takes_out_dtype``: tensor cores, float32 accumulation, no widened copy of either); elsewhere they are widened
    first. The value is the same up to the order of the float32 additions: the product of two bf16 (or two fp16)
    numbers is exact in float32.
    """
    if x.dtype is y.dtype and x.dtype in _LOW and takes_out_dtype(x.device):
        return (torch.bmm if x.dim() == 3 else torch.mm)(x, y, out_dtype=torch.float32)
    x, y = float32_at_least(x), float32_at_least(y)
    return torch.bmm(x, y) if x.dim() == 3 else x @ y


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """(device type, enabled, dtype) of the autocast in force (to replay a call under it later, or to know the
    precision a forward computes in)."""
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: no device argument
        cuda = device_type == "cuda"
        enabled = torch.is_autocast_enabled() if cuda else torch.is_autocast_cpu_enabled()
        return device_type, enabled, torch.get_autocast_gpu_dtype() if cuda else torch.get_autocast_cpu_dtype()
    except RuntimeError:  # a device type without autocast (meta)
        return "cpu", False, torch.bfloat16


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
#: the device types whose autocast ``without_autocast`` turns off where it is on
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_is_on() -> bool:
    """Whether autocast is on for any device type on this thread (one call of torch's: asked at every layer call's
    output gradient)."""
    if _any_autocast is not None:
        return bool(_any_autocast())
    return any(torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES)


@contextlib.contextmanager
def without_autocast():
    """The engine's own arithmetic (per-sample norms, clipping factors, clipped sums, the row check's readings) with
    autocast off: a backward run inside the user's ``torch.autocast`` region (``loss.backward()`` or
    ``engine.backward`` in the ``with`` block) would otherwise form them in bf16/fp16, since autocast lowers ``bmm``,
    ``mm`` and ``einsum``. A norm then has 8 bits and a clipped sum is rounded to bf16 as a whole: one sample's
    contribution measured up to 1.65 R. The model's own backward is left as the user runs it."""
    with contextlib.ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def outside_autocast(fn, *args):
    """``fn(*args)`` as ``without_autocast`` runs it; directly where no autocast is on (the usual case)."""
    if not autocast_is_on():
        return fn(*args)
    with without_autocast():
        return fn(*args)


def close(a: torch.Tensor, b: torch.Tensor, tol: float, scale=None) -> bool:
    """max |a - b| <= tol * scale (default scale: max |b|), in float32 or wider; shapes and the places of
    non-finite entries must agree."""
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    acc = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.detach().to(acc), b.detach().to(acc)
    # A finite largest gap means every entry of both is finite (an inf or a NaN on either side makes the gap
    # non-finite): then no masking is needed, and one host read answers (the fallback's checks call this at every call).
    gap = (a - b).abs().max()
    if bool(torch.isfinite(gap) & (gap <= tol * (b.abs().max() if scale is None else scale))):
        return True
    if bool(torch.isfinite(gap)):
        return False
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return False
    if not bool(finite.any()):
        return True
    a, b = a[finite], b[finite]
    scale = b.abs().max() if scale is None else scale
    return bool((a - b).abs().max() <= tol * scale)


_ACCUMULATION: dict[tuple, torch.dtype] = {}


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32, or the widest of ``dtypes`` if wider: where norms, clipping factors and their
    products with low-precision (bf16/fp16) operands are formed. (Kept per combination: about
    four calls per layer per step, each a dispatched operation of torch's.)"""
    out = _ACCUMULATION.get(dtypes)
    if out is None:
        out = torch.float32
        for dtype in dtypes:
            out = torch.promote_types(out, dtype)
        _ACCUMULATION[dtypes] = out
    return out


def scale_samples(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t[i] * factor[i]`` for every sample i (dim 0), in ``t``'s dtype.

    The product is formed in float32 (or wider) and rounded once: a clipping factor is never
    rounded to bf16/fp16 itself, which would scale every entry of a sample's contribution by
    the same rounding error (up to 2^-8 relative in bf16) and let it exceed the threshold.
    """
    acc = accumulation_dtype(t.dtype, factor.dtype)
    scaled = t.to(acc) * factor.to(acc).reshape(-1, *([1] * (t.dim() - 1)))
    return scaled.to(t.dtype)


def weighted_sum(factor: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """``sum_i factor[i] * per_sample[i]`` formed in float32 or wider (the engine casts it to the parameter's
    dtype), for the small per-sample gradients of biases and norm layers."""
    acc = accumulation_dtype(per_sample.dtype, factor.dtype)
    return torch.tensordot(factor.to(acc), per_sample.to(acc), dims=1)


def factor_weighted_sum(u, v, factor: torch.Tensor) -> torch.Tensor:
    """``sum_i factor[i] * U_i^T V_i`` as ``[rows, cols]`` from factors ``U [B, T, rows]`` (dense or one-hot)
    and ``V [B, T, cols]``, without forming a per-sample gradient: module 2b(C) of the book-keeping paper.

    Dense factors: the smaller of ``U`` and ``V`` is scaled sample by sample and the two multiplied. One-hot
    ``U``: the scaled rows of ``V`` are added into the rows their ids name (a bf16 running sum over repeated
    ids would round at every addition). Either way in float32 or wider: the step keeps its sums in that
    precision until the noise is added (``pipeline.StepSums``).
    """
    if isinstance(u, OneHot):
        acc = accumulation_dtype(v.dtype, factor.dtype)
        weighted = v.to(acc) * factor.to(acc)[:, None, None]
        summed = torch.zeros(u.size, v.shape[-1], dtype=acc, device=v.device)
        return summed.index_add_(0, u.ids.reshape(-1), weighted.reshape(-1, v.shape[-1]))
    if isinstance(v, OneHot):
        return factor_weighted_sum(v, u, factor).t()
    if u.dtype is v.dtype is torch.bfloat16 and factor.dtype == torch.float32 and takes_out_dtype(u.device):
        return split_weighted_sum(u, v, factor, wide_matmul)
    # Formed in float32 or wider from the very (bf16) operands whose ghost norm was taken: a product rounded
    # to bf16, or a factor-scaled operand rounded to bf16, lets one sample's contribution exceed R by ~2^-9.
    # The widened copies are made a chunk of tokens at a time (an LM head's 50k-wide gradient in float32
    # would double the largest tensor of the step).
    acc = accumulation_dtype(u.dtype, v.dtype, factor.dtype)
    T = u.shape[1]
    chunk = max(1, _WIDENED_CHUNK_BYTES // (acc.itemsize * (u.shape[-1] + v.shape[-1])))
    if u.shape[0] * T <= chunk:  # (the usual case: one product, each sample's rows scaled by its factor)
        a, b = u.to(acc), v.to(acc)
        if b.shape[-1] < a.shape[-1]:
            b = b * factor.to(acc).reshape(-1, 1, 1)
        else:
            a = a * factor.to(acc).reshape(-1, 1, 1)
        return a.reshape(-1, a.shape[-1]).t() @ b.reshape(-1, b.shape[-1])
    u, v = u.reshape(-1, u.shape[-1]), v.reshape(-1, v.shape[-1])
    per_token = factor.to(acc).repeat_interleave(T).unsqueeze(1)
    out = None
    for start in range(0, max(u.shape[0], 1), chunk):
        rows = slice(start, start + chunk)
        a, b = u[rows].to(acc), v[rows].to(acc)
        if b.shape[1] < a.shape[1]:  # scale the smaller factor: an LM head's input, not its 50k-wide gradient
            b = b * per_token[rows]
        else:
            a = a * per_token[rows]
        term = a.t() @ b
        out = term if out is None else out.add_(term)
    assert out is not None  # (one chunk at least)
    return out


_WIDENED_CHUNK_BYTES = 256 * 2**20


#: how many bf16 parts a float32 operand is split into by ``split_weighted_sum``: their sum is the operand to 2^-27
#: relative, below float32's own rounding of it (2^-24)
SPLIT_PARTS = 3


def split_weighted_sum(u: torch.Tensor, v: torch.Tensor, factor: torch.Tensor, product) -> torch.Tensor:
    """``factor_weighted_sum`` of bf16 factors on tensor cores: the smaller factor is scaled by the clipping factors
    in float32, split into ``SPLIT_PARTS`` bf16 parts (each the bf16 rounding of what the parts before it left), and
    each part multiplied by the other factor as it is, into float32 (``product``: ``wide_matmul``). Each such
    product is exact term by term, so the sum equals the float32 product of the widened operands up to 2^-27
    relative per scaled entry and the order of the float32 additions: three bf16 products where there was one in
    float32 (about a fifth of the time on an H200's tensor cores), and no widened copy of the larger factor (an LM
    head's gradient). bf16 only: fp16's narrower exponent range would lose the small parts.
    """
    small_first = u.shape[-1] <= v.shape[-1]
    small, large = (u, v) if small_first else (v, u)
    small, large = small.reshape(-1, small.shape[-1]), large.reshape(-1, large.shape[-1])
    per_token = factor.repeat_interleave(u.shape[1]).unsqueeze(1)
    # Rows a chunk at a time: the scaled float32 copy of the smaller factor (and one part) stays within the budget.
    chunk = max(1, _WIDENED_CHUNK_BYTES // (6 * max(1, small.shape[-1])))
    out = None
    for start in range(0, max(small.shape[0], 1), chunk):
        rest = small[start : start + chunk].float().mul_(per_token[start : start + chunk])
        rows = large[start : start + chunk]
        for k in range(SPLIT_PARTS):
            part = rest.to(torch.bfloat16)
            term = product(part.t(), rows) if small_first else product(rows.t(), part)
            out = term if out is None else out.add_(term)
            if k < SPLIT_PARTS - 1:
                rest.sub_(part)
    assert out is not None  # (one chunk at least)
    return out
