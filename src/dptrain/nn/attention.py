"""DP version of ``nn.MultiheadAttention`` built from ``nn.Linear`` projections.

Lee & Kifer (section 5.6): the gradient of each projection weight of multi-head
attention is ``(dL/dQ)^T Q_in``, the gradient of a linear layer applied to the sequence.
So the query, key, value and output projections are ``nn.Linear`` layers applied to
batch-first ``[B, T, d]`` inputs, which the engine clips exactly; the attention itself
(scores, softmax, masks, dropout) has no parameters and mixes no samples.

``add_bias_kv``'s learned key and value tokens (``bias_k``, ``bias_v``) are each the
weight of a bias-free ``nn.Linear(1, embed_dim)`` applied to a ones input of shape
``[B, 1, 1]``: the output is the token repeated per sample, and the Linear rule gives its
exact per-sample gradient.

The state dict is ``nn.MultiheadAttention``'s: ``in_proj_weight`` packs the three
projection weights (``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when ``kdim``
or ``vdim`` differs from ``embed_dim``), ``in_proj_bias`` packs the three biases. The
same names are readable attributes, so torch's ``nn.TransformerEncoderLayer`` works
with this module in place of its ``self_attn``; ``in_proj_weight`` and ``in_proj_bias``
are packed *copies*: initialise through ``q_proj``, ``k_proj`` and ``v_proj``.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .recurrent import install_torch_name_hooks

__all__ = ["DPMultiheadAttention"]


class DPMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with exact per-sample clipping; same arguments, forward and state dict."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        # torch's flag: packed in_proj_weight in the state dict (read by nn.TransformerEncoderLayer too)
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias, **factory)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias, **factory)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias, **factory)
        if add_bias_kv:
            self.bias_k_token = nn.Linear(1, embed_dim, bias=False, **factory)
            self.bias_v_token = nn.Linear(1, embed_dim, bias=False, **factory)
        else:
            self.bias_k_token = self.bias_v_token = None
        self._reset_parameters()
        install_torch_name_hooks(self)

    def _reset_parameters(self) -> None:
        """torch's initialisation, including the fan of the packed [3E, E] weight when it is packed."""
        with torch.no_grad():
            projections = (self.q_proj, self.k_proj, self.v_proj)
            if self._qkv_same_embed_dim:
                packed = torch.empty(3 * self.embed_dim, self.embed_dim, device=self.q_proj.weight.device,
                                     dtype=self.q_proj.weight.dtype)
                nn.init.xavier_uniform_(packed)
                for proj, part in zip(projections, packed.chunk(3)):
                    proj.weight.copy_(part)
            else:
                for proj in projections:
                    nn.init.xavier_uniform_(proj.weight)
            if self.q_proj.bias is not None:
                for proj in (*projections, self.out_proj):
                    nn.init.zeros_(proj.bias)
            for token in (self.bias_k_token, self.bias_v_token):
                if token is not None:
                    token.weight.normal_(0.0, math.sqrt(1.0 / self.embed_dim))  # xavier_normal_ of a [1, 1, E]

    def extra_repr(self) -> str:
        """The options shown by ``repr(module)``, as ``nn.MultiheadAttention`` shows them."""
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.add_zero_attn:
            s += ", add_zero_attn=True"
        if self.batch_first:
            s += ", batch_first=True"
        return s

    # ------------------------------------------------------------------ torch's attributes
    @property
    def in_proj_weight(self) -> torch.Tensor | None:
        """The packed [3E, E] projection weight, as a copy (None when kdim or vdim differ)."""
        if not self._qkv_same_embed_dim:
            return None
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """The packed [3E] projection bias, as a copy (None with bias=False)."""
        if self.q_proj.bias is None:
            return None
        return torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])

    @property
    def q_proj_weight(self):
        return None if self._qkv_same_embed_dim else self.q_proj.weight

    @property
    def k_proj_weight(self):
        return None if self._qkv_same_embed_dim else self.k_proj.weight

    @property
    def v_proj_weight(self):
        return None if self._qkv_same_embed_dim else self.v_proj.weight

    @property
    def bias_k(self):
        """[1, 1, E] view of the learned key token (None without add_bias_kv)."""
        return None if self.bias_k_token is None else self.bias_k_token.weight.view(1, 1, self.embed_dim)

    @property
    def bias_v(self):
        return None if self.bias_v_token is None else self.bias_v_token.weight.view(1, 1, self.embed_dim)

    # nn.TransformerEncoderLayer's inference fast path calls it; it only reads num_heads
    merge_masks = nn.MultiheadAttention.merge_masks

    # ------------------------------------------------------------------ state dict
    def _torch_state(self, prefix, state_dict):
        own = {k[len(prefix):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]
               if k[len(prefix):].split(".")[0] in self._modules}
        out = {}
        names = ("q_proj", "k_proj", "v_proj")
        if self._qkv_same_embed_dim:
            out["in_proj_weight"] = torch.cat([own.pop(f"{n}.weight") for n in names])
        else:
            out.update({f"{n}_weight": own.pop(f"{n}.weight") for n in names})
        if f"{names[0]}.bias" in own:
            out["in_proj_bias"] = torch.cat([own.pop(f"{n}.bias") for n in names])
        for name in ("bias_k", "bias_v"):
            if f"{name}_token.weight" in own:
                out[name] = own.pop(f"{name}_token.weight").reshape(1, 1, self.embed_dim)
        out.update(own)  # out_proj.weight, out_proj.bias
        return {prefix + k: v for k, v in out.items()}

    def _from_torch_state(self, prefix, state_dict):
        def move(torch_key, parts):
            if prefix + torch_key in state_dict:
                value = state_dict.pop(prefix + torch_key)
                chunks = value.chunk(3) if len(parts) == 3 and value.shape[0] % 3 == 0 else [value]
                if len(chunks) != len(parts):  # wrong size: keep it under its name so loading reports it
                    state_dict[prefix + torch_key] = value
                    return
                for key, chunk in zip(parts, chunks):
                    state_dict[prefix + key] = chunk

        move("in_proj_weight", ["q_proj.weight", "k_proj.weight", "v_proj.weight"])
        move("in_proj_bias", ["q_proj.bias", "k_proj.bias", "v_proj.bias"])
        for name in ("q", "k", "v"):
            move(f"{name}_proj_weight", [f"{name}_proj.weight"])
        for name in ("bias_k", "bias_v"):
            if prefix + name in state_dict:
                state_dict[prefix + f"{name}_token.weight"] = state_dict.pop(prefix + name).reshape(-1, 1)

    # ------------------------------------------------------------------ forward
    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """``nn.MultiheadAttention.forward``: the same arguments and outputs ``(attn_output, attn_weights)``,
        computed by the ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` linear layers."""
        batched = self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            # the projections must see the batch first: the engine reads dim 0 as the sample index
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, _ = query.shape
        S = key.shape[1]
        H, hd = self.num_heads, self.head_dim

        key_padding_mask = _float_mask(key_padding_mask, "key_padding_mask", query.dtype,
                                       other=None if attn_mask is None else attn_mask.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                               "module method `generate_square_subsequent_mask` to create this mask.")
        # as torch: the hint replaces the mask only where no weights or padding mask need it
        causal = is_causal and key_padding_mask is None and not need_weights
        if causal:
            attn_mask = None
        else:
            attn_mask = _float_mask(attn_mask, "attn_mask", query.dtype)
        if attn_mask is not None:
            attn_mask = attn_mask.reshape(1, 1, L, S) if attn_mask.dim() == 2 else attn_mask.reshape(B, H, L, S)

        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(value)
        if self.bias_k_token is not None:
            ones = query.new_ones(B, 1, 1)
            k = torch.cat([k, self.bias_k_token(ones)], dim=1)
            v = torch.cat([v, self.bias_v_token(ones)], dim=1)
            attn_mask, key_padding_mask = _pad_last(attn_mask), _pad_last(key_padding_mask)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, self.embed_dim)], dim=1)
            attn_mask, key_padding_mask = _pad_last(attn_mask), _pad_last(key_padding_mask)
        q, k, v = (t.reshape(B, t.shape[1], H, hd).transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        if key_padding_mask is not None:
            padding = key_padding_mask.view(B, 1, 1, k.shape[2])
            attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / hd), k.transpose(-2, -1))
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            attended = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal=causal)
            weights = None
        out = self.out_proj(attended.transpose(1, 2).reshape(B, L, self.embed_dim))

        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """torch's shape checks (as ValueError with the expected shapes); True for batched input."""
        name = type(self).__name__
        if query.dim() not in (2, 3):
            raise ValueError(f"{name}: query should be unbatched 2-D or batched 3-D, got {query.dim()}-D")
        batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{name}: for {query.dim()}-D query, expected {query.dim()}-D key and value but got "
                             f"{key.dim()}-D and {value.dim()}-D")
        if key_padding_mask is not None and key_padding_mask.dim() != (2 if batched else 1):
            raise ValueError(f"{name}: key_padding_mask should be {2 if batched else 1}-D, got "
                             f"{key_padding_mask.dim()}-D")
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"{name}: expected query of embedding size {self.embed_dim}, got {query.shape[-1]}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(f"{name}: expected key and value feature sizes kdim={self.kdim}, vdim={self.vdim}; "
                             f"got {key.shape[-1]} and {value.shape[-1]}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"{name}: key's sequence and batch dims {tuple(key.shape[:-1])} do not match "
                             f"value's {tuple(value.shape[:-1])}")
        batch_dim = 0 if (self.batch_first or not batched) else 1
        seq_dim = 1 - batch_dim if batched else 0
        B = query.shape[batch_dim] if batched else 1
        L, S = query.shape[seq_dim], key.shape[seq_dim]
        if batched and key.shape[batch_dim] != B:
            raise ValueError(f"{name}: query has batch size {B} but key has {key.shape[batch_dim]}")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != ((B, S) if batched else (S,)):
            raise ValueError(f"{name}: expected key_padding_mask of shape {(B, S) if batched else (S,)}, "
                             f"got {tuple(key_padding_mask.shape)}")
        if attn_mask is not None:
            allowed = [(L, S), (B * self.num_heads, L, S)]
            if tuple(attn_mask.shape) not in allowed:
                raise ValueError(f"{name}: attn_mask must have shape {allowed[0]} or {allowed[1]} "
                                 f"(batch * num_heads, L, S); got {tuple(attn_mask.shape)}")
        return batched


def _float_mask(mask, name, dtype, other=None):
    """torch's convention: a bool mask marks positions to leave out (-inf); a float mask is added."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise ValueError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
    if other is not None and other != mask.dtype:
        warnings.warn(f"Support for mismatched {name} and attn_mask is deprecated. Use same type for both "
                      "instead.", stacklevel=3)
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask


def _pad_last(mask):
    """One more key position, not masked (for the bias token or the zero token)."""
    return None if mask is None else F.pad(mask, (0, 1))
