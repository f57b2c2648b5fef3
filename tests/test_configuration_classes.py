"""The classes behind the refusals that the configurations users turn on met (issue 33), on random models of each
class: exact in every clipping mode and on both backward paths (float64, noise 0, against the one-sample-at-a-time
oracle), or refused naming a module where no sound per-sample gradient can be read.

- a table broadcast over the batch (a layer's output of batch size 1) written in place before it meets the batch
  (DeBERTa divides its projected relative table, Longformer its global queries): ``broadcast._write_table``;
- a module that computes a bias from its table alone, with no tensor argument (BEiT's relative position bias),
  expanded over the batch as a broadcast table;
- a tensor depending on a module's parameters inside an object of its output that torch's pytree does not flatten (a
  cache of keys and values left on): exact while the loss does not use it, refused when it does;
- ``nn.MultiheadAttention(batch_first=True)`` called in an attention-pooling head (SigLIP's), through the fallback;
- a module run sequence-first in a batch-first model whose first row is apart by the data (a position every sample
  masks: left padding), which must not pass for rows that are the samples (XLNet at batch 3);
- an argument as long as the batch that every sample shares (timm EVA's rotary table [N, d] at B = N, a [T, T]
  mask at B = T), which must not be taken for one row per sample.

Each draws its shapes with B often equal to another size (T, heads, windows), one or two batches per step.
"""
from __future__ import annotations

import functools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import dptrain
from helpers import (
    MODES,
    SINGLE_BACKWARD_MODES,
    Case,
    assert_matches,
    assert_refused_naming_a_layer,
    default_dtype,
    engine_clipped_sum,
    reweighted_reference,
    weighted_oracle,
    with_oracle,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*use the per-sample fallback:UserWarning",
                                        "ignore:.*replays it one sample at a time:UserWarning")

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEEDS = st.integers(0, 2 ** 32 - 1)
D = 8  # features; two heads of 4


def _losses(model, x, y, weights):
    return F.cross_entropy(model(x), y, reduction="none") * weights


def _batches(rng: random.Random, g: torch.Generator, B: int, T: int, two: bool, ids: int | None = None):
    """One or two batches (the second of another size), some samples of loss weight 0 in a third of them."""
    out = []
    for size in ([B, B + 1] if two else [B]):
        x = (torch.randint(0, ids, (size, T), generator=g) if ids is not None
             else 2 * torch.randn(size, T, D, generator=g, dtype=torch.float64))
        weights = torch.ones(size, dtype=torch.float64)
        if size > 1 and rng.random() < 1 / 3:
            weights[rng.randrange(1, size):] = 0.0
        out.append((x, torch.randint(0, 3, (size,), generator=g), weights))
    return out


def _check(model: nn.Module, batches: list, refused: bool, what: str, seed: int) -> None:
    """Exact in every mode over the step's batches, or refused naming a layer; each single-backward mode through
    engine.backward or a plain loss.backward() (summed or averaged), drawn."""
    joined = tuple(torch.cat(t) for t in zip(*batches))
    case = Case(model, _losses, joined)
    R, ref = (1.0, None) if refused else weighted_oracle(case)
    rng = random.Random(seed + 1)
    paths = [(m, "engine" if m not in SINGLE_BACKWARD_MODES else rng.choice(["engine", "sum", "mean"])) for m in MODES]
    with default_dtype(torch.float64):
        for mode, path in paths:
            run = functools.partial(engine_clipped_sum, case, quiet=True, batches=batches, mode=mode, path=path,
                                    max_grad_norm=R)
            if refused:
                assert_refused_naming_a_layer(case, run)
            else:
                assert_matches(run(), ref, what=f"{what} {mode} {path}")


# ------------------------------------------------------------------------------------------ a table written in place
class TableNet(nn.Module):
    """Features [B, T, d] and a table [1, T, d] from a layer called on a shared input (an embedding on [1, T] ids, or
    a Linear on a relative table of the model's own, DeBERTa's ``pos_q_proj(rel_embeddings)``), written in place by
    ``writes`` (through the table's name, after views that split it into heads), then used against the batch:
    added to the features, or as the keys of per-sample queries (``matmul``)."""

    WRITES = {
        "divided": lambda t: t.__itruediv__(1.7),
        "scaled per feature": lambda t: t.mul_(torch.linspace(0.5, 1.5, t.shape[-1], dtype=t.dtype)),
        "shifted": lambda t: t.add_(0.3),
        "one column set": lambda t: t.__setitem__((..., 0), 0.25),
        "clamped": lambda t: t.clamp_(-0.8, 0.8),
    }

    def __init__(self, source: str, T: int, split: bool, writes: list[str], use: str, alias, again=None):
        super().__init__()
        self.source, self.split, self.writes, self.use, self.alias = source, split, writes, use, alias
        self.again = again
        self.features = nn.Linear(D, D)
        if source == "embedding":
            self.table = nn.Embedding(T + 2, D)
        else:
            self.relative = nn.Parameter(torch.randn(T, D))  # the model's own table, read directly: frozen below
            self.table = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.features(x)
        if self.source == "embedding":
            table = self.table(torch.arange(T, device=x.device)[None])
        else:
            table = self.table(self.relative[:T].unsqueeze(0))
        t = table.view(table.size()[:-1] + (2, -1)).permute(0, 2, 1, 3) if self.split else table  # [1, 2, T, 4]
        for k, write in enumerate(self.writes):
            if self.alias == k:  # the table written through a view of it as a whole: refused
                table[0, 0] *= 2
            self.WRITES[write](t)
        if self.split:
            t = t.permute(0, 2, 1, 3).reshape(1, T, D)
        if self.again:  # written again through what was made of it after the first writes
            self.WRITES[self.again](t)
        if self.use == "added":
            h = torch.tanh(h + t)
        else:  # per-sample queries against the table's rows
            scores = torch.softmax(h @ t.transpose(-1, -2) / math.sqrt(D), -1)  # [B, T, T]
            h = torch.tanh(h + scores @ t)
        return self.head(h.mean(1))


def random_table_net(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    T = rng.randint(1, 4)
    B = rng.choice([T, T, 2, 3, 4])
    split = rng.random() < 0.5
    writes = rng.sample(list(TableNet.WRITES), rng.randint(1, 3))
    alias = rng.randrange(len(writes)) if rng.random() < 0.2 else None  # before which write
    again = rng.choice(list(TableNet.WRITES)) if rng.random() < 0.3 else None
    model = TableNet(rng.choice(["embedding", "projected"]), T, split, writes, rng.choice(["added", "keys"]), alias,
                     again)
    if model.source == "projected":
        model.relative.requires_grad_(False)
    model = model.double()
    what = (f"seed {seed}: {model.source} table, split {split}, writes {writes} then {again}, {model.use}, alias "
            f"{alias}, B={B} T={T}")
    return model, _batches(rng, g, B, T, rng.random() < 0.5), alias is not None, what


@SETTINGS
@given(seed=SEEDS)
@example(seed=3)
def test_a_broadcast_table_written_in_place_is_exact_or_refused_when_written_around_its_rows(seed):
    model, batches, refused, what = random_table_net(seed)
    _check(model, batches, refused, what, seed)


# ------------------------------------------------------------------------------------------ a bias from its table alone
class RelativeBias(nn.Module):
    """A relative position bias computed from its table alone (BEiT's): called with the window size, no tensor;
    returns [1, heads, T, T]."""

    def __init__(self, heads: int, T: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * T - 1, heads))
        position = torch.arange(T)
        self.register_buffer("index", (position[:, None] - position[None, :] + T - 1), persistent=False)

    def forward(self, T: int):
        return self.table[self.index[:T, :T]].permute(2, 0, 1).unsqueeze(0)


class BiasedAttention(nn.Module):
    """Attention whose scores get a relative bias: its own, or one shared by the model (BEiT's shared bias), added to
    the scores, to a mask first, or given to scaled_dot_product_attention. ``windows``: run on windows folded into
    the batch, the bias broadcast over B x windows (refused: its one row meets no batch)."""

    def __init__(self, heads: int, T: int, own: bool, how: str, windows: int):
        super().__init__()
        self.heads, self.how, self.windows = heads, how, windows
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.bias = RelativeBias(heads, T // windows) if own else None

    def forward(self, h, shared=None):
        B, T, _ = h.shape
        W = self.windows
        h = h.reshape(B * W, T // W, D)
        n = T // W
        q, k, v = self.qkv(h).reshape(B * W, n, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias(n) if self.bias is not None else shared
        if self.how == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            if self.how == "masked":
                causal = torch.full((n, n), -1e4, dtype=h.dtype).triu(1)
                bias = bias + causal
            scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads) + bias
            out = scores.softmax(-1) @ v
        return self.out(out.transpose(1, 2).reshape(B, T, D))


class BiasNet(nn.Module):
    def __init__(self, heads: int, T: int, layers: int, shared: bool, how: str, windows: int):
        super().__init__()
        self.shared = RelativeBias(heads, T // windows) if shared else None
        self.blocks = nn.ModuleList(BiasedAttention(heads, T, not shared, how, windows) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, x):
        h = x
        n = x.shape[1] // self.blocks[0].windows
        bias = self.shared(n) if self.shared is not None else None
        for block in self.blocks:
            h = h + block(self.norm(h), bias)
        return self.head(h.mean(1))


def random_bias_net(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    windows = 2 if rng.random() < 0.2 else 1
    T = windows * rng.randint(1, 3)
    heads = rng.choice([1, 2])
    B = rng.choice([T, heads, 2, 3])
    model = BiasNet(heads, T, rng.randint(1, 2), rng.random() < 0.4, rng.choice(["added", "masked", "sdpa"]),
                    windows).double()
    # over windows folded into the batch the bias's one row is shared by every sample: refused, naming its module
    batches = _batches(rng, g, B, T, rng.random() < 0.5)
    # (one key: softmax gives the bias no gradient; one sample of non-zero weight per call: its row is its own)
    refused = windows > 1 and T // windows > 1 and any(int((b[2] != 0).sum()) > 1 for b in batches)
    what = (f"seed {seed}: heads {heads}, {len(model.blocks)} blocks, shared {model.shared is not None}, "
            f"{model.blocks[0].how}, windows {windows}, B={B} T={T}")
    return model, batches, refused, what


@SETTINGS
@given(seed=SEEDS)
def test_a_bias_computed_from_its_table_alone_is_exact(seed):
    model, batches, refused, what = random_bias_net(seed)
    _check(model, batches, refused, what, seed)


# ------------------------------------------------------------------------------------------ tensors hidden in an object
class Cache:
    """A cache of keys and values as transformers keeps one: objects torch's pytree does not flatten."""

    class Layer:
        def __init__(self, keys, values):
            self.keys, self.values = keys, values

    def __init__(self):
        self.layers: list = []
        self.seen = {"tokens": 0}


class CachingBlock(nn.Module):
    """Its own gate and projections, and a cache of the keys and values it computed (the values depend on the gate),
    returned in a tuple with the features, or in a dict; optionally the same cache object holds them across blocks."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.k, self.v = nn.Linear(D, D), nn.Linear(D, D)
        self.gate = nn.Parameter(torch.randn(D))

    def forward(self, h, cache=None):
        cache = Cache() if cache is None else cache
        keys, values = self.k(h), torch.tanh(self.v(h)) * self.gate
        cache.layers.append(Cache.Layer(keys, values))
        cache.seen["tokens"] += h.shape[1]
        scores = torch.softmax(h @ keys.transpose(1, 2) / math.sqrt(D), -1)
        out = h + (scores @ values) * torch.sigmoid(self.gate)
        return {"hidden": out, "cache": cache} if self.kind == "dict" else (out, cache)


class CacheNet(nn.Module):
    def __init__(self, blocks: int, kind: str, shared: bool, uses_cache: bool):
        super().__init__()
        self.shared, self.uses_cache = shared, uses_cache
        self.blocks = nn.ModuleList(CachingBlock(kind) for _ in range(blocks))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h, cache = x, None
        for block in self.blocks:
            out = block(h, cache if self.shared else None)
            h, cache = (out["hidden"], out["cache"]) if isinstance(out, dict) else out
        if self.uses_cache:  # a loss on the cache's values: refused, its gradient would miss the gate's part
            h = h + cache.layers[-1].values
        return self.head(h.mean(1))


def random_cache_net(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    T = rng.randint(1, 4)
    B = rng.choice([T, 2, 3])
    uses = rng.random() < 0.25
    model = CacheNet(rng.randint(1, 2), rng.choice(["tuple", "dict"]), rng.random() < 0.5, uses).double()
    what = f"seed {seed}: {len(model.blocks)} blocks, shared cache {model.shared}, loss on it {uses}, B={B} T={T}"
    return model, _batches(rng, g, B, T, rng.random() < 0.5), uses, what


@SETTINGS
@given(seed=SEEDS)
def test_a_cache_the_loss_does_not_use_is_exact_and_one_it_uses_is_refused(seed):
    model, batches, refused, what = random_cache_net(seed)
    _check(model, batches, refused, what, seed)


# ------------------------------------------------------------------------------------------ an attention-pooling head
class PoolingHead(nn.Module):
    """SigLIP's head: learned probes repeated over the batch attend to the tokens through nn.MultiheadAttention
    (batch first), then a residual MLP."""

    def __init__(self, probes: int, heads: int, options: dict, expand: bool):
        super().__init__()
        self.expand = expand
        self.probe = nn.Parameter(torch.randn(1, probes, D))
        self.attention = nn.MultiheadAttention(D, heads, batch_first=True, **options)
        self.norm, self.mlp = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, h, pad=None):
        B = h.shape[0]
        probe = self.probe.expand(B, -1, -1) if self.expand else self.probe.repeat(B, 1, 1)
        out = self.attention(probe, h, h, key_padding_mask=pad)[0]
        out = out + self.mlp(self.norm(out))
        return out.mean(1)


class PooledNet(nn.Module):
    def __init__(self, probes, heads, options, expand, padded):
        super().__init__()
        self.padded = padded
        self.embed, self.pool, self.head = nn.Linear(D, D), PoolingHead(probes, heads, options, expand), nn.Linear(D, 3)

    def forward(self, x):
        pad = None
        if self.padded:  # each sample's last tokens are padding, by its data (never all of them)
            pad = (x[..., 0] > 1.0) & (torch.arange(x.shape[1]) > 0)
        return self.head(self.pool(torch.tanh(self.embed(x)), pad))


def random_pooled_net(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    T = rng.randint(1, 4)
    heads = rng.choice([1, 2])
    B = rng.choice([T, heads, 2, 3])
    options = {"bias": rng.random() < 0.8, "add_bias_kv": rng.random() < 0.3, "add_zero_attn": rng.random() < 0.3}
    model = PooledNet(rng.randint(1, 2), heads, options, rng.random() < 0.5, rng.random() < 0.3).double()
    what = f"seed {seed}: heads {heads}, {options}, padded {model.padded}, B={B} T={T}"
    return model, _batches(rng, g, B, T, rng.random() < 0.5), False, what


@SETTINGS
@given(seed=SEEDS)
def test_multihead_attention_in_a_pooling_head_is_exact(seed):
    model, batches, refused, what = random_pooled_net(seed)
    _check(model, batches, refused, what, seed)


def test_sequence_first_multihead_attention_is_refused_naming_it_and_the_fix():
    model = nn.Sequential(nn.Linear(D, D), nn.MultiheadAttention(D, 2))
    with pytest.raises(ValueError, match=r"(?s)1 \(MultiheadAttention\).*dptrain.fix\(model\).*batch_first=True"):
        dptrain.PrivacyEngine(model, batch_size=2, sample_size=10, noise_multiplier=0.0, max_grad_norm=1.0)


# ------------------------------------------------------------------------------------------ row 0 apart by the data
class SequenceFirstAttention(nn.Module):
    """XLNet's relative attention, in miniature: called on h [T, B, d] with a mask [T, T, B] (1: blocked), own
    biases; returns (out [T, B, d], None) or the tensor alone."""

    def __init__(self, tuple_out: bool):
        super().__init__()
        self.tuple_out = tuple_out
        self.qkv = nn.Parameter(torch.randn(3, D, D) / math.sqrt(D))
        self.r_bias = nn.Parameter(0.5 * torch.randn(D))

    def forward(self, h, mask):
        q = torch.einsum("tbd,de->tbe", h, self.qkv[0]) + self.r_bias
        k = torch.einsum("tbd,de->tbe", h, self.qkv[1])
        v = torch.einsum("tbd,de->tbe", h, self.qkv[2])
        scores = torch.einsum("ibd,jbd->ijb", q, k) / math.sqrt(D) - 1e4 * mask
        out = h + torch.einsum("ijb,jbd->ibd", scores.softmax(1), v)
        return (out, None) if self.tuple_out else out


class PaddedNet(nn.Module):
    """Token ids, left padding read from the ids (id 0: padding), a mask with each token allowed to see itself."""

    def __init__(self, tuple_out: bool):
        super().__init__()
        self.embed = nn.Embedding(5, D)
        self.attention = SequenceFirstAttention(tuple_out)
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        T = ids.shape[1]
        pad = (ids == 0).T.to(torch.float64)  # [T, B]
        mask = pad[None, :, :].expand(T, T, -1) * (1 - torch.eye(T, dtype=torch.float64))[:, :, None]
        out = self.attention(self.embed(ids).transpose(0, 1), mask)
        out = out[0] if isinstance(out, tuple) else out
        return self.head(out[-1])  # the last token (left padding: a real one)


def random_padded_net(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    T = rng.randint(2, 5)
    B = rng.choice([T, 2, 3, 3])
    model = PaddedNet(rng.random() < 0.5).double()
    batches = _batches(rng, g, B, T, rng.random() < 0.5, ids=5)
    for x, _, _ in batches:  # (warm: a batch whose first token some sample keeps, then one that every sample pads)
        every = rng.random() < 0.6  # every sample padded at the front (padding to a fixed length), else some
        x[x == 0] = 1
        for i in range(x.shape[0]):
            pads = rng.randint(1 if every else 0, T - 1)
            x[i, :pads] = 0
    what = f"seed {seed}: tuple {model.attention.tuple_out}, B={B} T={T}, ids {[b[0].tolist() for b in batches]}"
    return model, batches, False, what


@SETTINGS
@given(seed=SEEDS)
@example(seed=1)
def test_a_sequence_first_module_with_its_first_row_apart_by_the_data_is_exact(seed):
    model, batches, refused, what = random_padded_net(seed)
    _check(model, batches, refused, what, seed)


# ------------------------------------------------------------------------------------------ the real models
REAL = {  # issue 33's refusals, each now exact (tests/zoo_configs.py builds them as the configurations sweep does)
    "beit": "hf/beit/relative position bias (use_relative_position_bias)",
    "xlnet": "hf/xlnet/padded on the left (every sample)",
    "t5": "hf/t5/cache left on (use_cache=True, T5ForConditionalGeneration)",
    "deberta": "hf/deberta/relative attention (relative_attention, pos_att_type c2p and p2c)",
    "longformer": "hf/longformer/padded on the right",  # global attention on the first token
    "siglip": "hf/siglip/without dptrain.fix (torch's MultiheadAttention or RNN kept)",
}
# computing in float32 inside (T5's and DeBERTa's norms, Longformer's softmax): a backward that scales the gradients
# (the two-pass modes' second one, of sum_i C_i L_i; the mean of the losses) rounds there differently from the
# oracle: exact to float32 precision (and the two-pass modes exactly the re-weighted backward); the others float64
FLOAT32_INSIDE = {"t5", "deberta", "longformer"}


@functools.cache
def _real(name: str):
    import zoo_configs
    return with_oracle(lambda: zoo_configs.CASES["hf"](zoo_configs.configuration(REAL[name])))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("mode,path", [(m, "engine") for m in MODES] + [("bk-mixopt", "mean"), ("per-sample", "sum")])
@pytest.mark.parametrize("name", list(REAL))
def test_the_refused_configurations_are_exact(name, mode, path):
    pytest.importorskip("transformers")
    case, R, ref = _real(name)
    got = engine_clipped_sum(case, quiet=True, mode=mode, path=path, max_grad_norm=R)
    if name in FLOAT32_INSIDE and path == "mean":  # (the backward of the mean scales by 1/B inside, in float32)
        assert_matches(got, ref, rtol=1e-5, what=f"{name} {mode} {path}: float32 inside the model")
        return
    if name in FLOAT32_INSIDE and dptrain.RECIPES[mode].two_pass:
        # the second backward of sum_i C_i L_i rounds the scaled gradients in float32 where the oracle scales after
        # rounding: float32 precision against the oracle, exact against that same re-weighted backward
        assert_matches(got, ref, rtol=1e-5, what=f"{name} {mode} {path}: float32 inside the model")
        with default_dtype(torch.float64):
            ref = reweighted_reference(case, R)
    assert_matches(got, ref, what=f"{name} {mode} {path}")


# ------------------------------------------------------------------------------------------ an argument shared, as long as B
class RotaryMixer(nn.Module):
    """Gets the tokens [B, 1 + L, d] (a class token, then L patches) and a table every sample shares, as long as the
    patches ([L, d] rotary angles as timm's EVA passes them, or an [L, L] bias between patches); weights of its own
    (no rule)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))
        self.mix = nn.Parameter(torch.randn(D, D) / math.sqrt(D))

    def forward(self, x, shared):
        cls, patches = x[:, :1], x[:, 1:]
        if self.kind == "rotary":
            patches = patches * torch.cos(shared) + patches.flip(-1) * torch.sin(shared)
        scores = patches @ patches.transpose(1, 2) / math.sqrt(D)
        if self.kind == "bias":
            scores = scores + shared
        out = scores.softmax(-1) @ (patches @ self.mix) + cls
        return torch.tanh(torch.cat([cls, out], 1) * self.weight)


class RotaryNet(nn.Module):
    def __init__(self, kind: str, L: int):
        super().__init__()
        self.kind = kind
        self.embed, self.mixer, self.head = nn.Linear(D, D), RotaryMixer(kind), nn.Linear(D, 3)
        self.register_buffer("angles", torch.arange(L)[:, None] * torch.linspace(0.1, 1.0, D)[None])
        self.register_buffer("bias", torch.randn(L, L))

    def forward(self, x):
        shared = self.angles if self.kind == "rotary" else self.bias
        return self.head(self.mixer(self.embed(x), shared).mean(1))


def random_rotary_net(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    L = rng.randint(2, 4)
    B = rng.choice([L, L, 2, 3])
    model = RotaryNet(rng.choice(["rotary", "bias"]), L).double()
    what = f"seed {seed}: {model.kind} [{L}, ...] shared, B={B} L={L}"
    return model, _batches(rng, g, B, L + 1, rng.random() < 0.5), False, what


@SETTINGS
@given(seed=SEEDS)
def test_an_argument_as_long_as_the_batch_that_every_sample_shares_is_exact(seed):
    model, batches, refused, what = random_rotary_net(seed)
    _check(model, batches, refused, what, seed)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("path", ["engine", "mean"])
def test_hidden_states_a_replayed_module_collected_are_refused_in_the_loss(path):
    """SEW-D summing its layers' hidden states (use_weighted_layer_sum): Hugging Face collects them by hooks on the
    layers, inside the call of the encoder that the fallback replays (it claims the relative table and its
    projections); their gradient would reach those parameters around the replay. Refused, naming the encoder (it was
    silently wrong once the replays stopped adding to the collection)."""
    pytest.importorskip("transformers")
    import zoo_configs
    conf = zoo_configs.configuration("hf/sew-d/weighted layer sum (use_weighted_layer_sum)")
    case = zoo_configs.CASES["hf"](conf)
    with pytest.raises(ValueError, match=r"encoder \(SEWDTransformerEncoder\): the loss depends on a tensor computed "
                                         r"inside its call that left it other than through its output"):
        engine_clipped_sum(case, quiet=True, mode="bk-mixopt", path=path, max_grad_norm=1.0)
