"""A module without a rule returns a container whose leaves are its per-sample features [B, T, d] and a table of its
own parameters [n, n] (T5-like position bias without the leading 1) that the model leaves unused. The fallback
takes the rows from the leaves' leading sizes (``FallbackRule.capture_leaves``: "the model's batch size where one of
them does"): when n happens to equal B, the table is taken for a per-sample leaf and the replay one sample at a time
fails, so the model is refused, though the same model is exact at any other B (tests/test_fallback.py's
``test_output_without_the_batch_that_no_gradient_reaches_is_left_alone`` runs B=4, n=3). In folded layouts
(the features [B*T, d]) with n == B, the features are the ones taken for shared.

Run: PYTHONPATH=src python repros/container_leaf_as_long_as_the_batch.py
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import clipped_gradient, reference_clipped_gradient

D, N = 4, 3


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D))
        self.table = nn.Parameter(torch.randn(N, N))

    def forward(self, x):
        return x * self.weight, torch.tanh(self.table)  # the table: [N, N], no batch


class Net(nn.Module):
    def __init__(self, folded: bool):
        super().__init__()
        self.folded = folded
        self.first, self.block, self.head = nn.Linear(D, D), WithTable(), nn.Linear(D, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        B, T, _ = h.shape
        if self.folded:
            h = self.block(h.reshape(B * T, D))[0].reshape(B, T, D)
        else:
            h = self.block(h)[0]  # the table is left unused
        return self.head(h).mean(1)


def losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


torch.manual_seed(0)
for folded in (False, True):
    model = Net(folded).double()
    for B in (2, N, 4):
        x, y = torch.randn(B, 5, D, dtype=torch.float64), torch.arange(B) % 3
        ref = reference_clipped_gradient(model, losses, (x, y), max_grad_norm=0.1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = clipped_gradient(model, losses, (x, y), mode="bk-mixopt", max_grad_norm=0.1)
            print(f"folded={folded} B={B}: max |engine - oracle| = "
                  f"{max((got[n] - ref[n]).abs().max().item() for n in ref):.3g}")
        except (RuntimeError, ValueError) as err:
            print(f"folded={folded} B={B}: refused: {type(err).__name__}: {str(err)[:260]}")
