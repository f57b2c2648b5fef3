"""What a backward is refused for, as the exception to raise: per-sample losses that are not finite, a backward
compiled by torch.compile that cannot run twice, a plain backward of a mean loss rounded in low precision, and more
rows than the attached loader's batch had samples.
(``runner`` raises them; nothing of the backward is kept.)"""
from __future__ import annotations

import torch


def non_finite_losses(losses: torch.Tensor) -> ValueError | None:
    """The refusal of a batch whose per-sample losses hold inf or NaN, naming their positions; None if they do not."""
    bad = (~torch.isfinite(losses.detach())).nonzero().flatten().tolist()
    if not bad:
        return None
    return ValueError(f"non-finite per-sample losses at batch positions {bad[:10]}: nothing was accumulated")


def compiled_backward_refusal(err: RuntimeError) -> RuntimeError | None:
    """What to do where torch.compile's backward refused to run twice (inductor's donated buffers), or None."""
    if "donated_buffer" not in str(err):
        return None
    return RuntimeError(
        "torch.compile compiled a backward that frees its buffers as it runs (donated buffers: inductor's and "
        "aot_eager's alike), so it cannot be back-propagated twice; the engine back-propagates a step more than once "
        "where the graph does not "
        "prove which sample each row belongs to (a compiled region is opaque to it: its tag passes read the rows), "
        "and the two-pass clipping modes always do. Set torch._functorch.config.donated_buffer = False before the "
        "first compiled step (it costs a little memory, no speed), or compile only parts of the model between its "
        "trainable layers. Nothing of this backward was accumulated")


def rounded_mean_refusal(loss_reduction: str, fixed_shape: bool, precision: torch.dtype | None) -> ValueError | None:
    """The refusal of a plain ``loss.backward()`` of a mean loss after a bf16/fp16 forward (``precision``), on batches
    whose size changes with the data: the mean's 1/B is rounded into each sample's low-precision gradient, so every
    sample's clipped gradient changes with the batch size (one of 512 aligned samples moved the clipped sum by 1.4 R).
    None where the mean divides by the same number at every step (fixed-shape batches), or nothing is rounded."""
    if loss_reduction != "mean" or fixed_shape or precision not in (torch.float16, torch.bfloat16):
        return None
    name = str(precision).replace("torch.", "")
    return ValueError(
        f"loss.backward() of a mean loss after a {name} forward, on batches whose size changes with the data (Poisson "
        f"sampling): the mean's 1/B is rounded into each sample's {name} gradient, so every sample's clipped gradient "
        "would change with the batch size, and one sample could move the step by more than max_grad_norm. Call "
        "engine.backward(per_sample_losses), or back-propagate loss.sum() with loss_reduction='sum', or use "
        "fixed-shape batches (max_batch_size=...), whose mean divides by the same number at every step"
    )


def rows_beyond_loader(what: str, rows: int, unit: str, limit: int) -> ValueError:
    """The refusal of a backward over more rows than the attached loader's batch had samples."""
    return ValueError(
        f"{what} {rows} {unit}, but the attached loader's batch had {limit} samples: the engine clips each "
        "row as a sample, so rows that belong to one sample (views concatenated with torch.cat([x, x_aug])) "
        "would each be clipped alone and move the model by up to (rows per sample) x R. Call the model once "
        "per view and give engine.backward one loss per sample (the sum of its views' losses). If the batch "
        "comes from another loader than the attached one, attach that loader instead (engine.detach(), then "
        "engine.attach(optimizer, data_loader=...); the epsilon assumes dptrain.data.poisson_loader batches). "
        "Nothing of this backward was accumulated"
    )
