"""A module without a rule returns a table of its own [1, w, d] that the model broadcasts over windows folded into
the batch ([B * W, w, d]), as a position bias of window attention is. The engine takes the size-1 output for a table
broadcast over the batch (``FallbackRule.expand_batch``); its one row then meets the B * W windows, not the B samples.

Status: no longer silently wrong. It was: the expansion to [B, w, d] changed the module's output, so the model's own
forward failed (B >= 2) with torch's shape error, and at B = 1 the table got no gradient (an output that is a view of
the module's own parameter: fixed). Now: exact at B = 1; at B >= 2 refused (RowsMixSamples naming ``pos``) by the
rows' reading, though the same model runs without the engine and the oracle is defined: a false refusal, pinned by
``test_pinned_a_table_broadcast_over_windows_is_exact`` (xfail, strict) in tests/test_fallback_property.py.

Run: PYTHONPATH=src python repros/fallback_table_broadcast_over_windows.py
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.testing import clipped_gradient, max_relative_error, reference_clipped_gradient

torch.set_default_dtype(torch.float64)
D = 4


class PositionTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, D))

    def forward(self, x):
        return self.table[: x.shape[1]].unsqueeze(0)  # [1, w, d]


class Net(nn.Module):
    def __init__(self, W=2):
        super().__init__()
        self.W, self.pos, self.head = W, PositionTable(), nn.Linear(D, 3)

    def forward(self, x):  # [B, T, d]
        B, T, _ = x.shape
        windows = x.reshape(B * self.W, T // self.W, D)  # windows folded into the batch
        windows = torch.tanh(windows + self.pos(windows))  # the table broadcast over the B * W windows
        return self.head(windows.reshape(B, T, D).mean(1))


def losses(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


torch.manual_seed(0)
model = Net()
for B in (1, 2, 3):
    x, y = torch.randn(B, 4, D), torch.arange(B) % 3
    ref = reference_clipped_gradient(model, losses, (x, y), max_grad_norm=0.05)  # the model runs without the engine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = clipped_gradient(model, losses, (x, y), mode="bk-mixopt", max_grad_norm=0.05)
        err, worst = max_relative_error(got, ref)
        print(f"B={B}: max relative error {err:.3g} ({worst}); pos.table: engine |g| = {got['pos.table'].norm():.4g}, "
              f"oracle |g| = {ref['pos.table'].norm():.4g}")
    except Exception as err:  # noqa: BLE001
        print(f"B={B}: refused under the engine: {type(err).__name__}: {str(err)[:120]}")
