"""Clipping groups disagree between the engine and the oracle (dptrain.testing) for parameters that a module without
a rule claims from its descendants: a child's weight read in the parent's forward (``reads_child_params``) and weight
norm's ``parametrizations.weight.original0/1``.

- ``clipping_style="layer-wise"``: the engine puts the claimed parameters in the group of the module that claims
  them (one group: scale, proj.weight, proj.bias); the oracle groups by owning module (``fb`` and ``fb.proj``, or
  ``fb`` and ``fb.parametrizations.weight``), so it has one more group (K differs, R/sqrt(K) too) and splits the
  layer. Every mode, both paths: the results differ by ~1e-2 where the tolerance is 1e-10.
- explicit groups ``[["first", "head"], ["fb"]]``: the engine accepts them (``fb`` covers what it claims), the
  oracle's ``_groups`` leaves ``fb.proj.*`` / ``fb.parametrizations.weight.*`` in no group (so its clipped sum has no
  entry for them).

param-wise and all-layer agree. Which reading is the spec is a design question (the engine's "the layer that handles
the parameter" is the natural one for weight norm); they should agree either way.

Run: PYTHONPATH=src python repros/claimed_child_params_clipping_groups.py
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.layers.registry import reads_child_params
from dptrain.testing import clipped_gradient, max_relative_error, reference_clipped_gradient, threshold_between

torch.set_default_dtype(torch.float64)
D = 4


class ReadsChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.scale = nn.Parameter(1 + 0.5 * torch.randn(D))

    def forward(self, x):
        return torch.tanh(F.linear(x, self.proj.weight, self.proj.bias) * self.scale)


reads_child_params(lambda m: isinstance(m, ReadsChild), lambda m: ("proj.weight", "proj.bias"))


class Net(nn.Module):
    def __init__(self, fb):
        super().__init__()
        self.first, self.fb, self.head = nn.Linear(D, D), fb, nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.fb(torch.tanh(self.first(x)))).mean(1)


def losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(5, 3, D, generator=g), torch.randint(0, 3, (5,), generator=g)
for name, fb in (("reads_child_params", ReadsChild()),
                 ("weight_norm", nn.utils.parametrizations.weight_norm(nn.Linear(D, D)))):
    model = Net(fb)
    for style in ("all-layer", "param-wise", "layer-wise", [["first", "head"], ["fb"]]):
        R = threshold_between(model, losses, (x, y), clipping_style=style)
        ref = reference_clipped_gradient(model, losses, (x, y), max_grad_norm=R, clipping_style=style)
        for mode, path in (("bk-mixopt", "engine"), ("ghost", "engine"), ("per-sample", "mean")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = clipped_gradient(model, losses, (x, y), mode=mode, path=path, max_grad_norm=R,
                                       clipping_style=style)
            if set(got) != set(ref):
                print(f"{name:18s} {str(style):28s} {mode:10s} {path:6s} names differ: engine has "
                      f"{sorted(set(got) - set(ref))} that the oracle's groups leave out")
                continue
            err, worst = max_relative_error(got, ref)
            print(f"{name:18s} {str(style):28s} {mode:10s} {path:6s} max relative error {err:.3g} ({worst})")
