"""A call of a module without a rule whose output leads with 1 where the model's batch is B > 1 is taken for a table
broadcast over the batch: ``FallbackRule.expand_batch`` (capture.Capture._record) expands the output to [B, ...]
and keeps the arguments whole. When the rows of that expanded output are then regrouped by sample
(``FallbackRule.regroup_call``: the rows read from the gradient are not the identity), the check of the folded rows
replays the call (1 row) and indexes it with the expanded rows' order: IndexError
(``_check_folded_outputs``: ``whole[order]``), neither the sample's clipped gradient nor a refusal naming the module.

Two ways to get there, both with one sample contributing (every other loss weighted 0, as padding does):
(a) a module run sequence-first on [T, B, d] with T = 1: its output [1, B, d] is taken for a broadcast table;
(b) a position table of its own [1, T, d] added to the tokens, then a mean over the batch: every expanded row
    carries the one sample's gradient.
With two samples contributing both are refused properly (RowsMixSamples naming the module).

Run: PYTHONPATH=src python repros/fallback_expanded_call_regrouped.py
"""
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import clipped_gradient

torch.set_default_dtype(torch.float64)
D = 4


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(D))
        self.bias = nn.Parameter(0.5 * torch.randn(D))

    def forward(self, x):
        return torch.tanh(x * self.weight + self.bias)


class PositionTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, D))

    def forward(self, x):
        return self.table[: x.shape[1]].unsqueeze(0)  # [1, T, d]


class SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.head = Gate(), nn.Linear(D, 3)

    def forward(self, x):  # [B, T, d]
        return self.head(self.gate(x.transpose(0, 1)).transpose(0, 1).mean(1))


class TableThenBatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.lin, self.head = PositionTable(), nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        h = x + self.pos(x)
        h = h + torch.tanh(self.lin(h)).mean(0, keepdim=True)
        return self.head(h.mean(1))


torch.manual_seed(0)
for net, T in ((SequenceFirst(), 1), (SequenceFirst(), 2), (TableThenBatchMean(), 2)):
    for weights in ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0]):
        x, y, w = torch.randn(3, T, D), torch.tensor([0, 1, 2]), torch.tensor(weights)

        def losses(m, x, y, w):
            return F.cross_entropy(m(x), y, reduction="none") * w

        what = f"{type(net).__name__} T={T} loss weights {weights}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = clipped_gradient(net, losses, (x, y, w), mode="bk-mixopt", max_grad_norm=1e-3)
            print(f"{what}: accepted, update norm {torch.sqrt(sum(g.square().sum() for g in got.values())):.4g}")
        except (ValueError, RuntimeError) as err:
            print(f"{what}: refused: {type(err).__name__}: {str(err)[:100]}")
        except Exception as err:  # noqa: BLE001
            frame = traceback.extract_tb(err.__traceback__)[-1]
            print(f"{what}: CRASH {type(err).__name__}: {err} (in {frame.name}, "
                  f"{frame.filename.split('src/')[-1]}:{frame.lineno})")
