"""Rules for Hugging Face transformers' own layers, matched by qualified class name.

Nothing here imports transformers: a rule names its class as a string, so models from
the optional ``transformers`` extra are covered when present and nothing is paid otherwise.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys

import torch
from torch import nn

from .embedding import EmbeddingRule
from .fallback import SIDE_CHANNELS, SideChannel
from .linear import LinearRule
from .norms import AffineNormRule
from .numerics import factor_weighted_sum
from .protocol import CaptureSite, LayerDims, LayerRule
from .registry import reads_child_params, register_layer


@register_layer
class Conv1DRule(LinearRule):
    """GPT-2's ``Conv1D``: a linear layer whose weight is stored transposed, [in, out]."""

    module_types = ("transformers.pytorch_utils.Conv1D",)

    def dims(self, module, activation, output):
        return LayerDims(T=math.prod(activation.shape[1:-1]), p=module.nf, d=module.nx)

    def per_sample_grads(self, module, ops, names):
        out = super().per_sample_grads(module, ops, names)
        if "weight" in out:
            out["weight"] = out["weight"].transpose(1, 2)
        return out

    def weight_factors(self, module, ops):
        a, g = ops
        return a, g

    def clipped_grads(self, module, ops, factors):
        # the default would scale the input (the first factor of the stored [in, out] layout); scaling the
        # output gradient, as the Linear rule does, keeps its rounding under bf16/fp16
        out = super().clipped_grads(module, ops, {n: c for n, c in factors.items() if n != "weight"})
        if "weight" in factors:
            a, g = ops
            out["weight"] = factor_weighted_sum(g, a, factors["weight"]).t()
        return out


@register_layer
class HFRMSNormRule(AffineNormRule):
    """T5's RMS norm: weight * x / sqrt(mean(x^2) + eps), statistics in float32, x kept in its dtype.

    Llama's and the other decoder families' RMS norms normalise x itself in float32; they are
    recognised by structure (``norms.recognise_rms_norm``), which reproduces that rounding.
    """

    module_types = ("transformers.models.t5.modeling_t5.T5LayerNorm",)
    param_names = ("weight",)

    def dims(self, module, activation, output):
        n = module.weight.numel()
        return LayerDims(T=activation.numel() // max(1, activation.shape[0] * n), p=n, d=1, ghost_supported=False)

    def channels_last(self, module, t):
        return t

    def capture(self, module, inputs, output):
        return inputs[0].detach()

    def normalized(self, module, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        xhat = x * torch.rsqrt(variance + module.variance_epsilon)
        return xhat.to(module.weight.dtype) if module.weight.dtype in (torch.float16, torch.bfloat16) else xhat



@register_layer
class FalconLinearRule(LinearRule):
    """Falcon's ``FalconLinear``: ``input @ weight.T + bias``, an ``nn.Linear`` written out."""

    module_types = ("transformers.models.falcon.modeling_falcon.FalconLinear",)


@register_layer
class OPTPositionalEmbeddingRule(EmbeddingRule):
    """OPT's learned positions: an ``nn.Embedding`` called with the attention mask, whose ids are
    ``position_ids + 2`` (given, or the running count of attended tokens minus one, from
    ``cache_length`` on). The ids are formed as its forward forms them, then it is an embedding."""

    module_types = ("transformers.models.opt.modeling_opt.OPTLearnedPositionalEmbedding",)

    def capture_call(self, module, args, kwargs, output):
        try:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{type(module).__name__} was called with arguments its forward does not take: {err}") from None
        bound.apply_defaults()
        attention_mask = bound.arguments.get("attention_mask")
        cache_length = bound.arguments.get("cache_length", 0)
        position_ids = bound.arguments.get("position_ids")
        if position_ids is None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise ValueError(
                    f"{type(module).__name__} needs an attention mask [B, T] or position_ids: got {attention_mask!r}"
                )
            positions = torch.cumsum(attention_mask, dim=1)
            position_ids = (positions * attention_mask - 1).long()[:, cache_length:]
        return self.capture(module, (position_ids + module.offset,), output)


class TokenParamsRule(LayerRule):
    """Parameters added to a token sequence inside a bigger module: class / distillation /
    register tokens concatenated in front of the patch tokens, and absolute position
    embeddings added to the tokens, all broadcast over the batch.

    Their per-sample gradients are slices of the gradient of the sequence they end up in, read
    at the input of a submodule (``hook_target``, usually the embedding dropout): a token
    ``[1, k, D]`` placed at positions ``s:s+k`` gets ``G_i[s:s+k]``, a position embedding
    ``[1, N, D]`` over positions ``s:s+N`` gets ``G_i[s:s+N]``. Subclasses give that layout in
    ``slots``. Exact, and as cheap as a bias: nothing is kept from the forward but the layout.
    """

    captures_input = True

    def hook_target(self, module) -> nn.Module:
        """The submodule at whose input the token sequence is read (subclasses name theirs)."""
        return module.dropout

    def capture_sites(self, module):
        return [CaptureSite(self.hook_target(module))]

    def slots(self, module, tokens: torch.Tensor) -> dict[str, slice | ValueError]:
        """{parameter name: the token positions it lands on} for one call, from the hooked tensor.

        A layout this rule cannot follow is given as the ``ValueError`` to raise if that parameter
        is trainable (the capture runs while ghost differentiation has switched requires_grad off,
        so whether it is trainable is only known later).
        """
        raise NotImplementedError

    def capture(self, module, inputs, tensor):
        if tensor.dim() != 3:
            raise ValueError(
                f"{type(module).__name__}: expected the token sequence [B, N, D] at the input of "
                f"{type(self.hook_target(module)).__name__}, got shape {tuple(tensor.shape)}"
            )
        return self.slots(module, tensor)

    def dims(self, module, activation, output):
        return LayerDims(T=output.shape[1], p=output.shape[2], d=1, ghost_supported=False)

    def operands(self, module, activation, grad_output):
        return ((activation, grad_output),)

    def concat_calls(self, calls):
        return tuple(op for call in calls for op in call)  # calls may differ in layout (CrossViT branches)

    def per_sample_grads(self, module, ops, names):
        params = dict(module.named_parameters(recurse=False))
        out = {}
        for slots, g in ops:
            B = g.shape[0]
            for name, positions in slots.items():
                if name not in names:
                    continue
                if isinstance(positions, ValueError):
                    raise positions
                part = g[:, positions].reshape(B, *params[name].shape)
                out[name] = part if name not in out else out[name] + part
        for name in names:
            if name not in out:  # a parameter this call did not use (e.g. another branch's token)
                out[name] = ops[0][1].new_zeros(ops[0][1].shape[0], *params[name].shape)
        return out


def _check_positions(module, tokens: torch.Tensor, pos: torch.Tensor, start: int) -> slice | ValueError:
    """The positions ``pos`` ([1, n, D]) covers, or the refusal of a resampled (interpolated) embedding."""
    n = pos.shape[1]
    if tokens.shape[1] - start != n or tokens.shape[2] != pos.shape[2]:
        return ValueError(
            f"{type(module).__name__}: the position embedding covers {n} tokens but the sequence has "
            f"{tokens.shape[1] - start}: it was interpolated to another image size (interpolate_pos_encoding "
            "or a dynamic image size), whose per-sample gradient is not supported. Train at the configured "
            "image size, or freeze the position embedding"
        )
    return slice(start, start + n)


@register_layer
class HFViTEmbeddingsRule(TokenParamsRule):
    """Hugging Face ViT and DeiT embeddings: [CLS] (and DeiT's distillation) token, then the
    patches; the position embedding covers every token. Read at the embedding dropout."""

    module_types = (
        "transformers.models.vit.modeling_vit.ViTEmbeddings",
        "transformers.models.deit.modeling_deit.DeiTEmbeddings",
    )
    # mask_token is named so that validate() can refuse it with a reason
    param_names = ("cls_token", "distillation_token", "position_embeddings", "mask_token")

    def validate(self, module):
        mask_token = getattr(module, "mask_token", None)
        if mask_token is not None and mask_token.requires_grad:
            raise ValueError(
                f"{type(module).__name__}.mask_token replaces the patches selected by bool_masked_pos, which this "
                "rule does not see, so its per-sample gradient is not supported: freeze it "
                "(embeddings.mask_token.requires_grad_(False))"
            )

    def slots(self, module, tokens):
        out = {"cls_token": slice(0, 1)}
        start = 1
        if getattr(module, "distillation_token", None) is not None:
            out["distillation_token"] = slice(1, 2)
            start = 2
        if tokens.shape[1] < start:
            raise ValueError(
                f"{type(module).__name__}: a sequence of {tokens.shape[1]} tokens has no room for its prefix"
            )
        out["position_embeddings"] = _check_positions(module, tokens, module.position_embeddings, 0)
        return out


def _relative_bias_tables(module) -> tuple[str, ...]:
    """The weights of the relative position bias tables (``relative_attention_bias``, WavLM's ``rel_attn_embed``, LongT5's
    ``global_relative_attention_bias``) anywhere under ``module``."""
    return tuple(f"{name}.weight" for name, sub in module.named_modules()
                 if name.rsplit(".", 1)[-1].endswith(("relative_attention_bias", "rel_attn_embed"))
                 and isinstance(sub, nn.Embedding))


# A relative position bias table (an ``nn.Embedding`` looked up on bucket ids [q_len, k_len], no batch) whose bias one
# module computes and passes on to every layer (position_bias), broadcast over the batch: no layer call sees a
# per-sample gradient of the table, the enclosing module does (its inputs and outputs are per sample). It claims the
# table, and the per-sample fallback replays the whole encoder (or stack) with respect to the table only (its layers
# keep their own rules): one more forward of the encoder per step. Freeze the table to avoid it.
# T5's stacks (and those of the models built from them: mT5, LongT5, Switch Transformers) look their tables up in the
# first block and pass the bias on; they build their attention masks with a branch on the mask's values, which vmap
# cannot run, so the fallback replays them one sample at a time (a warning names them): B more forwards and backwards
# of the stack per step.
for _encoder in ("transformers.models.mpnet.modeling_mpnet.MPNetEncoder",
                 "transformers.models.t5.modeling_t5.T5Stack",
                 "transformers.models.mt5.modeling_mt5.MT5Stack",
                 "transformers.models.longt5.modeling_longt5.LongT5Stack",
                 "transformers.models.switch_transformers.modeling_switch_transformers.SwitchTransformersStack",
                 ):
    reads_child_params(_encoder, _relative_bias_tables)


def _deberta_v2_relative_params(module) -> tuple[str, ...]:
    """DeBERTa-v2's encoder with relative attention: ``rel_embeddings`` (an ``nn.Embedding`` whose weight it reads
    directly), the ``LayerNorm`` it runs on that table (``norm_rel_ebd="layer_norm"``) and the projections of the table
    in every layer's attention: with ``share_att_key`` the layer's own ``query_proj`` / ``key_proj`` (also called on
    the tokens), otherwise ``pos_query_proj`` / ``pos_key_proj``. The table is ``[1, 2k, d]``, projected once and
    ``.repeat``ed over the batch: no call of these layers has per-sample rows. The encoder claims every trainable
    parameter under them (LoRA adapters included) and its replay gives their per-sample gradients."""
    if not getattr(module, "relative_attention", False):
        return ()
    children = ["rel_embeddings"] + (["LayerNorm"] if "layer_norm" in getattr(module, "norm_rel_ebd", ()) else [])
    for i, layer in enumerate(module.layer):
        attention = getattr(getattr(layer, "attention", None), "self", None)
        if attention is None:
            continue
        if getattr(attention, "share_att_key", False):
            children += [f"layer.{i}.attention.self.{n}" for n in ("query_proj", "key_proj")]
        else:
            children += [f"layer.{i}.attention.self.{n}" for n in ("pos_query_proj", "pos_key_proj")
                         if isinstance(getattr(attention, n, None), nn.Module)]
    return tuple(f"{child}.{name}" for child in children for name, _ in module.get_submodule(child).named_parameters())


# DeBERTa (v1) with relative attention: its encoder reads its ``rel_embeddings`` weight itself and hands the table to
# every layer, whose attention projects it ([1, 2k, d], broadcast over the batch: those projections keep their rules);
# the encoder claims the table, and its replay gives the table's per-sample gradients.
reads_child_params("transformers.models.deberta.modeling_deberta.DebertaEncoder",
                   lambda module: _parameters_under("rel_embeddings")(module)
                   if getattr(module, "relative_attention", False) else ())
# DeBERTa-v2 (and DeBERTa-v3, the same classes) with relative attention: the encoder replays itself per sample with
# respect to its relative table, that table's LayerNorm and the projections the table goes through (module 4 + 5:
# one more forward of the whole encoder per step, vectorised over the batch, and a per-sample gradient of those
# parameters; plan() lists the encoder as a fallback layer of their size). Freeze them to avoid it.
reads_child_params("transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder", _deberta_v2_relative_params)


def _wavlm_attention_params(module) -> tuple[str, ...]:
    """WavLM's encoder: layer 0's attention looks up ``rel_attn_embed`` and passes the bias on to the later layers as
    ``position_bias`` [batch * heads, q, k] (not batch first, so no attention call can be replayed alone); every
    attention also runs F.multi_head_attention_forward on its projections' weights and biases, never calling them,
    and gates the bias with its own ``gru_rel_pos_const``. The encoder claims all of these (``gru_rel_pos_linear``,
    called on the hidden states, keeps its rule), and its replay gives their per-sample gradients."""
    names = []
    for i, layer in enumerate(module.layers):
        attention = layer.attention
        names += [f"layers.{i}.attention.{n}" for n in
                  _parameters_under("q_proj", "k_proj", "v_proj", "out_proj", "rel_attn_embed")(attention)]
        names += [f"layers.{i}.attention.{n}" for n, _ in attention.named_parameters(recurse=False)]
    return tuple(names)
def _disentangled_encoder_params(module) -> tuple[str, ...]:
    """A DeBERTa-v2-style encoder with relative attention (SEW-D's): it reads its ``rel_embeddings`` table itself, normalises
    it with its own ``LayerNorm`` ([positions, d], no batch) and hands it to every layer, whose attention projects it
    with ``query_proj`` / ``key_proj`` (or ``pos_query_proj`` / ``pos_key_proj``) on [1, positions, d], broadcast over
    the batch, besides projecting the hidden states. The encoder claims the table, the norm and those projections,
    and its replay gives their per-sample gradients through both uses (the layers' other parameters keep their
    rules)."""
    if getattr(module, "rel_embeddings", None) is None:
        return ()
    names = _parameters_under("rel_embeddings", "LayerNorm")(module)
    for i, layer in enumerate(module.layer):
        names += tuple(f"layer.{i}.attention.self.{n}" for n in _parameters_under(
            "query_proj", "key_proj", "pos_query_proj", "pos_key_proj")(layer.attention.self))
    return names


# (DeBERTa-v2's own encoder claims only the projections the table goes through: _deberta_v2_relative_params above)
reads_child_params("transformers.models.sew_d.modeling_sew_d.SEWDTransformerEncoder", _disentangled_encoder_params)
# UMT5's attention looks up its own table in every layer and uses the bias itself: the attention's replay suffices.
reads_child_params("transformers.models.umt5.modeling_umt5.UMT5Attention", _relative_bias_tables)


def _parameters_under(*children: str):
    """Every trainable parameter under the named children (dotted), for a module that reads them in its own forward."""
    def names(module) -> tuple[str, ...]:
        return tuple(f"{child}.{name}" for child in children if isinstance(getattr(module, child, None), nn.Module)
                     for name, _ in getattr(module, child).named_parameters())
    return names


reads_child_params("transformers.models.wavlm.modeling_wavlm.WavLMEncoder", _wavlm_attention_params)
reads_child_params("transformers.models.wavlm.modeling_wavlm.WavLMEncoderStableLayerNorm", _wavlm_attention_params)
# GPT-NeoX-Japanese's attention returns its dense_bias, which the layer adds to the attention's output.
reads_child_params("transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseLayer",
                   lambda module: ("attention.dense_bias",) if getattr(module.attention, "dense_bias", None) is not None
                   else ())
# JetMoE's mixture of attention experts (JetMoeMoA) is never called: the attention runs its map and reduce methods,
# which read the experts' bias and call its router and parallel experts on the batch's tokens flattened together.
# Its experts (JetMoeParallelExperts) are called on the tokens sorted by expert with the count of each expert's tokens
# in the whole batch, which no replay of one sample's rows can take: the mixtures (attention and MLP, whose inputs and
# outputs are per sample) claim them, and the fallback replays each mixture per sample.
reads_child_params("transformers.models.jetmoe.modeling_jetmoe.JetMoeAttention", _parameters_under("experts"))
reads_child_params("transformers.models.jetmoe.modeling_jetmoe.JetMoeMoE",
                   _parameters_under("input_linear", "output_linear", "router"))
# Children called on a table without the batch (or on nothing), whose output the attention adds to every sample's scores: Swin V2's
# continuous_position_bias_mlp (run on the relative coordinates [1, 2W-1, 2W-1, 2]) and the Conformer's linear_pos
# (on the relative position embeddings [1, 2T-1, d]). The attention (per-sample inputs and outputs; Swin V2's on its
# windows folded into the batch, which the fallback regroups by sample) claims them.
reads_child_params("transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention",
                   _parameters_under("continuous_position_bias_mlp"))
# Swin's (and Donut-Swin's) relative position bias is a module called with no argument at all, which returns its table
# gathered into [1, heads, N, N], broadcast over the batch times the windows: its attention claims it the same way.
reads_child_params("transformers.models.swin.modeling_swin.SwinAttention",
                   _parameters_under("relative_position_bias"))
reads_child_params("transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer.Wav2Vec2ConformerSelfAttention",
                   _parameters_under("linear_pos"))
# Learned positions looked up on [T] ids (Blenderbot, Blenderbot-small, BigBird-Pegasus): the table's rows [T, d] are
# added to the token embeddings [B, T, d], broadcast over the batch, so the lookup's rows are shared by every sample.
# The encoder and the decoder (per-sample inputs and outputs) that add them claim the table; the fallback replays them
# with respect to it alone (their layers keep their rules).
for _family, _prefix in (("blenderbot", "Blenderbot"), ("blenderbot_small", "BlenderbotSmall"),
                         ("bigbird_pegasus", "BigBirdPegasus")):
    for _part in ("Encoder", "Decoder"):
        reads_child_params(f"transformers.models.{_family}.modeling_{_family}.{_prefix}{_part}",
                           _parameters_under("embed_positions"))
# (XLNet's relative attention, run sequence-first inside a batch-first model, is the fallback's own: it finds the batch
# axis of each argument and output, layers/fallback/batch_axes.py)
# Short convolutions and delta attention run causal_conv1d_fn on conv.weight / conv1d.weight (and bias) themselves.
reads_child_params("transformers.models.lfm3.modeling_lfm3.Lfm3ShortConv", _parameters_under("conv"))
reads_child_params("transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
                   _parameters_under("conv1d"))
reads_child_params("transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridDeltaAttention",
                   _parameters_under("conv1d"))


def _state_space_mixer(module) -> bool:
    """A Mamba-style selective state-space mixer or gated delta net (Mamba, Mamba-2, FalconMamba, Jamba, Bamba,
    Falcon-H1, Qwen3.5's and OLMo-hybrid's linear attention): its own ``A_log``, and a scan that reads its
    children's weights directly (``conv1d.weight`` through ``causal_conv1d_fn``, ``dt_proj.bias``) besides calling
    them. (Kimi-linear's and Bailing-hybrid's delta attention keep ``A_log`` in their forget gate, which the fallback
    replays on its own: only their ``conv1d`` is declared, above.)"""
    return module._parameters.get("A_log") is not None


def _every_descendant_parameter(module) -> tuple[str, ...]:
    return tuple(f"{child}.{name}" for child, sub in module.named_children() for name, _ in sub.named_parameters())


# The mixer's replay per sample gives every one of its parameters' per-sample gradients, wherever the scan reads them.
reads_child_params(_state_space_mixer, _every_descendant_parameter)


class _OutputCollector(SideChannel):
    """transformers' collector of hidden states and attentions (``output_hidden_states=True``,
    ``output_attentions=True``, and heads that sum the layers' hidden states): hooks on the layers append their
    outputs to lists held in a context variable for the model call. Those a module the fallback replays appended
    during its call left it other than through its output (``FallbackRule._guard_escaped``)."""

    @staticmethod
    def _collector():
        capturing = sys.modules.get("transformers.utils.output_capturing")
        active = getattr(capturing, "_active_collector", None)
        return active.get() if active is not None else None

    def snapshot(self):
        collector = self._collector()
        if not isinstance(collector, dict):
            return None
        return collector, {key: len(value) for key, value in collector.items() if isinstance(value, list)}

    def escaped(self, state) -> list:
        if state is None:
            return []
        collector, sizes = state
        out = []
        for key, size in sizes.items():
            entries = collector.get(key)
            if isinstance(entries, list):
                out += [(entries[j], functools.partial(entries.__setitem__, j)) for j in range(size, len(entries))]
        return out


SIDE_CHANNELS.append(_OutputCollector())
