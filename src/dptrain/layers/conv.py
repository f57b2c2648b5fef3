"""nn.Conv1d/2d/3d: stride, dilation, groups, any padding and padding_mode.

A convolution is a linear layer per group on unfolded patches (im2col), with T = number of
output locations and d = C_in/groups * prod(kernel) (mixed-ghost paper, section 3). The
patches are 9x the input for a 3x3 kernel, so they are never kept: the operands of a call are
the layer input and the output gradient, the tensors autograd keeps anyway. From them:

- the clipped gradient 2b(C) is the convolution's own weight-gradient kernel applied to the
  output gradient scaled per sample by C_i (exact: the weight gradient is linear in it);
- per-sample gradients (module 4) are that same kernel with the batch folded into the groups
  (input [1, B*C_in, ...], gradient [1, B*C_out, ...], groups B*groups), or, where the patches
  are no larger than the per-sample gradient itself, a batched product with the patches;
- the ghost norm (module 3) needs the patches' Gram matrices: patches are formed there only,
  a batch chunk at a time under ``ConvRule.workspace_bytes``, and freed at once.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .numerics import accumulation_dtype, float32_at_least, takes_out_dtype, weighted_sum, wide_matmul
from .protocol import LayerDims, LayerRule, expand_input_rows
from .registry import register_layer


def _explicit_padding(module: nn.modules.conv._ConvNd) -> list[int]:
    """F.pad amounts (last dim first) that reproduce the module's padding, 'same' included."""
    pads = getattr(module, "_reversed_padding_repeated_twice", None)
    if pads is not None:
        return [int(p) for p in pads]
    n = len(module.kernel_size)
    if module.padding == "valid":
        return [0] * (2 * n)
    if isinstance(module.padding, str):  # 'same': torch puts the odd pixel on the right
        out = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = d * (k - 1)
            out += [total // 2, total - total // 2]
        return out
    return [int(p) for i in reversed(range(n)) for p in (module.padding[i], module.padding[i])]


def _padded_input(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(input, symmetric zero padding per dim) that a padding-only convolution sees as the module does.

    Zero padding that is the same on both sides is left to the kernel (no copy); any other
    padding_mode, and the asymmetric padding of 'same' with an even kernel, is applied here.
    """
    pads = _explicit_padding(module)
    left, right = pads[0::2][::-1], pads[1::2][::-1]  # per spatial dim, first dim first
    if module.padding_mode == "zeros" and left == right:
        return x, left
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode), [0] * len(left)


def unfold_patches(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """[B, C_in, *spatial] -> [B, C_in * prod(kernel), L] patches, channel-major like the weight."""
    n = len(module.kernel_size)
    pads = _explicit_padding(module)
    if any(pads):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pads, mode=mode)
    if n == 2 and x.device.type == "cpu":
        return F.unfold(x, module.kernel_size, dilation=module.dilation, stride=module.stride)
    # one copy, where F.unfold's CUDA kernel is launched once per sample (128 launches a layer at batch 128)
    return unfold_by_views(module, x)


def unfold_by_views(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``unfold_patches`` of an input already padded, for any number of spatial dims: strided windows per
    spatial dim (dilation keeps every d-th element), copied once into the patches' layout."""
    n = len(module.kernel_size)
    for i, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    B, C = x.shape[:2]
    out_sizes = x.shape[2 : 2 + n]
    # [B, C, o_1..o_n, k_1..k_n] -> [B, C, k_1..k_n, o_1..o_n] -> [B, C*K, L]
    perm = [0, 1] + list(range(2 + n, 2 + 2 * n)) + list(range(2, 2 + n))
    return x.permute(perm).reshape(B, C * math.prod(module.kernel_size), math.prod(out_sizes))


def weight_grad(module: nn.modules.conv._ConvNd, x: torch.Tensor, grad: torch.Tensor,
                batch_groups: bool = False) -> torch.Tensor:
    """The convolution's weight gradient for input ``x`` and output gradient ``grad``, summed over the batch.

    ``batch_groups``: per-sample gradients [B, *weight.shape] instead, by folding the batch into
    the groups (sample i's channels only meet sample i's). ``x`` must be in ``grad``'s dtype.
    """
    B = x.shape[0]
    if B == 0:  # an empty Poisson batch: the kernel takes no empty batch folded into groups
        return grad.new_zeros((0, *module.weight.shape) if batch_groups else module.weight.shape)
    x, padding = _padded_input(module, x)
    groups, shape = module.groups, tuple(module.weight.shape)
    if batch_groups:
        x, grad = x.reshape(1, -1, *x.shape[2:]), grad.reshape(1, -1, *grad.shape[2:])
        groups, shape = B * groups, (B * shape[0], *shape[1:])
    n = len(module.kernel_size)
    # the kernel only reads the weight's shape: a broadcast scalar stands in for it
    w = torch.ops.aten.convolution_backward(
        grad, x, grad.new_empty(1).expand(shape), None, list(module.stride), padding, list(module.dilation),
        False, [0] * n, groups, (False, True, False),
    )[1]
    return w.reshape(B, *module.weight.shape) if batch_groups else w


class ConvCall(NamedTuple):
    """One call's operands: the input as captured and the gradient of the output."""

    input: torch.Tensor  # [B, C_in, *spatial]; cast to the gradient's dtype (autocast's rounding) where used
    grad: torch.Tensor   # [B, C_out, *out_spatial]


@register_layer
class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    expand_batch = expand_input_rows

    #: bytes of transient work (patches, Gram matrices, padded copies) a primitive may form at
    #: once for one layer; batch chunks and Gram tiles are sized to stay under it. None: 32 MiB
    #: on the CPU, 256 MiB on an accelerator (larger chunks, fewer kernel launches).
    workspace_bytes: int | None = None

    def workspace(self, like: torch.Tensor) -> int:
        if self.workspace_bytes is not None:
            return self.workspace_bytes
        return (32 if like.device.type == "cpu" else 256) * 2**20

    def capture(self, module, inputs, output):
        x = inputs[0]
        if x.dim() != len(module.kernel_size) + 2:
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} without a batch dimension; "
                "private training needs batched inputs [B, C, ...]: add a batch dimension (x.unsqueeze(0))"
            )
        return x.detach()

    def dims(self, module, activation, output):
        g = module.groups
        T = math.prod(output.shape[2:])
        d = module.in_channels // g * math.prod(module.kernel_size)
        return LayerDims(T=T, p=module.out_channels // g, d=d, blocks=g)

    def operands(self, module, activation, grad_output):
        # Nothing is derived here: the engine may keep operands until the clipping factors are
        # known, and the input and output gradient are all that autograd keeps too.
        return (ConvCall(activation, grad_output),)

    def concat_calls(self, calls):
        return tuple(call for ops in calls for call in ops)

    # ------------------------------------------------------------------ module 3
    def ghost_sq_norm(self, module, ops):
        """sum over blocks of <A_i A_i^T, G_i G_i^T> with A the patches of all calls side by side."""
        B, g = ops[0].grad.shape[0], module.groups
        d = module.in_channels // g * math.prod(module.kernel_size)
        p = module.out_channels // g
        T = sum(math.prod(c.grad.shape[2:]) for c in ops)
        like = ops[0].grad
        # bf16/fp16 patches stay as they are where the Gram products take them into float32 (numerics.wide_matmul:
        # tensor cores, the widened product's value); elsewhere they are widened first
        low = like.dtype in (torch.float16, torch.bfloat16) and takes_out_dtype(like.device)
        acc = like.dtype if low else float32_at_least(like).dtype
        size, gram_size = acc.itemsize, float32_at_least(like).dtype.itemsize
        budget = self.workspace(like)
        # Gram tiles of at most `tile` tokens: three [g, tile, tile] products per sample in the budget
        tile = max(1, min(T, math.isqrt(max(1, budget // (6 * g * gram_size)))))
        per_sample = size * g * (d + p) * T + 3 * gram_size * g * tile * tile
        chunk = max(1, min(B, budget // per_sample))
        norms = []
        for start in range(0, B, chunk):
            rows = slice(start, start + chunk)
            a = _side_by_side([self._patches(module, c.input[rows], c.grad.dtype, acc) for c in ops])
            grad = _side_by_side([c.grad[rows].reshape(a.shape[0], g, p, -1).to(acc) for c in ops])
            norms.append(_tiled_gram_product(a.reshape(a.shape[0], g, d, T), grad, tile))
            del a, grad  # the patches of this chunk go now, before the next chunk's are formed
        if not norms:
            return like.new_zeros(0, dtype=float32_at_least(like).dtype)
        return torch.cat(norms)

    @staticmethod
    def _patches(module, x, dtype, acc):
        # the input as the convolution saw it (rounded to the compute dtype under autocast), then widened
        return unfold_patches(module, x.to(dtype)).to(acc)

    # ------------------------------------------------------------------ module 4
    def per_sample_grads(self, module, ops, names):
        B = ops[0].grad.shape[0]
        out = {}
        if "weight" in names:
            # A chunk's transient copies: the input cast and padded, the output gradient made contiguous,
            # and the patches where they are formed (see _per_sample_weight).
            by_patches = self.per_sample_by_patches(ops[0].grad)
            elem = ops[0].grad.element_size()
            per_sample = elem * (2 * module.weight.numel() + sum(
                math.prod(c.input.shape[1:]) + math.prod(c.grad.shape[1:])
                + (module.in_channels * math.prod(module.kernel_size) * math.prod(c.grad.shape[2:]) if by_patches else 0)
                for c in ops))
            chunk = max(1, min(B, self.workspace(ops[0].grad) // per_sample))
            parts = []
            for start in range(0, B, chunk):
                rows = slice(start, start + chunk)
                w = None
                for c in ops:
                    term = self._per_sample_weight(module, c.input[rows].to(c.grad.dtype), c.grad[rows], by_patches)
                    w = term if w is None else _add_widened(w, term)
                parts.append(w)
            if not parts:  # an empty batch
                parts.append(weight_grad(module, ops[0].input, ops[0].grad, batch_groups=True))
            out["weight"] = parts[0] if len(parts) == 1 else torch.cat(parts)  # one chunk: no copy
        if "bias" in names:
            out["bias"] = self._per_sample_bias(ops)
        return out

    #: per-sample weight gradients by a batched product with the patches at any size (True), or by the
    #: weight-gradient kernel with the batch folded into the groups where the patches are larger than the
    #: per-sample gradient (False). None: the product on an accelerator, where the folded kernel runs as one
    #: launch per group (an H200 spent 35 of ResNet-18's 82 ms of GPU time at batch 128 in 4,500 of them),
    #: the choice by size on the CPU.
    per_sample_patches: bool | None = None

    def per_sample_by_patches(self, like: torch.Tensor) -> bool:
        if self.per_sample_patches is not None:
            return self.per_sample_patches
        return like.device.type != "cpu"

    @staticmethod
    def _per_sample_weight(module, x, grad, by_patches: bool = False):
        """[b, *weight.shape] for one call: a batched product with the patches (``by_patches``, or where they are
        no larger than the per-sample gradient itself: few output positions, T <= C_out/groups), else the
        weight-gradient kernel with the batch folded into the groups (measured on 2 CPU cores: the folded kernel
        was 5-10x slower than the product for 512 channels at 4x4, and 2-8x faster for 64-128 channels at
        16x16+)."""
        g, T = module.groups, math.prod(grad.shape[2:])
        p = module.out_channels // g
        if T > p and not by_patches:
            return weight_grad(module, x, grad, batch_groups=True)
        b = x.shape[0]
        patches = unfold_patches(module, x).reshape(b, g, -1, T)
        w = torch.einsum("bgpt,bgdt->bgpd", grad.reshape(b, g, p, T), patches)
        return w.reshape(b, *module.weight.shape)

    @staticmethod
    def _per_sample_bias(ops):
        total = None
        for c in ops:
            term = c.grad.flatten(2).sum(2, dtype=accumulation_dtype(c.grad.dtype))
            total = term if total is None else total + term
        return total

    def factorable(self, module):
        return module.groups == 1

    def weight_factors(self, module, ops):
        """(output gradients [B, T, C_out], patches [B, T, d]) of all calls, for a weight tied to another layer.

        Forms the whole batch's patches: only used for shared convolution weights.
        """
        if module.groups != 1:
            return None
        u = torch.cat([c.grad.flatten(2).transpose(1, 2) for c in ops], dim=1)
        v = torch.cat([unfold_patches(module, c.input.to(c.grad.dtype)).transpose(1, 2) for c in ops], dim=1)
        return u, v

    # ------------------------------------------------------------------ module 2b(C)
    def clipped_grads(self, module, ops, factors):
        out = {}
        if "weight" in factors:
            w = None
            for c in ops:
                # in float32 or wider, from the input as the norm saw it (rounded to the compute dtype): a bf16
                # kernel would round one sample's clipped contribution, up to ~2^-9 above R
                acc = accumulation_dtype(c.grad.dtype, factors["weight"].dtype)
                scale = factors["weight"].to(acc).reshape(-1, *([1] * (c.grad.dim() - 1)))
                term = weight_grad(module, c.input.to(c.grad.dtype).to(acc), c.grad.to(acc) * scale)
                w = term if w is None else _add_widened(w, term)
            out["weight"] = w
        if "bias" in factors:
            out["bias"] = weighted_sum(factors["bias"], self._per_sample_bias(ops))
        return out


def _side_by_side(parts: list[torch.Tensor]) -> torch.Tensor:
    """The calls' tokens side by side (last axis); one call is used as it is, without a copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _add_widened(total: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """Sum of the calls of a module: in float32 at least, so that bf16 calls are not rounded at each addition."""
    acc = accumulation_dtype(total.dtype, term.dtype)
    return total.to(acc) + term.to(acc)


def _tiled_gram_product(a: torch.Tensor, grad: torch.Tensor, tile: int) -> torch.Tensor:
    """[b] sum over blocks and token pairs of (a^T a) * (grad^T grad), for a [b, g, d, T], grad [b, g, p, T].

    Tiles of ``tile`` tokens bound the Gram matrices; the product is symmetric in the tiles, so
    only tiles i <= j are formed and those off the diagonal count twice.
    """
    T = a.shape[-1]
    total = None
    for i in range(0, T, tile):
        a_i, g_i = a[..., i : i + tile], grad[..., i : i + tile]
        for j in range(i, T, tile):
            gram_a = _block_gram(a_i, a[..., j : j + tile])
            gram_g = _block_gram(g_i, grad[..., j : j + tile])
            term = (gram_a * gram_g).sum((1, 2, 3))
            term = term if i == j else 2 * term
            total = term if total is None else total + term
    assert total is not None  # (one tile at least: T >= 1)
    return total


def _block_gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[b, g, t, s] inner products of the tokens of x [b, g, d, t] and y [b, g, d, s], in float32 or wider: bf16/fp16
    operands as they are where the device takes them into float32 (``numerics.wide_matmul``), else by ``einsum`` (on
    the CPU faster than the batched product of the transposed operand, by up to a third)."""
    if x.dtype in (torch.float16, torch.bfloat16) and takes_out_dtype(x.device):
        b, g, d = x.shape[:3]
        gram = wide_matmul(x.transpose(-1, -2).reshape(b * g, x.shape[-1], d), y.reshape(b * g, d, y.shape[-1]))
        return gram.reshape(b, g, x.shape[-1], y.shape[-1])
    return torch.einsum("bgdt,bgds->bgts", x, y)
