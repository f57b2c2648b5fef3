"""Per-sample losses for token-level models (language models, token classifiers).

``engine.backward`` clips each *sample*, so a language model needs one loss per sequence,
not one per token nor one per batch. A sequence's loss is the sum of its token losses
(``reduction="sum"``) or their mean over its valid tokens (``reduction="mean"``). Tokens
labelled ``ignore_index`` (padding, prompt tokens, unmasked positions of a masked LM) or
masked out by an attention mask count nowhere; a sequence without a valid token gets loss 0,
and so a zero gradient.

Note the difference with the usual batch loss: ``F.cross_entropy(..., reduction="mean")``
averages over all valid tokens of the *batch*, which weights long sequences more and ties
the samples together; per-sequence means keep every sample's loss its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks

LOSS_REDUCTIONS = ("mean", "sum")  # of a loss over its tokens or samples: the one list of them


def token_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    attention_mask: torch.Tensor | None = None,
    shift: bool = False,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses [B, T'], valid [B, T']): cross entropy per token, 0 where the token is not valid.

    ``logits`` are [B, T, V] and ``labels`` [B, T]. ``shift=True`` is the causal-LM convention
    (labels are the inputs; position t predicts token t + 1): the last logit and the first
    label are dropped, so T' = T - 1. ``attention_mask`` [B, T] (1 = real token) marks further
    tokens as not valid; it refers to the label positions, so it is shifted with the labels.
    """
    if logits.dim() < 3:
        raise ValueError(f"logits must be [B, T, V] (or [B, ..., V]), got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match logits of shape {tuple(logits.shape)}")
    if attention_mask is not None and attention_mask.shape != labels.shape:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not match labels of shape "
            f"{tuple(labels.shape)}"
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
        attention_mask = attention_mask[:, 1:] if attention_mask is not None else None
    valid = labels != ignore_index
    if attention_mask is not None:
        valid = valid & attention_mask.bool()
    labels = labels.masked_fill(~valid, ignore_index)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # as Hugging Face does: the softmax in half precision loses too much
    V = logits.shape[-1]
    losses = F.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing,
    )
    return losses.reshape(labels.shape), valid


def sequence_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    attention_mask: torch.Tensor | None = None,
    reduction: str = "sum",
    shift: bool = False,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """[B] per-sequence losses: each sequence's token losses summed, or averaged over its valid tokens.

    For a causal LM trained on its own inputs (``labels = input_ids``) pass ``shift=True``; for
    a masked LM, a token classifier or an encoder-decoder whose labels are already aligned with
    the logits, ``shift=False`` (the default).
    """
    _checks.choice("reduction", reduction, LOSS_REDUCTIONS)
    losses, valid = token_losses(
        logits, labels, ignore_index=ignore_index, attention_mask=attention_mask, shift=shift,
        label_smoothing=label_smoothing,
    )
    B = losses.shape[0]
    total = losses.reshape(B, -1).sum(1)
    if reduction == "sum":
        return total
    count = valid.reshape(B, -1).sum(1)
    return total / count.clamp(min=1).to(total.dtype)  # no valid token: 0 / 1 = 0
