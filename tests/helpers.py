"""Helpers shared by the test modules: model cases, and ``dptrain.testing``'s runner, threshold and comparison
applied to a case.

A *case* is a model, a per-sample loss function ``losses_fn(model, *batch) -> [B, ...]``
and a batch (tuple of tensors, batch first). Builders take a seed and draw the shapes
from it, so every case is random but reproducible. Build cases under float64 (the
``float64`` fixture in conftest.py).
"""
from __future__ import annotations

import contextlib
import copy
import math
import random
import socket
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import (  # noqa: F401  (max_relative_error: for tests/zoo.py)
    clipped_gradient,
    max_relative_error,
    mismatches,
    per_sample_gradients,
    reference_clipped_gradient,
    threshold_between,
    trainable_named_parameters,
)

MODES = tuple(dptrain.CLIPPING_MODES)
SINGLE_BACKWARD_MODES = tuple(m for m in MODES if not dptrain.RECIPES[m].two_pass)
TWO_PASS_MODES = tuple(m for m in MODES if dptrain.RECIPES[m].two_pass)
CLIPPING_FNS = ("abadi", "automatic", "global")
# "groups" stands for an explicit list-of-lists grouping of the model's trainable modules.
STYLES = ("all-layer", "layer-wise", "param-wise", "groups")

RTOL = 1e-10  # relative to the largest absolute entry of the reference


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    model: nn.Module
    losses_fn: Callable
    batch: tuple

    def losses(self, model: nn.Module | None = None, batch: tuple | None = None) -> torch.Tensor:
        return self.losses_fn(self.model if model is None else model, *(self.batch if batch is None else batch))

    @property
    def batch_size(self) -> int:
        return self.batch[0].shape[0]


class Opaque(torch.autograd.Function):
    """The identity, as an operation the row proof (``dptrain.rows.proof``) has no rule for, as a user's autograd
    Function is: the rows of the layers before it are read by tag passes."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside, restored after (the ``float64`` fixture; hypothesis tests,
    which cannot take function-scoped fixtures, use it directly)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def per_sample(losses: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B], summing each sample's non-batch dims (what engine.backward does)."""
    return losses.reshape(losses.shape[0], math.prod(losses.shape[1:])).sum(1)


def classify(model, *inputs):
    """Cross entropy of ``model(*inputs[:-1])`` against ``inputs[-1]``, per sample: [B]."""
    *xs, y = inputs
    return F.cross_entropy(model(*xs), y, reduction="none")


def classify_tokens(model, *inputs):
    """Token-level cross entropy, [B, T] (the engine and the oracle sum it per sample)."""
    *xs, y = inputs
    logits = model(*xs)
    C = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, C), y.reshape(-1), reduction="none").reshape(y.shape)


def _classes(out_shape, C, B, g):
    return torch.randint(0, C, (B, *out_shape), generator=g)


class TokenMLP(nn.Module):
    """Linear -> tanh -> Linear applied to the last dim of [B, *, d]."""

    def __init__(self, d, h, C, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=bias)
        self.fc2 = nn.Linear(h, C, bias=bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def linear_case(seed: int, token_dims: int, bias: bool = True) -> Case:
    """TokenMLP on inputs [B, d] (token_dims=0), [B, T, d] (1) or [B, H, W, d] (2)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B, d, h, C = rng.randint(4, 6), rng.randint(2, 7), rng.randint(2, 7), rng.randint(2, 4)
    tokens = [rng.randint(1, 4) for _ in range(token_dims)]
    model = TokenMLP(d, h, C, bias=bias)
    x = torch.randn(B, *tokens, d, generator=g) * 2
    y = _classes(tokens, C, B, g)
    return Case(model, classify_tokens, (x, y))


def mlp_inplace_relu_case(seed: int) -> Case:
    """In-place ReLU directly on the output of the first Linear (whose input needs no grad)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B, d, h, C = rng.randint(4, 6), rng.randint(3, 6), rng.randint(4, 8), 3
    model = nn.Sequential(nn.Linear(d, h), nn.ReLU(inplace=True), nn.Linear(h, h), nn.ReLU(inplace=True),
                          nn.Linear(h, C))
    return Case(model, classify, (torch.randn(B, d, generator=g) * 2, _classes((), C, B, g)))


class BiTFiTNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 3 * 3, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.gn(self.conv(x))).flatten(1)
        return self.head(torch.tanh(self.ln(self.fc(h))))


def bitfit_case(seed: int) -> Case:
    """Only the biases are trainable (BiTFiT): conv, GroupNorm, Linear and LayerNorm biases."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = BiTFiTNet()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    B = 5
    return Case(model, classify, (torch.randn(B, 2, 5, 5, generator=g) * 2, _classes((), 3, B, g)))


def partly_frozen_case(seed: int) -> Case:
    """A frozen first layer, a layer with a trainable weight but frozen bias, a trainable head."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    B = 5
    return Case(model, classify_tokens, (torch.randn(B, 3, 5, generator=g) * 2, _classes((3,), 3, B, g)))


# --- convolutions
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_SPATIAL = {1: 12, 2: 7, 3: 5}


class ConvNet(nn.Module):
    def __init__(self, convs: Sequence[nn.Module], head_in: int, C: int):
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.head = nn.Linear(head_in, C)

    def body(self, x):
        for conv in self.convs:
            x = torch.tanh(conv(x))
        return x.flatten(1)

    def forward(self, x):
        return self.head(self.body(x))


def conv_case(seed: int, ndim: int) -> Case:
    """Five convolutions covering every padding_mode (zeros, reflect, replicate, circular),
    random kernel/stride/dilation, groups (incl. depthwise), int, per-dim, 'same' and 'valid'
    padding, with and without bias; then a Linear head."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    Conv = _CONV[ndim]
    B, C = 4, 3
    for _ in range(200):
        size = _SPATIAL[ndim] + rng.randint(0, 1)
        per_dim = lambda choices: tuple(rng.choice(choices) for _ in range(ndim))  # noqa: E731
        convs = [
            Conv(4, 6, per_dim([1, 2, 3]), stride=per_dim([1, 2]), padding=rng.choice([rng.randint(0, 2), per_dim([0, 1, 2])]),
                 dilation=per_dim([1, 2]), groups=rng.choice([1, 2]), padding_mode="zeros"),
            Conv(6, 12, per_dim([2, 3]), padding="same", groups=6,  # depthwise; even kernels pad asymmetrically
                 padding_mode="reflect", bias=rng.random() < 0.5),
            Conv(12, 8, per_dim([1, 2, 3]), stride=per_dim([1, 2]), padding=per_dim([1, 2]), groups=rng.choice([2, 4]),
                 padding_mode="replicate"),
            Conv(8, 4, per_dim([2, 3]), padding=rng.randint(1, 2), dilation=per_dim([1, 2]), padding_mode="circular"),
            Conv(4, 3, 2, padding="valid", stride=rng.choice([1, 2]), bias=False),
        ]
        x = torch.randn(B, 4, *([size] * ndim), generator=g) * 2
        try:
            with torch.no_grad():
                h = x
                for conv in convs:
                    h = conv(h)
        except RuntimeError:
            continue  # e.g. reflect padding wider than the input: draw again
        if h.numel() == 0:
            continue
        model = ConvNet(convs, h[0].numel(), C)
        return Case(model, classify, (x, _classes((), C, B, g)))
    raise AssertionError("could not draw a valid convolution stack")


# --- embeddings
class TokenClassifier(nn.Module):
    def __init__(self, V, d, C, padding_idx=None):
        super().__init__()
        self.tok = nn.Embedding(V, d, padding_idx=padding_idx)
        self.seg = nn.Embedding(3, d)  # one id per sample: ids of shape [B]
        self.head = nn.Linear(d, C)

    def forward(self, ids, seg):
        return self.head(torch.tanh(self.tok(ids) + self.seg(seg)[:, None, :]))


def embedding_case(seed: int, padding_idx: int | None) -> Case:
    """Few distinct tokens so ids repeat inside a sample; padding tokens appear when padding_idx is set."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B, T, V, d, C = 5, rng.randint(4, 7), rng.randint(4, 6), rng.randint(2, 5), 3
    model = TokenClassifier(V, d, C, padding_idx)
    ids = torch.randint(0, V, (B, T), generator=g)
    if padding_idx is not None:
        ids[:, -2:] = padding_idx  # padded tails
        ids[0, 0] = padding_idx
    seg = torch.randint(0, 3, (B,), generator=g)
    return Case(model, classify_tokens, (ids, seg, _classes((T,), C, B, g)))


# --- normalisation layers
class NormBetween(nn.Module):
    """pre (Linear or Conv) -> norm -> tanh -> head (Linear per token, or flatten + Linear)."""

    def __init__(self, pre, norm, head, flatten):
        super().__init__()
        self.pre, self.norm, self.head, self.flatten = pre, norm, head, flatten

    def forward(self, x):
        h = torch.tanh(self.norm(self.pre(x)))
        return self.head(h.flatten(1) if self.flatten else h)


def layernorm_case(seed: int, multi_dim: bool = False, bias: bool = True, rms: bool = False) -> Case:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B, T, d, h, C = 5, rng.randint(2, 4), rng.randint(2, 5), rng.randint(3, 6), 3
    shape = (T, h) if multi_dim else (h,)
    if rms:
        norm = nn.RMSNorm(shape)
    else:
        norm = nn.LayerNorm(shape, bias=bias)
    with torch.no_grad():  # move the affine parameters away from their trivial initial values
        for p in norm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    model = NormBetween(nn.Linear(d, h), norm, nn.Linear(h, C), flatten=False)
    return Case(model, classify_tokens, (torch.randn(B, T, d, generator=g) * 2, _classes((T,), C, B, g)))


def channel_norm_case(seed: int, kind: str) -> Case:
    """Conv -> GroupNorm / InstanceNorm{1,2,3}d(affine=True) -> flatten -> Linear."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ndim = {"group": 2, "instance1d": 1, "instance2d": 2, "instance3d": 3}[kind]
    channels = 4
    if kind == "group":
        norm = nn.GroupNorm(2, channels)
    else:
        norm = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[ndim](channels, affine=True)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    size = {1: rng.randint(5, 8), 2: rng.randint(4, 5), 3: 3}[ndim]
    pre = _CONV[ndim](2, channels, 2)
    B, C = 5, 3
    x = torch.randn(B, 2, *([size] * ndim), generator=g) * 2
    head_in = channels * (size - 1) ** ndim
    model = NormBetween(pre, norm, nn.Linear(head_in, C), flatten=True)
    return Case(model, classify, (x, _classes((), C, B, g)))


# --- a small ResNet with GroupNorm
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.GroupNorm(2, cout))

    def forward(self, x):
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        out += identity
        return self.relu(out)


class SmallResNet(nn.Module):
    def __init__(self, C=3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, 4)
        self.relu = nn.ReLU(inplace=True)  # in place, right after the first conv's norm
        self.layer1 = BasicBlock(4, 4, 1)
        self.layer2 = BasicBlock(4, 6, 2)
        self.fc = nn.Linear(6, C)

    def forward(self, x):
        x = self.relu(self.gn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean((2, 3)))


def resnet_case(seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B = 4
    return Case(SmallResNet(), classify, (torch.randn(B, 3, 6, 6, generator=g) * 2, _classes((), 3, B, g)))


# --- a small transformer
class SelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, d = x.shape
        split = lambda t: t.reshape(B, T, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, d))


class TinyTransformer(nn.Module):
    def __init__(self, V, d, heads, max_len):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Embedding(max_len, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)  # an index of shape [B, T]
        x = self.tok(ids) + self.pos(positions)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))


def transformer_case(seed: int) -> Case:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B, T, V = 4, rng.randint(3, 6), 7
    model = TinyTransformer(V, 8, 2, max_len=8)
    ids = torch.randint(0, V, (B, T), generator=g)
    return Case(model, classify_tokens, (ids, _classes((T,), V, B, g)))  # token losses [B, T]


# --- a module called twice in one forward
class SharedLinearParallel(nn.Module):
    """The same Linear on a [B, T, d] input and on a [B, d] input, outputs combined."""

    def __init__(self, d, h, C):
        super().__init__()
        self.shared = nn.Linear(d, h)
        self.head = nn.Linear(h, C)

    def forward(self, x1, x2):
        return self.head(torch.tanh(self.shared(x1).mean(1) + self.shared(x2)))


class SharedLinearSequential(nn.Module):
    """shared(tanh(shared(inp(x)))): the second call's input depends on the first call."""

    def __init__(self, d, h, C):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.shared = nn.Linear(h, h)
        self.head = nn.Linear(h, C)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(self.inp(x))))))


class SharedConvEmbedding(nn.Module):
    """A Conv2d applied to two images of different sizes, an Embedding to two id sequences."""

    def __init__(self, V, C):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 2)
        self.emb = nn.Embedding(V, 3)
        self.head = nn.Linear(3, C)

    def forward(self, img1, img2, ids1, ids2):
        h = self.conv(img1).mean((2, 3)) + self.conv(img2).mean((2, 3))
        h = h + self.emb(ids1).sum(1) - self.emb(ids2).mean(1)
        return self.head(torch.tanh(h))


def called_twice_case(seed: int, kind: str) -> Case:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    B, d, h, C = 5, rng.randint(2, 5), rng.randint(2, 5), 3
    y = _classes((), C, B, g)
    if kind == "parallel":
        x1, x2 = torch.randn(B, rng.randint(2, 4), d, generator=g), torch.randn(B, d, generator=g)
        return Case(SharedLinearParallel(d, h, C), classify, (x1, x2, y))
    if kind == "sequential":
        return Case(SharedLinearSequential(d, h, C), classify, (torch.randn(B, d, generator=g) * 2, y))
    V = 5
    batch = (torch.randn(B, 2, 4, 4, generator=g), torch.randn(B, 2, 3, 5, generator=g),
             torch.randint(0, V, (B, 4), generator=g), torch.randint(0, V, (B, 3), generator=g), y)
    return Case(SharedConvEmbedding(V, C), classify, batch)


CASES: dict[str, Callable[[], Case]] = {
    "linear-[B,d]": lambda: linear_case(1, 0),
    "linear-[B,T,d]": lambda: linear_case(2, 1),
    "linear-[B,H,W,d]": lambda: linear_case(3, 2),
    "linear-no-bias": lambda: linear_case(4, 1, bias=False),
    "mlp-inplace-relu": lambda: mlp_inplace_relu_case(5),
    "frozen-bitfit": lambda: bitfit_case(6),
    "frozen-partly": lambda: partly_frozen_case(7),
    "conv1d": lambda: conv_case(10, 1),
    "conv2d": lambda: conv_case(20, 2),
    "conv3d": lambda: conv_case(30, 3),
    "embedding": lambda: embedding_case(8, None),
    "embedding-padding-idx": lambda: embedding_case(9, 2),
    "layernorm": lambda: layernorm_case(11),
    "layernorm-2d-shape-no-bias": lambda: layernorm_case(12, multi_dim=True, bias=False),
    "rmsnorm": lambda: layernorm_case(13, rms=True),
    "rmsnorm-2d-shape": lambda: layernorm_case(14, multi_dim=True, rms=True),
    "groupnorm": lambda: channel_norm_case(15, "group"),
    "instancenorm1d": lambda: channel_norm_case(16, "instance1d"),
    "instancenorm2d": lambda: channel_norm_case(17, "instance2d"),
    "instancenorm3d": lambda: channel_norm_case(18, "instance3d"),
    "resnet-groupnorm": lambda: resnet_case(19),
    "transformer": lambda: transformer_case(20),
    "called-twice-parallel": lambda: called_twice_case(21, "parallel"),
    "called-twice-sequential": lambda: called_twice_case(22, "sequential"),
    "called-twice-conv-embedding": lambda: called_twice_case(23, "conv-embedding"),
}

_case_cache: dict[str, Case] = {}


def get_case(name: str) -> Case:
    """The case (built once, under the current default dtype); never attach an engine to it."""
    key = f"{name}@{torch.get_default_dtype()}"
    if key not in _case_cache:
        _case_cache[key] = CASES[name]()
    return _case_cache[key]


# --------------------------------------------------------------------------- clipping groups
def trainable_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def explicit_groups(model: nn.Module) -> list[list[str]]:
    """A list-of-lists grouping: the trainable modules alternately in two groups."""
    names = trainable_modules(model)
    return [names[0::2], names[1::2]] if len(names) >= 2 else [names]


def resolve_style(style: str, model: nn.Module):
    return explicit_groups(model) if style == "groups" else style


def group_members(model: nn.Module, style) -> list[list[str]]:
    """Full parameter names per clipping group (written independently of the engine and the oracle)."""
    named = trainable_named_parameters(model)
    if style == "all-layer":
        return [list(named)]
    if style == "param-wise":
        return [[n] for n in named]
    if style == "layer-wise":
        style = [[m] for m in trainable_modules(model)]
    groups = [[n for n, (m, _) in named.items() if m in set(group)] for group in style]
    return [g for g in groups if g]  # a module holding only a tied (already owned) parameter has no group


def scaled_group_norms(case: Case, style) -> torch.Tensor:
    """[K, B] per-sample norms of each group times sqrt(K): compare directly with max_grad_norm."""
    grads = per_sample_gradients(case.model, case.losses_fn, case.batch)
    groups = group_members(case.model, style)
    norms = torch.stack([
        torch.sqrt(sum(grads[n].flatten(1).square().sum(1) for n in group)) for group in groups
    ])
    return norms * math.sqrt(len(groups))


def split_max_grad_norm(case: Case, style) -> float:
    """``dptrain.testing.threshold_between`` for a case: a max_grad_norm that clips some (sample, group) pairs
    and leaves others unclipped."""
    return threshold_between(case.model, case.losses_fn, case.batch, clipping_style=style)


# --------------------------------------------------------------------------- the engine and the oracle on a case
run_engine = clipped_gradient  # the name under which tests written before dptrain.testing.clipped_gradient call it


def engine_clipped_sum(case: Case, model: nn.Module | None = None, quiet: bool = False,
                       batches: Sequence[tuple] | None = None, **kwargs) -> dict[str, torch.Tensor]:
    """``dptrain.testing.clipped_gradient`` for a case, on ``model``, by default a fresh copy of the case's model
    (the case's own model is never attached, it serves the oracle). Pass a copy to reuse it over several runs.
    ``quiet``: no warning at all (model zoos warn about their configurations, the engine about the fallback).
    ``batches``: the batches back-propagated in turn before the one step (default: the case's batch alone)."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        model = copy.deepcopy(case.model) if model is None else model
        return clipped_gradient(model, case.losses_fn, *(batches or (case.batch,)), **kwargs)


def update_norm(before: nn.Module, after: nn.Module) -> float:
    """The norm of the change of every parameter (trainable or not) from ``before`` to ``after``."""
    return math.sqrt(sum(float((p - q).detach().square().sum()) for p, q in zip(before.parameters(),
                                                                                 after.parameters())))


def one_sample_update(model: nn.Module, losses_fn: Callable, batch, *, lr: float = 1.0, **kwargs) -> float:
    """The norm of the update of one private SGD step at ``lr`` (noise 0, batch_size 1) of ``model`` on ``batch``
    (``dptrain.testing.clipped_gradient``'s other arguments in ``kwargs``): at most max_grad_norm * lr for one
    sample (the property the accountant relies on). The model takes the step."""
    before = copy.deepcopy(model)
    clipped_gradient(model, losses_fn, batch, lr=lr, **kwargs)
    return update_norm(before, model)


def with_oracle(build: Callable[[], Case], oracle_losses_fn: Callable | None = None) -> tuple[Case, float, dict]:
    """(case, a max_grad_norm that clips some samples and not others, the oracle's clipped sum), the case built
    in float64 (warnings while building ignored). ``oracle_losses_fn``: the oracle's per-sample losses, where
    they are not the case's own (Hugging Face's loss through ``labels=``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case = build()
        R = split_max_grad_norm(case, "all-layer")
        ref = reference_clipped_gradient(case.model, oracle_losses_fn or case.losses_fn, case.batch, max_grad_norm=R)
        return case, R, ref
    finally:
        torch.set_default_dtype(previous)


def reweighted_reference(case: Case, R: float) -> dict[str, torch.Tensor]:
    """sum_i C_i dL_i/dW as one backward of sum_i C_i L_i, with C_i from the oracle's per-sample norms.

    For models that compute in float32 inside a float64 model (T5's and Llama's norms): a second backward of
    the re-weighted losses (the two-pass modes) rounds the C_i-scaled gradients there, where the oracle rounds
    unscaled ones and scales after; those modes are checked exactly against this same backward.
    """
    grads = per_sample_gradients(case.model, case.losses_fn, case.batch)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    factors = torch.clamp(R / norms, max=1.0)
    named = trainable_named_parameters(case.model)
    total = (per_sample(case.losses()) * factors).sum()
    params = [p for _, p in named.values()]
    grads = torch.autograd.grad(total, params, allow_unused=True)  # unused: Longformer's global-attention weights
    return {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(named, params, grads)}


def reference(case: Case, *, max_grad_norm, clipping_fn="abadi", clipping_style="all-layer", clipping_gamma=0.01):
    return reference_clipped_gradient(
        case.model, case.losses_fn, case.batch, max_grad_norm=max_grad_norm, clipping_fn=clipping_fn,
        clipping_style=clipping_style, clipping_gamma=clipping_gamma,
    )


def assert_matches(got, ref, rtol: float = RTOL, what: str = "") -> None:
    """|got - ref| <= rtol times the largest absolute entry of ref, for every entry (``dptrain.testing.mismatches``)."""
    failures = mismatches(got, ref, rtol=rtol, relative_to="largest", what=what)
    assert not failures, "\n".join(failures)


def spread_init(model):
    """Re-draw the weights so that every parameter gets a gradient of comparable size.

    Library inits (std 0.02 weights, unit norm scales, zero biases) leave some gradients 1e-5 of
    the largest, where the comparison relative to the largest entry would hardly test them.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not any(k in name for k in ("token", "pos", "position", "table")):
                p.normal_(0.0, 1.5 * p[0].numel() ** -0.5)
            else:
                p.add_(0.5 * torch.randn_like(p))
    return model


# --------------------------------------------------------------------------- the property tests' oracle and checks
def weighted_oracle(case: Case, clipping_style="all-layer") -> tuple[float, dict]:
    """For a case whose batch ends with per-sample loss weights (``(x, y, weights)``): a max_grad_norm that clips
    some samples and not others, and the oracle's clipped sum (in ``clipping_style``). With fewer than two samples of
    non-zero loss weight, or where all have the same gradient norm (the same data): half the norm of their summed
    gradient (1 where it is 0)."""
    with default_dtype(torch.float64):
        if int((case.batch[-1] != 0).sum()) > 1:
            try:
                R = split_max_grad_norm(case, clipping_style)
                return R, reference(case, max_grad_norm=R, clipping_style=clipping_style)
            except ValueError:  # every sample the same gradient norm
                pass
        grads = reference(case, max_grad_norm=math.inf)
        R = 0.5 * math.sqrt(sum(float(g.square().sum()) for g in grads.values())) or 1.0
        return R, reference(case, max_grad_norm=R, clipping_style=clipping_style)


def layer_names(model) -> list[str]:
    """The modules of ``model`` that hold parameters of their own: those a refusal may name."""
    return [name for name, m in model.named_modules() if name and any(True for _ in m.parameters(recurse=False))]


def assert_refused_naming_a_layer(case: Case, run) -> None:
    """``run()`` raises a ValueError or RuntimeError whose message names a layer of the case's model."""
    with pytest.raises((ValueError, RuntimeError)) as refusal:
        run()
    message = str(refusal.value)
    assert any(f"{name} (" in message for name in layer_names(case.model)), f"names no layer: {message}"


def one_sample_contributes(losses_fn):
    """``losses_fn`` with every sample's loss but the first weighted 0."""
    def losses(model, *batch):
        out = losses_fn(model, *batch)
        weights = torch.zeros_like(out)
        weights[0] = 1.0
        return out * weights
    return losses


@contextlib.contextmanager
def tag_passes_counted():
    """A list that gets an entry for every tag pass the engine runs while it is open."""
    from dptrain.core import backward

    passes = []
    original = backward.Backward._tag_pass

    def counted(self, *args, **kwargs):
        passes.append(1)
        return original(self, *args, **kwargs)

    backward.Backward._tag_pass = counted
    try:
        yield passes
    finally:
        backward.Backward._tag_pass = original
