"""A module without a rule whose output is a view of its own parameter, depending on no input that requires grad,
gets a zero private gradient: its parameter is silently dropped from the clipped sum (and from the norm).

(a) a position table returned as ``self.table[:T].unsqueeze(0)`` ([1, T, d], broadcast over the batch by the model's
    addition; ``PositionParam`` in tests/test_fallback.py): exact for B >= 2 (``expand_batch`` hooks a fresh
    ``expand`` of it), dropped for B = 1;
(b) a class token returned as ``self.cls.expand(B, -1, -1)`` (ViT's, as a module of its own): dropped at every B.

What the trace shows (capture.Capture._record): the layer's parameters have requires_grad switched off during its
call, so the output view is made without history; by the time ``_record`` looks at it the parameter's requires_grad
is back on, and a view of a leaf reports ``requires_grad=True`` with ``grad_fn=None``. ``_record`` then skips
``_Origin`` and hooks the view with ``register_hook``, which never fires; the gradient goes to the parameter's own
(non-private) ``.grad`` path, the engine's hook never sees it, and the step writes 0 for that parameter.

Run: PYTHONPATH=src python repros/fallback_output_view_of_own_parameter.py
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import clipped_gradient, per_sample_gradients

D = 4


class PositionTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, D))

    def forward(self, x):
        return self.table[: x.shape[1]].unsqueeze(0)  # [1, T, d], a view of the parameter


class ClassToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x):
        return self.cls.expand(x.shape[0], -1, -1)  # [B, 1, d], a view of the parameter


class TableNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.head = PositionTable(), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(torch.tanh(x + self.pos(x)).mean(1))


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.head = ClassToken(), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(torch.tanh(torch.cat([self.tok(x), x], 1)).mean(1))


def losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


torch.manual_seed(0)
for net, name in ((TableNet().double(), "pos.table"), (TokenNet().double(), "tok.cls")):
    for B in (1, 3):
        x, y = torch.randn(B, 3, D, dtype=torch.float64), torch.arange(B) % 3
        want = {n: g.sum(0) for n, g in per_sample_gradients(net, losses, (x, y)).items()}  # unclipped sum
        for mode, path in (("bk-mixopt", "engine"), ("per-sample", "engine"), ("ghost", "engine"), ("bk", "mean")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback's warning
                got = clipped_gradient(net, losses, (x, y), mode=mode, path=path, max_grad_norm=1e9)  # no clipping
            err = max((got[n] - want[n]).abs().max().item() for n in want)
            print(f"{type(net).__name__:8s} B={B} {mode:10s} {path:6s} max |engine - oracle| = {err:.3g}; "
                  f"{name}: engine |g| = {got[name].norm():.4g}, oracle |g| = {want[name].norm():.4g}")
