"""Which modules the fallback takes: those it refuses (``fallback_refusal``), the engine's warning naming those it
takes (``fallback_warning``; which they are is ``layers.resolve.fallback_modules``), and the parameters
``nn.MultiheadAttention`` reads from its ``out_proj`` (claimed, so that the fallback replays the attention)."""
from __future__ import annotations

from torch import nn

from ..registry import reads_child_params


def fallback_refusal(module: nn.Module) -> str | None:
    """Why the fallback does not take ``module`` (``None``: it does).

    torch's recurrent layers, and ``nn.MultiheadAttention`` without ``batch_first=True``, run sequence-first and
    return states without the batch first (``h_n``) or outputs in two layouts (the attention ``[L, B, E]``, its
    weights ``[B, L, S]``), which the fallback cannot take; ``dptrain.fix`` swaps them for versions built from layers
    with exact rules. (``nn.MultiheadAttention(batch_first=True)`` it takes: ``_multihead_attention_reads``.) A
    parameter container (``nn.ParameterDict``, as PEFT's embedding adapters use) is never called.
    """
    if isinstance(module, nn.RNNBase) or (isinstance(module, nn.MultiheadAttention) and not module.batch_first):
        also = " (or build it with batch_first=True)" if isinstance(module, nn.MultiheadAttention) else ""
        return (
            f"the per-sample fallback does not take it (sequence-first, outputs without the batch first); "
            f"dptrain.fix(model) swaps {type(module).__name__} for a version with exact rules (dptrain.nn){also}"
        )
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "it normalises with statistics of the whole batch in training, which mixes samples"
    if isinstance(module, (nn.ParameterDict, nn.ParameterList)):
        return "its parameters are read by the module that holds it, never in a call of its own"
    return None


def fallback_warning(names: list[str]) -> str | None:
    """The engine's one-time warning for the layers that use the fallback (``None`` if none do)."""
    if not names:
        return None
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{len(names)} layer(s) have no rule and use the per-sample fallback: {shown}. It is exact but replays "
        "each call with torch.func (one more forward of the layer and a per-sample gradient of its parameters, "
        "B times their size); register a rule with dptrain.register_layer for speed, or pass "
        "allow_fallback=False to refuse such layers"
    )


def _multihead_attention_reads(module: nn.MultiheadAttention) -> tuple[str, ...]:
    """``nn.MultiheadAttention`` runs ``F.multi_head_attention_forward`` on its own projections and on its
    ``out_proj``'s weight and bias, never calling ``out_proj``: it claims them, and the fallback replays the attention
    (an attention-pooling head's: SigLIP's). Only with ``batch_first=True`` (``fallback_refusal``); ``dptrain.fix``
    swaps it for ``dptrain.nn.DPMultiheadAttention``, whose layers have rules (ghost norms), either way."""
    return tuple(f"out_proj.{name}" for name, _ in module.out_proj.named_parameters())


reads_child_params(lambda m: isinstance(m, nn.MultiheadAttention), _multihead_attention_reads)
