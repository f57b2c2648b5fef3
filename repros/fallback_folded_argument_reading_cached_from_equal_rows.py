"""SILENTLY WRONG. A module without a rule on tokens folded into the batch ([B*T, d]) with a per-sample argument
[B, d] that the module repeats over each sample's rows itself (FiLM: a conditioning per sample, here a class
embedding). ``FallbackRule._per_sample_of_rows`` reads whether such an argument is per sample or shared by replaying
the call with it whole first, then by sample, and caches the first reading that reproduces the call, keyed by the
call's signature (shapes and dtypes), the batch and the rows' samples: not by the values.

When a model call's samples all have the same conditioning (a batch of one class, one prompt, one diffusion timestep),
the replay with the argument whole reproduces the call, so "shared" is cached. The next call of the same shapes in
the step (the next micro-batch, the next batch before the step) is replayed with the argument whole, without the
check, though its samples' conditionings differ: every sample's rows are paired with the other samples'
conditionings, and the per-sample gradients are wrong, with no error. Each batch alone is exact.

Run: PYTHONPATH=src python repros/fallback_folded_argument_reading_cached_from_equal_rows.py
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import clipped_gradient, max_relative_error, reference_clipped_gradient

torch.set_default_dtype(torch.float64)
D = 4


class FiLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))
        self.shift = nn.Parameter(torch.randn(D))

    def forward(self, x, cond):  # x [B*T, d] (tokens folded in blocks), cond [B, d]
        return torch.tanh(x * self.weight + cond.repeat_interleave(x.shape[0] // cond.shape[0], 0) * self.shift)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.film, self.head = FiLM(), nn.Linear(D, 3)
        self.register_buffer("classes", torch.randn(3, D))

    def forward(self, x, c):  # x [B, T, d], c [B]: each sample's conditioning class
        B, T, _ = x.shape
        return self.head(self.film(x.reshape(B * T, D), self.classes[c]).reshape(B, T, D).mean(1))


def losses(m, x, c, y):
    return F.cross_entropy(m(x, c), y, reduction="none")


torch.manual_seed(0)
model = Net()
g = torch.Generator().manual_seed(0)
for B, T in ((3, 3), (2, 4)):  # the whole argument fits the call where T is a multiple of B
    same = (torch.randn(B, T, D, generator=g), torch.zeros(B, dtype=torch.long), torch.arange(B) % 3)
    mixed = (torch.randn(B, T, D, generator=g), torch.arange(B) % 3, (torch.arange(B) + 1) % 3)
    R = 0.05
    for name, batches in (("mixed classes alone", (mixed,)), ("one class alone", (same,)),
                          ("one class, then mixed classes (one step)", (same, mixed)),
                          ("mixed classes, then one class (one step)", (mixed, same))):
        joined = tuple(torch.cat(t) for t in zip(*batches))
        ref = reference_clipped_gradient(model, losses, joined, max_grad_norm=R)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = clipped_gradient(model, losses, *batches, mode="bk-mixopt", max_grad_norm=R)
        err, worst = max_relative_error(got, ref)
        print(f"B={B} T={T} {name:42s} max relative error {err:.3g} ({worst})")
    # the same through micro-batches of one batch: the first half of one class, the second half mixed
    x, c, y = (torch.cat([s, m]) for s, m in zip(same, mixed))
    ref = reference_clipped_gradient(model, losses, (x, c, y), max_grad_norm=R)
    for mode, path in (("bk-mixopt", "engine"), ("ghost", "engine"), ("per-sample", "mean")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = clipped_gradient(model, losses, (x, c, y), mode=mode, path=path, max_grad_norm=R, micro_batches=2)
        print(f"B={B} T={T} two micro-batches, {mode} {path}: max relative error {max_relative_error(got, ref)[0]:.3g}")
