"""A module without a rule that mixes the samples only on some data (an expert with a capacity: when more tokens of
the call than its capacity are routed to it, the ones over capacity are dropped, so a sample's output depends on the
other samples' tokens, as mixture-of-experts layers with a capacity factor do). The fallback checks that a module
keeps the samples apart once per call signature (shapes, dtypes, mode), on the first call: a first step whose
tokens fit the capacity passes the check, and a later step of the same shapes that overflows it is replayed one
sample at a time without the check: each sample's replay sees only its own tokens (never over capacity), so the
per-sample gradients are those of a model that drops nothing, while the batch dropped tokens. Silently wrong, and
one sample's data changes the others' clipped terms.

This is the documented design (fallback.py: "On the first call per module, input shapes and mode the rule checks
this"), shown here as what it lets through. The same module on the overflowing batch first is refused, naming it.

Run: PYTHONPATH=src python repros/fallback_mixing_checked_once_per_signature.py
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import clipped_gradient, max_relative_error, reference_clipped_gradient

torch.set_default_dtype(torch.float64)
D = 4


class CappedExpert(nn.Module):
    """Tokens whose first feature is positive go to the expert, at most ``capacity`` of them in the call (in order);
    the others pass through."""

    def __init__(self, capacity=3):
        super().__init__()
        self.capacity = capacity
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))

    def forward(self, x):  # [N, d]: the tokens of every sample, folded
        routed = (x[:, 0] > 0) & (torch.cumsum((x[:, 0] > 0).long(), 0) <= self.capacity)
        return torch.where(routed[:, None], torch.tanh(x * self.weight), x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.expert, self.head = CappedExpert(), nn.Linear(D, 3)

    def forward(self, x):  # [B, T, d]
        B, T, _ = x.shape
        return self.head(self.expert(x.reshape(B * T, D)).reshape(B, T, D).mean(1))


def losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


torch.manual_seed(0)
model = Net()
B, T = 3, 2
fits = torch.randn(B, T, D)
fits[..., 0] = -1.0
fits[0, 0, 0] = 1.0  # one routed token: within the capacity, whatever the perturbation of sample 0 does
overflows = torch.randn(B, T, D)
overflows[..., 0] = 1.0  # six routed tokens, capacity 3: the second half of the batch is dropped
y = torch.tensor([0, 1, 2])
R = 0.05
for name, batches in (("fits alone", ((fits, y),)), ("overflows alone", ((overflows, y),)),
                      ("fits, then overflows (one step)", ((fits, y), (overflows, y)))):
    joined = tuple(torch.cat(t) for t in zip(*batches))
    ref = reference_clipped_gradient(model, losses, joined, max_grad_norm=R)  # each sample alone: never over capacity
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = clipped_gradient(model, losses, *batches, mode="bk-mixopt", max_grad_norm=R)
        err, worst = max_relative_error(got, ref)
        print(f"{name:34s} accepted: max relative error {err:.3g} ({worst})")
    except (RuntimeError, ValueError) as err:
        print(f"{name:34s} refused: {str(err)[:110]}")
